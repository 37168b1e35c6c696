"""Parity of ruvllm's embedding models with sentence-transformers on the real models (never run by the
test suite): all-MiniLM-L6-v2 and EmbeddingGemma-300M, float32, both backends; a backend given as
``jax:w8a8`` or ``jax:bfloat16`` runs that form (bar 0.999 instead of 0.99999).

For ~200 sentences of mixed length (1 to ~512 tokens; what a model's max_seq_length cuts is cut on
both sides, truncate=True in ruvllm) it reports the cosine of each ruvllm vector to
sentence-transformers' ``encode`` (same prompts, same normalisation), the minimum over sentences, and
whether the rankings of 20 queries over 100 documents are identical.

    JAX_PLATFORMS=cpu python benchmarks/embedding_parity.py MODELS/all-MiniLM-L6-v2 MODELS/embeddinggemma-300m
    JAX_PLATFORMS=cpu python benchmarks/embedding_parity.py MODELS/all-MiniLM-L6-v2 --backends jax:w8a8
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

_WORDS = (
    "the model reads every sentence and returns one vector a search engine can compare with others quickly "
    "paris london berlin river mountain ocean science history music language computer network protein cell "
    "energy climate market price policy health school child teacher book film game garden kitchen travel"
)
WORDS = _WORDS.split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: 1 word up to ~450 words (over 512 tokens for the longest)."""
    rng = random.Random(seed)
    lengths = [1, 2, 3] + [round(1.5 ** rng.uniform(0, 15)) for _ in range(n - 3)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


def _form(form: str) -> Any:
    """``LoadOptions`` of a ``backend:FORM`` spec: a dtype (float32, bfloat16) or a quantization."""
    from ruvllm.backend import LoadOptions

    if form in ("float32", "bfloat16"):
        return LoadOptions(dtype=form)
    return LoadOptions(quantization=form or "auto")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--backends", default="candle-compat,jax")
    ap.add_argument("--count", type=int, default=200)
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    from ruvllm.embedding import load_embedding_model, read_pipeline

    texts = sentences(args.count)
    queries, docs = texts[:20], texts[20:120]
    for path in args.models:
        st = SentenceTransformer(path, device="cpu")
        prompts = read_pipeline(Path(path)).prompts  # the folder's own (sentence-transformers adds empty ones)
        query_prompt = "query" if "query" in prompts else None
        doc_prompt = "document" if "document" in prompts else None
        ref = st.encode(texts, batch_size=32, prompt_name=doc_prompt)
        ref_q = st.encode(queries, batch_size=32, prompt_name=query_prompt)
        ref_d = st.encode(docs, batch_size=32, prompt_name=doc_prompt)
        ref_rank = np.argsort(-(ref_q @ ref_d.T), axis=1, kind="stable")
        # sentence-transformers against itself: the same texts one at a time (no padding) instead of
        # in batches of 32: where its own order moves, the scores are tied within float32's noise.
        self_q = st.encode(queries, batch_size=1, prompt_name=query_prompt)
        self_d = st.encode(docs, batch_size=1, prompt_name=doc_prompt)
        self_rank = np.argsort(-(self_q @ self_d.T), axis=1, kind="stable")
        self_moved = int((self_rank != ref_rank).sum())
        for spec in args.backends.split(","):
            backend, _, quantization = spec.partition(":")
            form = quantization or "float32"
            bar = 0.99999 if form == "float32" else 0.999
            options = _form(quantization)
            model = load_embedding_model(path, backend=backend, options=options)
            t0 = time.perf_counter()
            got = model.embed(texts, prompt_name=doc_prompt, truncate=True)
            seconds = time.perf_counter() - t0
            cos = np.sum(got * ref, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
            q = model.embed(queries, prompt_name=query_prompt, truncate=True)
            d = model.embed(docs, prompt_name=doc_prompt, truncate=True)
            rank = np.argsort(-(q @ d.T), axis=1, kind="stable")
            # Where the orders differ, how far apart sentence-transformers itself scores the two
            # documents that swapped places (a near-tie within float32's noise, or a real change).
            ref_scores = ref_q @ ref_d.T
            rows, cols = np.nonzero(rank != ref_rank)
            gaps = np.abs(ref_scores[rows, rank[rows, cols]] - ref_scores[rows, ref_rank[rows, cols]])
            tokens = [
                len(t) for t in model.tokenize(texts, prompt=model.prompt_text(doc_prompt), truncate=True).token_ids
            ]
            print(json.dumps({
                "model": path.rstrip("/").split("/")[-1], "backend": backend, "form": form,
                "sentences": len(texts), "tokens_min": min(tokens), "tokens_max": max(tokens),
                "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
                f"all_at_least_{bar}": bool(cos.min() >= bar),
                "rankings_identical": bool((rank == ref_rank).all()),
                "top1_identical": bool((rank[:, 0] == ref_rank[:, 0]).all()),
                "rank_positions_differing": len(rows),
                "largest_reference_gap_of_a_swap": float(gaps.max()) if len(rows) else 0.0,
                "smallest_reference_gap_of_a_swap": float(gaps.min()) if len(rows) else 0.0,
                "reference_batch1_vs_batch32_positions_differing": self_moved,
                "seconds_for_all": round(seconds, 2),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
