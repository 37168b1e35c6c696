"""Where ruvllm's load of a GGUF file spends its wall time and its memory (issue 60): ``ruvllm generate
FILE PROMPT --max-tokens 8`` run in this process (``ruvllm.cli.main``) under cProfile, with

* the process's RSS (all, anonymous, file pages) sampled every 0.25 s by a thread, and ``VmHWM`` (the
  peak so far, exact) read at every phase's start and end, so the phase in which the peak grew is known;
* the load's phases, timed by wrapping the package's functions from here (its code is not changed):
  ``open`` (GGUFCheckpoint: the file's header, tensor table, config), ``tokenizer``, ``convert``
  (WeightLoader.load: each tensor from the file's blocks to the backend's form, ``matrix`` /
  ``embedding`` / ``vector`` per tensor, then ``stack`` of each weight's layers), ``place``
  (shard_weights: ``jax.device_put``), ``huge pages`` (madvise), the rest of the backend's load,
  ``engine`` (LLMEngine: the KV cache), and the generation: time to the first output and the rest;
* every tensor's form: the file's type and bytes against the bytes of the form ruvllm holds it in,
  per matrix as converted and per weight as stacked (the ``weight_bytes`` the load log reports).

Writes ``profile.json`` (phases, the RSS timeline, the top functions by cumulative time, the forms)
and ``profile.prof`` (pstats) under ``--out``, and prints a summary.

    python benchmarks/profile_load.py ~/.cache/ruvllm-bench/llama3-8b-synthetic-32l-s0-Q4_K_M.gguf --out /tmp/prof

Nothing here is run by the tests.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

T0 = time.perf_counter()


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Recorder:
    """Phases (nested, in order) and per-call totals of the wrapped functions."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.timeline: list[tuple[float, int, int, int]] = []
        self.depth = 0
        self._done = threading.Event()

    def sample(self, every: float = 0.25) -> None:
        def run() -> None:
            while not self._done.is_set():
                s = status()
                self.timeline.append((time.perf_counter() - T0, s["VmRSS"], s["RssAnon"], s["RssFile"]))
                self._done.wait(every)

        threading.Thread(target=run, daemon=True).start()

    def stop(self) -> None:
        self._done.set()

    def phase(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            s0 = status()
            rec = {"phase": name, "depth": self.depth, "start_s": time.perf_counter() - T0, "rss0": s0["VmRSS"],
                   "hwm0": s0["VmHWM"]}  # fmt: skip
            self.phases.append(rec)
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                s1 = status()
                rec.update(end_s=time.perf_counter() - T0, rss1=s1["VmRSS"], hwm1=s1["VmHWM"],
                           anon1=s1["RssAnon"], file1=s1["RssFile"])  # fmt: skip

        return wrapped

    def counted(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.calls[name].append(time.perf_counter() - t)

        return wrapped


def form_of(x: Any) -> tuple[str, dict[str, int]]:
    """A held array's form (``int4 g32 sub16 asym a8 panel16`` / a dtype) and its bytes per field."""
    from ruvllm_jax.quant import ROW_FIELDS, QuantArray

    if isinstance(x, QuantArray):
        form = [f"int{x.bits}", f"g{x.group_size}" if x.group_size else "per-row"]
        form += [f"sub{x.sub_group}"] * bool(x.sub_group) + ["asym"] * (x.offset is not None)
        form += [f"zp{x.zero_point}"] * bool(x.zero_point) + [f"a{x.act_bits}"] * bool(x.act_bits)
        form += [f"panel{x.panel}"] * bool(x.panel)
        fields = {"quant": x.quant, "in_scale": x.in_scale, **{f: getattr(x, f) for f in ROW_FIELDS}}
        nbytes = {k: int(v.size * v.dtype.itemsize) for k, v in fields.items() if v is not None}
        dtypes = {k: str(v.dtype) for k, v in fields.items() if v is not None}
        return " ".join(form) + " (" + ", ".join(f"{k} {d}" for k, d in dtypes.items()) + ")", nbytes
    return str(x.dtype), {"data": int(x.size * x.dtype.itemsize)}


def install(rec: Recorder, forms: dict[str, Any]) -> None:
    """Wrap the load's functions (the classes' and modules' attributes, looked up at call time)."""
    from ruvllm import checkpoint as ckpt_mod
    from ruvllm.engine import llm_engine
    from ruvllm_jax import loading, runner

    g = ckpt_mod.GGUFCheckpoint
    g.__init__ = rec.phase("open", g.__init__)
    g.tokenizer = rec.phase("tokenizer", g.tokenizer)
    runner.JaxModel.load = classmethod(rec.phase("backend load (JaxModel.load)", runner.JaxModel.load.__func__))
    runner.shard_weights = rec.phase("place (shard_weights: device_put)", runner.shard_weights)
    runner.huge_pages = rec.phase("huge pages (madvise)", runner.huge_pages)
    loading.WeightLoader.load = rec.phase("convert (WeightLoader.load)", loading.WeightLoader.load)
    original_stack = loading._stack

    def stack(items: list) -> Any:  # labelled by what it stacks: the layers' shape and code widths
        widths = sorted({f"int{x.bits}" for x in items if hasattr(x, "bits")}) or [str(items[0].dtype)]
        label = f"stack {len(items)} x {tuple(items[0].shape)} {'+'.join(widths)}"
        return rec.phase(label, original_stack)(items)

    loading._stack = stack
    llm_engine.LLMEngine.__init__ = rec.phase("engine (LLMEngine: KV cache)", llm_engine.LLMEngine.__init__)

    for kind in ("matrix", "embedding", "vector"):
        original = getattr(loading.WeightLoader, kind)

        def per_tensor(self: Any, name: str, _original: Any = original, _kind: str = kind) -> Any:
            t = time.perf_counter()
            out = _original(self, name)
            dt = time.perf_counter() - t
            rec.calls[f"{_kind} (per tensor: the file's blocks to the held form)"].append(dt)
            raw = self.ckpt.raw_tensor(name)  # outside the timed call
            form, nbytes = form_of(out)
            forms["tensors"].append({"name": name, "kind": _kind, "file_type": raw.ggml_type,
                                     "file_bytes": int(raw.data.nbytes), "form": form, "bytes": nbytes,
                                     "start_s": t - T0, "seconds": dt, "rss_after": status()["VmRSS"],
                                     "hwm_after": status()["VmHWM"]})  # fmt: skip
            return out

        setattr(loading.WeightLoader, kind, per_tensor)

    original_load = loading.WeightLoader.load

    def load_and_record(self: Any) -> Any:
        w = original_load(self)
        from ruvllm_jax.quant import QuantArray

        held = {"embed": w.embed, "final_norm": w.final_norm, "lm_head": w.lm_head}
        held |= {f: getattr(w.layers, f) for f in w.layers.__dataclass_fields__}
        for field, x in held.items():
            if x is None:
                continue
            form, nbytes = form_of(x)
            shape = list(x.shape)  # a QuantArray's: the logical one
            forms["held"].append({"field": field, "quantized": isinstance(x, QuantArray), "shape": shape,
                                  "form": form, "bytes": nbytes})  # fmt: skip
        return w

    loading.WeightLoader.load = load_and_record

    original_stream = llm_engine.LLMEngine.stream

    def stream(self: Any, request: Any) -> Any:
        start = time.perf_counter() - T0
        rec.phases.append({"phase": "generate: to the first output", "depth": 0, "start_s": start})
        n = 0
        for out in original_stream(self, request):
            now = time.perf_counter() - T0
            if n == 0:
                s = status()
                rec.phases[-1].update(end_s=now, rss1=s["VmRSS"], hwm1=s["VmHWM"])
                rec.phases.append({"phase": "generate: the rest", "depth": 0, "start_s": now})
            n += 1
            yield out
        s = status()
        rec.phases[-1].update(end_s=time.perf_counter() - T0, rss1=s["VmRSS"], hwm1=s["VmHWM"], outputs=n)

    llm_engine.LLMEngine.stream = stream


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt", default="The history of the printing press begins in the fifteenth century, when")
    ap.add_argument("--out", type=Path, default=Path("profile-load"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("RUVLLM_LOG", "info")
    args.out.mkdir(parents=True, exist_ok=True)

    rec = Recorder()
    rec.sample()
    forms: dict[str, Any] = {"tensors": [], "held": []}
    t_import = time.perf_counter()
    from ruvllm import cli

    install(rec, forms)
    imports_s = time.perf_counter() - t_import
    cli_argv = ["generate", str(args.file), args.prompt, "--max-tokens", str(args.max_tokens), "--temperature", "0"]
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    try:
        rc = cli.main(cli_argv)
    finally:
        prof.disable()
        rec.stop()
    total = time.perf_counter() - t
    prof.dump_stats(str(args.out / "profile.prof"))
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(args.top)
    top = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][3], reverse=True
    )[: args.top * 3]:  # fmt: skip
        top.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime_s": tt, "cumtime_s": ct})

    final = status()
    calls = {k: {"calls": len(v), "seconds": sum(v)} for k, v in rec.calls.items()}
    by_type: dict[str, Counter[str]] = defaultdict(Counter)
    for t_ in forms["tensors"]:
        by_type[t_["file_type"]]["file_bytes"] += t_["file_bytes"]
        by_type[t_["file_type"]]["bytes"] += sum(t_["bytes"].values())
        by_type[t_["file_type"]]["tensors"] += 1
    report = {
        "file": str(args.file),
        "rc": rc,
        "imports_s": imports_s,
        "cli_s": total,
        "final_status": final,
        "phases": rec.phases,
        "calls": calls,
        "top_cumulative": top,
        "forms_by_file_type": {k: dict(v) for k, v in by_type.items()},
        "tensors": forms["tensors"],
        "held": forms["held"],
        "rss_timeline": [(round(t_, 2), r, a, f) for t_, r, a, f in rec.timeline],
    }
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))

    gb = 1e9
    print(f"\ncli {total:.1f} s (imports {imports_s:.1f} s before it); peak RSS (VmHWM) {final['VmHWM'] / gb:.2f} GB",
          file=sys.stderr)  # fmt: skip
    for p in rec.phases:
        if "end_s" not in p:
            continue
        grew = (p.get("hwm1", 0) - p.get("hwm0", p.get("hwm1", 0))) / gb
        print(f"{'  ' * p['depth']}{p['phase']:<45} {p['start_s']:7.1f} -> {p['end_s']:7.1f} s "
              f"({p['end_s'] - p['start_s']:6.1f} s)  RSS at end {p.get('rss1', 0) / gb:6.2f} GB, "
              f"peak {p.get('hwm1', 0) / gb:6.2f} GB (+{grew:.2f} in it)", file=sys.stderr)  # fmt: skip
    for k, v in calls.items():
        print(f"  {k}: {v['calls']} calls, {v['seconds']:.1f} s", file=sys.stderr)
    print(buf.getvalue(), file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
