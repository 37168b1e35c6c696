"""Embedding throughput against sentence-transformers (torch, CPU) and llama.cpp's embedding mode,
same machine, same run: texts/s at batch 1, 32 and 256 for each model and backend (never run by the
test suite).

Each figure is the median of ``--rounds`` timed passes, the engines taking turns, after one untimed
pass each (jax compiles its shapes there), over the same texts (sentences of 8-40 words). The CPU is
printed from /proc/cpuinfo.

llama.cpp (``--llama-cpp``, through llama-cpp-python) runs the model's folder converted to a float32
GGUF by llama.cpp's own converter (``convert_hf_to_gguf.py`` with
``--sentence-transformers-dense-modules``, so EmbeddingGemma's two Dense layers are in it), taken
from the source distribution of the installed llama-cpp-python, and kept under ``--gguf-dir``; its
vectors are checked against sentence-transformers' (cosine printed) before it is timed.

    JAX_PLATFORMS=cpu python benchmarks/bench_embeddings.py MODELS/all-MiniLM-L6-v2 MODELS/embeddinggemma-300m \
        --llama-cpp
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [
        "search",
        "engine",
        "vector",
        "model",
        "sentence",
        "paris",
        "river",
        "music",
        "energy",
        "market",
        "school",
        "garden",
        "travel",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def llama_cpp_converter(work: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (with its ``gguf-py``) from the source distribution of the
    installed llama-cpp-python, unpacked under ``work`` once."""
    import importlib.metadata
    import subprocess
    import sys
    import tarfile

    version = importlib.metadata.version("llama-cpp-python")
    root = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
             f"llama-cpp-python=={version}"],
            check=True,
        )  # fmt: skip
        (sdist,) = work.glob(f"llama_cpp_python-{version}.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    return root


def gguf_of(folder: str, gguf_dir: Path, outtype: str = "f32") -> Path:
    """The model folder as a GGUF of ``outtype`` (f32, q8_0) written by llama.cpp's converter (made once)."""
    import os
    import subprocess
    import sys

    name = folder.rstrip("/").split("/")[-1]
    out = gguf_dir / f"{name}-{outtype}.gguf"
    if not out.exists():
        root = llama_cpp_converter(gguf_dir / "llama.cpp-src")
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
        subprocess.run(
            [sys.executable, str(root / "convert_hf_to_gguf.py"), folder, "--sentence-transformers-dense-modules",
             "--outtype", outtype, "--outfile", str(out)],
            check=True, env=env,
        )  # fmt: skip
    return out


def llama_cpp_engine(gguf: Path, threads: int) -> Any:
    """llama.cpp at its fastest here: one text a call. llama-cpp-python's ``embed`` packs a list into
    one ubatch whose (non-causal) attention spans all of it; on all-MiniLM-L6-v2 (Zen 4, 2 threads)
    that ran at most 110 texts/s (ubatch 64-2048, 8-256 sequences) against 139 one at a time."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(gguf), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads, verbose=False
    )
    return lambda b: [llm.embed(t, normalize=True) for t in b]


def rates(engines: dict, batch: int, items: list[str], rounds: int) -> dict[str, float]:
    """texts/s of each engine: ``items`` in chunks of ``batch``, one untimed pass each (jax compiles
    every chunk's shape there), then ``rounds`` timed passes with the engines taking turns; the
    median pass."""
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    for run in engines.values():
        for c in chunks:
            run(c)
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, run in engines.items():
            t0 = time.perf_counter()
            for c in chunks:
                run(c)
            times[label].append(time.perf_counter() - t0)
    return {label: len(items) / statistics.median(t) for label, t in times.items()}


def _form(form: str) -> Any:
    """``LoadOptions`` of a ``backend:FORM`` spec: a dtype (float32, bfloat16) or a quantization."""
    from ruvllm.backend import LoadOptions

    if form in ("float32", "bfloat16"):
        return LoadOptions(dtype=form)
    return LoadOptions(quantization=form or "auto")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument(
        "--backends", default="candle-compat,jax", help="backend or backend:FORM, a quantization or dtype (jax:w8a8)"
    )
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--texts", type=int, default=256, help="texts per timed run (batch 1 runs 32 of them)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp's embedding mode as a peer too")
    ap.add_argument(
        "--llama-cpp-types", default="f32", help="the GGUF types llama.cpp runs (f32, q8_0: the peer of jax:w8a8)"
    )
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "ruvllm-bench" / "embed")
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from ruvllm.embedding import load_embedding_model

    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads()}), flush=True)
    items = texts(args.texts)
    for path in args.models:
        name = path.rstrip("/").split("/")[-1]
        st = SentenceTransformer(path, device="cpu")
        engines = {"sentence-transformers": lambda b, st=st: st.encode(b, batch_size=len(b))}
        peers = []
        for outtype in args.llama_cpp_types.split(",") if args.llama_cpp else []:
            import numpy as np

            label = "llama.cpp" if outtype == "f32" else f"llama.cpp-{outtype}"
            run = llama_cpp_engine(gguf_of(path, args.gguf_dir, outtype), torch.get_num_threads())
            got, ref = np.array(run(items[:64])), st.encode(items[:64])
            cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
            print(json.dumps({"model": name, f"{label} cosine to sentence-transformers, min": float(cos.min())}))
            engines[label] = run
            peers.append(label)
        for spec in args.backends.split(","):  # backend or backend:quantization (jax:w8a8)
            backend, _, quantization = spec.partition(":")
            options = _form(quantization)
            m = load_embedding_model(path, backend=backend, options=options)
            engines[f"ruvllm-{spec}"] = lambda b, m=m: m.embed(b, truncate=True)
        for batch in (int(b) for b in args.batches.split(",")):
            subset = items[:32] if batch == 1 else items
            got = rates(engines, batch, subset, args.rounds)
            row = {"model": name, "batch": batch, **{k: round(v, 1) for k, v in got.items()}}
            st_rate = got["sentence-transformers"]
            ours = {k: v for k, v in got.items() if k.startswith("ruvllm")}
            row.update({f"{k} / sentence-transformers": round(v / st_rate, 2) for k, v in ours.items()})
            for peer in peers:
                row.update({f"{k} / {peer}": round(v / got[peer], 2) for k, v in ours.items()})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
