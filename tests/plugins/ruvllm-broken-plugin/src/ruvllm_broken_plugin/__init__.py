raise RuntimeError("ruvllm-broken-plugin is broken on purpose")
