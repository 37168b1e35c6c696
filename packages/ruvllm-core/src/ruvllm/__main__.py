from ruvllm.cli import main

raise SystemExit(main())
