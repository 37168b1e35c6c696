"""The ``ruvllm`` command line. Every error a user can cause ends as one line on stderr and a non-zero
exit code; plugins add sub-commands through the ``register_commands`` hook."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ruvllm import __version__
from ruvllm.errors import RuvllmError

if TYPE_CHECKING:
    from ruvllm.plugins import PluginHost
    from ruvllm.runtime import LoadedModel


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from ruvllm.backend import DTYPE_CHOICES
    from ruvllm.hub import QUANTIZATION_CHOICES, QUANTIZATION_HELP

    p.add_argument("model", help="alias (`ruvllm list`), GGUF file, HF model directory or Hub repo id")
    p.add_argument("--backend", default=None, help="backend name (default: RUVLLM_BACKEND or the best installed)")
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES), help=QUANTIZATION_HELP)
    p.add_argument(
        "--dtype",
        default=os.environ.get("RUVLLM_DTYPE", "auto"),
        choices=list(DTYPE_CHOICES),
        help="compute dtype (default: RUVLLM_DTYPE or auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(DTYPE_CHOICES),
        help="the KV cache's float dtype (default auto: the compute dtype)",
    )
    p.add_argument("--cache-dir", default=None, help="model cache (default: RUVLLM_CACHE_DIR or the user cache dir)")
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
    add_batch_invariant_arg(p)


def add_batch_invariant_arg(p: argparse.ArgumentParser) -> None:
    """``--batch-invariant`` (here and on ``ruvllm serve``): the backend option ``batch_invariant=true``."""
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)


BATCH_INVARIANT_HELP = (
    "a sequence's tokens the same whatever else runs beside it (backend option batch_invariant=true; jax: "
    "on a GPU fixed kernels, XLA flags and one decode-attention part, at some speed; on a CPU already so "
    "by default, at no cost; docs/jax-backend.md). Other backends refuse it by name"
)


def with_batch_invariant(options: list[str] | None, on: bool) -> list[str] | None:
    """``--backend-option`` items with ``batch_invariant=true`` added when ``--batch-invariant`` is on."""
    return [*(options or []), "batch_invariant=true"] if on else options


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--sampling",
        default=os.environ.get("RUVLLM_SAMPLING", "auto"),
        choices=["auto", "host", "device"],
        help="where tokens are sampled (default: RUVLLM_SAMPLING or auto: on the device where the backend "
        "prefers it, a GPU; else on the host)",
    )


def _sampling(args: argparse.Namespace):
    from ruvllm.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=list(args.stop),
    )


def backend_extra(*, threads: int | None, device: str | None, options: list[str] | None = None) -> dict[str, object]:
    """The backend options the CLI's ``--threads``, ``--device`` and ``--backend-option`` set (unset
    ones left out)."""
    from ruvllm.backend import parse_backend_options

    extra: dict[str, object] = dict(parse_backend_options(options))
    extra.update({k: v for k, v in (("threads", threads), ("device", device)) if v is not None})
    return extra


def _load(args: argparse.Namespace, host: PluginHost) -> LoadedModel:
    from ruvllm.backend import LoadOptions
    from ruvllm.runtime import load_model

    return load_model(
        args.model,
        backend=args.backend,
        options=LoadOptions(
            dtype=args.dtype,
            extra=backend_extra(
                threads=args.threads,
                device=args.device,
                options=with_batch_invariant(args.backend_option, args.batch_invariant),
            ),
        ),
        host=host,
        cache_dir=args.cache_dir,
        quantization=args.quantization,
    )


def _kv_options(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.kv_cache_dtype == "auto" else {"dtype": args.kv_cache_dtype}


def _engine_config(args: argparse.Namespace, max_model_len: int | None = None):
    """One sequence; ``max_model_len``: its longest (``generate`` knows it: the prompt and
    ``--max-tokens``, so the KV cache's default is that, not the model's whole context)."""
    from ruvllm.engine import EngineConfig

    return EngineConfig(
        max_num_seqs=1, kv_cache_options=_kv_options(args), sampling=args.sampling, max_model_len=max_model_len
    )


def _stream(model: LoadedModel, prompt_ids: list[int], sampling, config, out=sys.stdout) -> str:
    """Generate with the engine (``config``), writing text as it arrives; returns the whole completion."""
    from ruvllm.engine import LLMEngine
    from ruvllm.engine.types import GenerationRequest

    sampling.validate(model.config.vocab_size)
    engine = LLMEngine(model, config)
    pieces: list[str] = []
    for output in engine.stream(GenerationRequest(prompt_token_ids=prompt_ids, sampling=sampling)):
        for delta in output.deltas:
            if delta.text:
                out.write(delta.text)
                out.flush()
                pieces.append(delta.text)
    return "".join(pieces)


def cmd_generate(args: argparse.Namespace, host: PluginHost) -> int:
    sampling = _sampling(args)
    sampling.validate()  # before the model load, so a typo fails fast
    model = _load(args, host)
    ids = model.tokenizer.encode(args.prompt)
    _stream(model, ids, sampling, _engine_config(args, max(2, len(ids) + sampling.max_tokens)))
    sys.stdout.write("\n")
    return 0


CHAT_HELP = """commands:
  /help            this help
  /clear           forget the conversation
  /system TEXT     set the system prompt (and clear the conversation)
  /temp VALUE      set the sampling temperature
  /quit            leave (Ctrl-D works too)"""


def cmd_chat(args: argparse.Namespace, host: PluginHost) -> int:
    sampling = _sampling(args)
    sampling.validate()
    model = _load(args, host)
    tok = model.tokenizer
    if model.checkpoint.chat_template is None:
        raise RuvllmError(f"model {args.model!r} has no chat template; use `ruvllm generate` instead")
    system = args.system
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} on {model.backend.name} (/help for commands)", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            if cmd == "/quit":
                return 0
            if cmd == "/help":
                print(CHAT_HELP)
            elif cmd == "/clear":
                history.clear()
                print("conversation cleared")
            elif cmd == "/system":
                system = rest.strip() or None
                history.clear()
                print(f"system prompt {'set' if system else 'removed'}; conversation cleared")
            elif cmd == "/temp":
                try:
                    value = float(rest)
                    if not 0.0 <= value <= 2.0:
                        raise ValueError
                except ValueError:
                    print("usage: /temp VALUE with VALUE in [0, 2]")
                    continue
                sampling.temperature = value
                print(f"temperature = {value}")
            else:
                print(f"unknown command {cmd}; /help lists them")
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        reply = _stream(model, tok.encode_chat(messages), sampling, _engine_config(args))
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_plugins(args: argparse.Namespace, host: PluginHost) -> int:
    if not host.records:
        print("no plugins installed")
    for r in host.records:
        if r.error:
            print(f"{r.name} {r.version}  FAILED TO LOAD: {r.error}")
        else:
            print(f"{r.name} {r.version}  ({r.module})  hooks: {', '.join(r.hooks) or '-'}")
    for b in sorted(host.backends.values(), key=lambda b: -b.priority):
        state = "available" if b.available() else "unavailable here"
        print(f"backend {b.name}: {b.description} [priority {b.priority}, {state}]")
    return 0


def cmd_list(args: argparse.Namespace, host: PluginHost) -> int:
    from ruvllm.resolve import list_models

    rows = [("", "NAME", "HUB ID", "DOWNLOADED", "SIZE", "DESCRIPTION")]
    paths = []
    for m in list_models(args.cache_dir):
        if args.downloaded and not m.downloaded:
            continue
        have = ", ".join(m.quantizations) or ("yes" if m.downloaded else "no")
        size = _human(m.size_bytes) if m.downloaded else "-"
        rows.append(("*" if m.downloaded else " ", m.name, m.hub_id or "-", have, size, m.description))
        paths.append(m.path)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for n, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5])
        if args.long and n and paths[n - 1] is not None:
            print(f"    {paths[n - 1]}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _print_rows(rows: list[tuple[str, str]]) -> None:
    for k, v in rows:
        print(f"{k:<26} {v}")


def _hub_info(args: argparse.Namespace, missing: Exception) -> int:
    """``ruvllm info`` of a Hub model that is not downloaded: what the Hub's file lists say, or, the
    Hub out of reach, what the alias table says and that it is not downloaded."""
    from ruvllm.errors import ModelNotFoundError
    from ruvllm.hub import (
        FILE_QUANTIZATIONS,
        PREFERENCE,
        HubUnreachableError,
        pick_files,
        remote_files,
        repo_of,
        unreachable,
    )
    from ruvllm.resolve import HUB_ALIASES

    alias = HUB_ALIASES.get(args.model)
    rows = [("model", args.model)]
    if alias is not None:
        rows += [("description", alias.description), ("hub id", alias.hub_id), ("gguf repository", alias.gguf_repo)]
    rows.append(("downloaded", "no: " + str(missing)))
    listings: dict[str, object] = {}
    offline = unreachable()
    if offline is not None:
        if alias is None:
            raise missing
        _print_rows([*rows, ("files", str(offline))])
        return 0
    for q in (args.quantization,) if args.quantization else PREFERENCE:
        repo = repo_of(alias, q) if alias is not None else args.model
        if repo not in listings:
            failed = next((v for v in listings.values() if isinstance(v, HubUnreachableError)), None)
            try:
                if failed is not None:  # the Hub out of reach: once is enough
                    raise failed
                listings[repo] = {f.path: f for f in remote_files(repo)}
            except ModelNotFoundError as exc:
                listings[repo] = exc
        listing = listings[repo]
        if isinstance(listing, Exception):
            rows.append((f"{q} ({FILE_QUANTIZATIONS[q]})", f"unknown: {listing}"))
            continue
        try:
            chosen = pick_files(q, list(listing), repo)
        except ModelNotFoundError:
            rows.append((f"{q} ({FILE_QUANTIZATIONS[q]})", f"none in {repo}"))
            continue
        size = sum(listing[p].size for p in chosen)
        rows.append((f"{q} ({FILE_QUANTIZATIONS[q]})", f"{repo}/{chosen[0]}, {_human(size)}"))
    if alias is None and all(isinstance(v, Exception) for v in listings.values()):
        raise missing
    _print_rows(rows)
    return 0


def cmd_info(args: argparse.Namespace, host: PluginHost) -> int:
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.errors import ModelNotFoundError
    from ruvllm.resolve import HUB_ALIASES, downloaded_variants, has_variants, resolve

    try:
        path = resolve(args.model, cache=args.cache_dir, quantization=args.quantization)
    except ModelNotFoundError as exc:
        if not has_variants(args.model):
            raise
        return _hub_info(args, exc)
    ck = open_checkpoint(path)
    c = ck.config
    rows = [("model", args.model)]
    if (alias := HUB_ALIASES.get(args.model)) is not None:
        rows += [("hub id", alias.hub_id), ("downloaded", ", ".join(downloaded_variants(alias, args.cache_dir)))]
    rows += [
        ("path", str(path)),
        ("format", ck.format),
        ("name", c.name),
        ("architecture", c.architecture),
        ("parameters", f"{c.num_parameters / 1e6:.1f}M"),
        ("quantization", ck.quantization),
        ("context length", str(c.max_position_embeddings)),
        ("layers / heads / kv heads", f"{c.num_layers} / {c.num_heads} / {c.num_kv_heads}"),
        ("hidden / ffn / vocab", f"{c.hidden_size} / {c.intermediate_size} / {c.vocab_size}"),
        ("chat template", "yes" if ck.chat_template else "no"),
        ("size on disk", _human(ck.size_bytes)),
    ]
    if types := ck.matrix_types():
        at = next(n for n, (k, _) in enumerate(rows) if k == "quantization") + 1
        rows.insert(at, ("block types", ", ".join(f"{t} x{n}" for t, n in types.most_common())))
    for info in sorted(host.backends.values(), key=lambda b: -b.priority):
        if info.available():
            rows += [(f"{info.name}: {label}", value) for label, value in info.describe(ck)]
    _print_rows(rows)
    return 0


def cmd_download(args: argparse.Namespace, host: PluginHost) -> int:
    from ruvllm.hub import download

    path = download(
        args.repo_id, quantization=args.quantization, revision=args.revision, force=args.force, cache=args.cache_dir
    )
    print(path)
    return 0


def cmd_benchmark(args: argparse.Namespace, host: PluginHost) -> int:
    from ruvllm.bench_cli import BenchmarkSettings, ProgressBar, check_format, render, run_benchmark
    from ruvllm.embed_bench import is_embedding_ref

    if is_embedding_ref(args.model, args.cache_dir):
        return _embed_benchmark(args, host)
    settings = BenchmarkSettings(
        prompt_length=args.prompt_length,
        gen_length=args.gen_length,
        batch=args.batch,
        iterations=args.iterations,
        warmup=args.warmup,
        kv_cache_options=_kv_options(args),
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        draft_quantization=args.draft_quantization,
        draft_vocab_size=args.draft_vocab_size,
    )
    settings.validate()  # before the model load, so a typo fails fast
    check_format(args.format)
    total = (settings.warmup + settings.iterations) * (1 + settings.gen_length)
    progress = ProgressBar(sys.stderr, total) if sys.stderr.isatty() else None
    try:
        if progress is not None:
            progress.update(0, "loading model", force=True)
        report = run_benchmark(_load(args, host), settings, progress)
    finally:
        if progress is not None:
            progress.close()  # before any error line, which would otherwise land on the bar
    sys.stdout.write(render(report, args.format))
    return 0


def _embed_benchmark(args: argparse.Namespace, host: PluginHost) -> int:
    """``ruvllm benchmark`` of an embedding or cross-encoder folder: texts/s at ``--batch``."""
    from ruvllm.backend import LoadOptions
    from ruvllm.bench_cli import check_format
    from ruvllm.embed_bench import EmbedBenchmarkError, EmbedBenchmarkSettings, render_embed, run_embed_benchmark
    from ruvllm.embedding import load_embedding_model

    generative = {"--gen-length": args.gen_length != 32, "--speculative": args.speculative is not None,
                  "--draft-model": args.draft_model is not None,
                  "--kv-cache-dtype": args.kv_cache_dtype != "auto"}  # fmt: skip
    given = [flag for flag, set_ in generative.items() if set_]
    if given:
        raise EmbedBenchmarkError(f"{', '.join(given)}: not for an embedding or cross-encoder model")
    settings = EmbedBenchmarkSettings(args.batch, args.prompt_length, args.iterations, args.warmup)
    settings.validate()
    check_format(args.format)
    extra = backend_extra(threads=args.threads, device=args.device, options=args.backend_option)
    model = load_embedding_model(
        args.model, backend=args.backend, host=host, cache_dir=args.cache_dir,
        options=LoadOptions(quantization=args.quantization or "auto", dtype=args.dtype, extra=extra),
    )  # fmt: skip
    settings.validate(model.max_tokens)
    sys.stdout.write(render_embed(run_embed_benchmark(model, settings), args.format))
    return 0


def build_parser(host: PluginHost) -> argparse.ArgumentParser:
    from ruvllm.hub import FILE_QUANTIZATIONS
    from ruvllm.resolve import HUB_ALIASES

    parser = argparse.ArgumentParser(prog="ruvllm", description="ruvllm: plugin-based LLM inference")
    parser.add_argument("--version", action="version", version=f"ruvllm {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging (else RUVLLM_LOG, default WARNING)")
    parser.add_argument("--no-color", action="store_true", help="plain log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("generate", help="complete a prompt, streaming tokens to stdout")
    _add_model_args(p)
    p.add_argument("prompt")
    _add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _add_model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list plugins, their versions and hooks, and the backends")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("list", help="every model alias (Hub id, downloaded quantizations, size) and cached Hub repos")
    p.add_argument("--downloaded", action="store_true", help="only models present on this machine")
    p.add_argument("--long", action="store_true", help="show paths")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "info",
        help="architecture, parameters, quantization, context length, size; for a Hub model not downloaded, its "
        "files from the Hub",
    )
    p.add_argument("model")
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(FILE_QUANTIZATIONS),
        help="which file of a Hub model (default: the first downloaded of q4k, q8, f16, none)",
    )
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "download",
        help="download one quantization of a model alias or Hub repository into the cache (resumes if interrupted)",
    )
    p.add_argument("repo_id", metavar="NAME", help=f"an alias ({', '.join(HUB_ALIASES)}) or a Hub repo id (org/name)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(FILE_QUANTIZATIONS),
        help="which file: "
        + ", ".join(f"{k} = {v}" for k, v in FILE_QUANTIZATIONS.items())
        + " (an alias's original repository); default q4k for an alias, for a repo id its first of these",
    )
    p.add_argument("--revision", default=None)
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("benchmark", help="prefill latency, TTFT, decode tok/s and peak memory of a model on a backend")
    _add_model_args(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first (compilation, allocator growth)")
    p.add_argument("--iterations", type=int, default=5, help="timed iterations; figures are median, min and max")
    p.add_argument("--prompt-length", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--gen-length", type=int, default=32, help="decode steps after the first token")
    p.add_argument("--batch", type=int, default=1, help="sequences run together")
    p.add_argument("--format", default="table", help="table (default), json or csv")
    p.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft", "ngram+draft"],
        help="run the iterations through the engine with speculative decoding (greedy); reports the acceptance rate",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="most draft tokens per step, 1..16 (default 4)"
    )
    p.add_argument("--draft-model", default=None, help="--speculative draft or ngram+draft: the draft model, or 'same'")
    p.add_argument("--draft-quantization", default=None, help="the draft model's quantization (default auto)")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="the draft drafts over its N commonest tokens only, its output head cut (default: every token)",
    )
    p.set_defaults(func=cmd_benchmark)

    from ruvllm.embed_cli import add_embed_parser

    add_embed_parser(sub)
    host.hook.register_commands(subparsers=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ruvllm.log_setup import configure_logging
    from ruvllm.plugins import load_plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    # Logging must be set before plugins load so their import failures are reported.
    configure_logging(verbose="--verbose" in argv or "-v" in argv, color=False if "--no-color" in argv else None)
    try:
        host = load_plugins()
        parser = build_parser(host)
        args = parser.parse_args(argv)
        configure_logging(verbose=args.verbose, color=False if args.no_color else None)
        return int(args.func(args, host) or 0)
    except RuvllmError as exc:
        print(f"ruvllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
