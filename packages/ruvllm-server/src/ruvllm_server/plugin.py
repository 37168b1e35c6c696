"""The ``ruvllm serve`` command, added to core's CLI through the ``register_commands`` hook."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ruvllm import hookimpl
from ruvllm.backend import DTYPE_CHOICES
from ruvllm.engine.config import DEFAULT_KV_RULE
from ruvllm.hub_files import QUANTIZATION_CHOICES, QUANTIZATION_HELP


def _add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible HTTP API. Settings: flags > RUVLLM_* environment "
        "> --config TOML file > defaults.",
    )
    p.add_argument(
        "model", nargs="*", default=None,
        help="alias (smollm2), GGUF file, HF directory or Hub repo id; several: one server for all of them, each "
        "loaded when a request names it (by file stem or alias)",
    )  # fmt: skip
    p.add_argument(
        "--models-dir", default=None,
        help="serve every GGUF file and model folder in DIR, named by file stem, each loaded on first use",
    )  # fmt: skip
    p.add_argument(
        "--models-config", default=None, metavar="FILE",
        help="TOML file of per-model settings: [models.NAME] tables with model = PATH and quantization, backend, "
        "max_context, kv_cache_memory, ..., aliases = [...], keep_alive, preload",
    )  # fmt: skip
    p.add_argument("--models-max", type=int, default=None, help="most models loaded at once, LRU beyond (default 3)")
    p.add_argument(
        "--models-memory", default=None,
        help="memory the loaded models' weights and KV caches may take, e.g. 12GiB; the least recently used idle "
        "model is unloaded to make room (default: 80%% of the memory available at start)",
    )  # fmt: skip
    p.add_argument(
        "--keep-alive", default=None,
        help="with several models: how long an idle model stays loaded (seconds or 5m, 1h; -1: always; 0: unload "
        "after each request; a request's own keep_alive wins) (default 5m)",
    )  # fmt: skip
    p.add_argument(
        "--model-load-timeout", type=float, default=None, metavar="SECONDS",
        help="how long a request waits for its model to load before a 503 (default 600)",
    )  # fmt: skip
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--backend", default=None, help="backend name (default: RUVLLM_BACKEND or the best installed)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_CHOICES), help=QUANTIZATION_HELP)
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPE_CHOICES),
        help="compute dtype (default auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels (default: the usable CPUs)")
    p.add_argument(
        "--device",
        default=None,
        help="the device the backend runs on (mlx: auto, gpu or cpu; a backend without the choice refuses it)",
    )
    p.add_argument(
        "--backend-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a load option of the backend (repeatable), e.g. mmap_experts=true or attention=pallas on jax; "
        "a backend refuses a key it does not know by name",
    )
    from ruvllm.cli import add_batch_invariant_arg

    add_batch_invariant_arg(p)
    p.add_argument("--tensor-parallel", type=int, default=None, help="devices to shard the model over (default 1)")
    p.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT: serve as process 0 of a group of --num-processes sharing one model (the others run "
        "`ruvllm follow MODEL --coordinator HOST:PORT --num-processes N --process-id I`; docs/scaling.md)",
    )
    p.add_argument("--num-processes", type=int, default=None, help="processes in the group (with --coordinator)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: from MODEL)")
    p.add_argument("--max-concurrent", type=int, default=None, help="requests served at once (default 256)")
    p.add_argument("--max-queue", type=int, default=None, help="requests waiting for a slot before 503 (default 512)")
    p.add_argument("--max-context", type=int, default=None, help="prompt + completion tokens (default: the model's)")
    p.add_argument(
        "--matryoshka-dimensions", type=lambda v: [int(x) for x in v.split(",")], default=None,
        help="an embedding model's Matryoshka sizes `dimensions` may ask for, e.g. 512,256,128 (EmbeddingGemma's card)",
    )  # fmt: skip
    p.add_argument(
        "--max-embedding-inputs", type=int, default=None,
        help="inputs one /v1/embeddings, /v1/rerank or /v1/score request may carry (default 2048)",
    )  # fmt: skip
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        dest="api_keys",
        help="required Bearer key (repeatable; RUVLLM_API_KEY)",
    )
    p.add_argument("--cors-origins", default=None, help="comma list of allowed origins, '*' for any")
    p.add_argument("--rate-limit", type=float, default=None, help="requests per second per key, 0 = off (default)")
    p.add_argument("--rate-limit-burst", type=int, default=None, help="burst size of the rate limit")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: the engine's choice)")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help=f"KV cache memory budget, e.g. 2GiB (default: {DEFAULT_KV_RULE.replace('%', '%%')})",  # argparse expands %
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences the engine batches together (default 64)")
    p.add_argument(
        "--kv-cache-quantization",
        default=None,
        help="store the KV cache quantized: int8 (every block as int8 codes, the 2 most recent blocks of each "
        "sequence also at full precision; candle-compat also int4); default none (full precision)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the device's memory for weights + KV cache, in (0, 1] (GPU backends; default 0.9 there)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(DTYPE_CHOICES),
        help="the KV cache's float dtype (default auto: the model's compute dtype)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens one engine step may carry (default 2048)"
    )
    p.add_argument(
        "--sampling",
        default=None,
        choices=["auto", "host", "device"],
        help="where tokens are sampled: on the backend's device after its step, on the host, or auto (the device "
        "where the backend prefers it: jax on a GPU); default auto",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        default=None,
        help="latency target of one engine step in ms: prompts are prefilled in chunks sized to it so streams keep "
        "a steady inter-token latency; 0 = no target (default 100)",
    )
    p.add_argument(
        "--max-step-ratio",
        type=float,
        default=None,
        help="a step that prefills may last at most this many times a decode-only step of the same streams, so "
        "the inter-token latency's tail stays within a multiple of its median; 0 = off (default 3)",
    )
    p.add_argument(
        "--no-precompile",
        dest="precompile",
        action="store_const",
        const=False,
        default=None,
        help="do not compile the step shapes before reporting ready (they then compile while serving)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft", "ngram+draft"],
        help="speculative decoding: ngram drafts tokens by prompt lookup over each request's prompt and output, "
        "draft with a second model (--draft-model), ngram+draft whichever pays more for each sequence each "
        "step; greedy output is unchanged, sampled output keeps the model's distribution (default off)",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="the draft model drafts over this many of its commonest tokens (its output head cut); the served "
        "model still verifies over the whole vocabulary (default: all)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="--speculative draft: the draft model (same tokenizer as the served one), or 'same' (the served "
        "checkpoint, e.g. with --draft-quantization w4a8)",
    )
    p.add_argument("--draft-quantization", default=None, help="the draft model's quantization (default auto)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="most draft tokens a stream offers per step, 1..16 (default 4)",
    )
    p.add_argument(
        "--no-pipeline-decode",
        dest="pipeline_decode",
        action="store_const",
        const=False,
        default=None,
        help="make each decoding step's outputs before launching the next (by default the next step is "
        "launched first where the backend runs steps asynchronously; outputs are the same either way)",
    )
    p.add_argument(
        "--precompile-prompt-logprobs",
        action="store_const",
        const=True,
        default=None,
        help="also compile, before ready, the steps that return every position's logits (prompt_logprobs, echo "
        "with logprobs): twice the shapes; without it such requests' first steps compile while serving",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="parser of tool calls in free text: hermes, llama3_json, mistral, json, or a plugin's (default: "
        "from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="split thinking into reasoning_content: think (Qwen3), deepseek_r1, or a plugin's (default: off)",
    )
    p.add_argument(
        "--responses-store-max",
        type=int,
        default=None,
        help="responses kept for previous_response_id and GET /v1/responses/{id}, least recently used out "
        "first; 0 keeps none (default 1000)",
    )
    p.add_argument(
        "--responses-store-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a stored response is kept (default 3600)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter as model NAME (repeatable; a directory or a cached Hub repo id)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted")
    p.add_argument("--max-loras", type=int, default=None, help="adapters kept on the device at once (LRU)")
    p.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        default=None,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    p.add_argument(
        "--plugin-option",
        action="append",
        default=None,
        metavar="NAME.KEY=VALUE",
        help="an option for an installed plugin (repeatable), e.g. sona.scope=user",
    )
    p.add_argument("--sona", action="store_true", default=None, help="attach SONA learning (needs ruvllm-sona)")
    p.add_argument("--sona-scope", default=None, help="SONA adapter scope: global (default), user, ...")
    p.add_argument("--sona-state-dir", default=None, help="directory SONA saves its state to")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file of settings")
    p.set_defaults(func=cmd_serve)


@hookimpl
def register_commands(subparsers: Any) -> None:
    _add_serve_parser(subparsers)


def cmd_serve(args: argparse.Namespace, host: Any = None) -> int:
    import uvicorn

    from ruvllm.cli import with_batch_invariant
    from ruvllm.errors import RuvllmError
    from ruvllm.log_setup import configure_logging
    from ruvllm_server.app import create_app
    from ruvllm_server.settings import ServerConfigError, load_settings
    from ruvllm_server.state import load_model

    given = list(args.model or [])
    flags = {
        "model": given[0] if len(given) == 1 else None,
        "models": given if len(given) > 1 else None,
        "models_dir": args.models_dir,
        "models_config": args.models_config,
        "models_max": args.models_max,
        "models_memory": args.models_memory,
        "keep_alive": args.keep_alive,
        "model_load_timeout": args.model_load_timeout,
        "host": args.host,
        "port": args.port,
        "backend": args.backend,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "threads": args.threads,
        "device": args.device,
        "backend_options": with_batch_invariant(args.backend_option, args.batch_invariant),
        "tensor_parallel": args.tensor_parallel,
        "coordinator": args.coordinator,
        "num_processes": args.num_processes,
        "served_model_name": args.served_model_name,
        "max_concurrent": args.max_concurrent,
        "max_queue": args.max_queue,
        "max_context": args.max_context,
        "matryoshka_dimensions": args.matryoshka_dimensions,
        "max_embedding_inputs": args.max_embedding_inputs,
        "api_keys": args.api_keys,
        "cors_origins": args.cors_origins,
        "rate_limit": args.rate_limit,
        "rate_limit_burst": args.rate_limit_burst,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_quantization": args.kv_cache_quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "sampling": args.sampling,
        "max_step_ms": args.max_step_ms,
        "max_step_ratio": args.max_step_ratio,
        "precompile": args.precompile,
        "precompile_prompt_logprobs": args.precompile_prompt_logprobs,
        "pipeline_decode": args.pipeline_decode,
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_model": args.draft_model,
        "draft_quantization": args.draft_quantization,
        "draft_vocab_size": args.draft_vocab_size,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "responses_store_max": args.responses_store_max,
        "responses_store_ttl": args.responses_store_ttl,
        "plugin_options": args.plugin_option,
        "lora_modules": args.lora,
        "max_lora_rank": args.max_lora_rank,
        "max_loras": args.max_loras,
        "enable_lora_runtime_updates": args.enable_lora_runtime_updates,
        "sona": args.sona,
        "sona_scope": args.sona_scope,
        "sona_state_dir": args.sona_state_dir,
    }
    settings = load_settings(flags, config_file=args.config)
    if not getattr(args, "verbose", False):
        # The server's access lines are INFO; RUVLLM_LOG still wins when set.
        os.environ.setdefault("RUVLLM_LOG", "INFO")
    configure_logging(verbose=getattr(args, "verbose", False), json=settings.log_json)
    from ruvllm_server.pool_config import model_specs, pooled

    if pooled(settings):
        from ruvllm.resolve import resolve

        specs = model_specs(settings)  # a bad config fails here, in one line
        for spec in specs:
            resolve(spec.settings.model)  # and a reference to nothing; models load when first asked for
        print("ruvllm serve " + json.dumps(settings.masked(), sort_keys=True), file=sys.stderr, flush=True)
        uvicorn.run(
            create_app(settings), host=settings.host, port=settings.port, access_log=False,
            timeout_graceful_shutdown=int(settings.drain_timeout), log_level="info",
        )  # fmt: skip
        return 0
    # Load before listening so a bad model reference fails with one line and a non-zero exit.
    try:
        model = load_model(settings)
    except RuvllmError:
        raise
    except Exception as exc:  # a loader's own failure: one line and a non-zero exit, not a traceback
        raise ServerConfigError(f"the model failed to load: {type(exc).__name__}: {exc}") from exc
    from ruvllm_server.state import load_adapters

    load_adapters(settings, model.config)  # a bad adapter fails here, in one line, before listening
    print("ruvllm serve " + json.dumps(settings.masked(), sort_keys=True), file=sys.stderr, flush=True)
    uvicorn.run(
        create_app(settings, model, start_in_background=True),  # /ready reports the step-shape compilation
        host=settings.host,
        port=settings.port,
        access_log=False,  # ours is structured and carries the request id
        timeout_graceful_shutdown=int(settings.drain_timeout),
        log_level="info",
    )
    return 0
