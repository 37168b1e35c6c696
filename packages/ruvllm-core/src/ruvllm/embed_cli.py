"""``ruvllm embed MODEL TEXT...``: sentence embeddings (or, with ``--pair``, a cross-encoder's scores)
as JSON lines on stdout, one per input, computed by the model folder's own pipeline."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_embed_parser(sub: Any) -> None:
    p = sub.add_parser(
        "embed",
        help="embed texts with an embedding model (sentence-transformers folder) as JSON lines; "
        "with --pair, score text pairs with a cross-encoder",
    )
    p.add_argument("model", help="a model folder (or a Hub embedding model in the cache)")
    p.add_argument("texts", nargs="*", help="texts to embed (none: one text per line on stdin)")
    p.add_argument("--backend", default=None, help="candle-compat or jax (default: the best available)")
    p.add_argument("--prompt-name", default=None, help="one of the model's prompts (EmbeddingGemma: query, document)")
    p.add_argument("--dimensions", type=int, default=None, help="Matryoshka: the first N dimensions, renormalised")
    p.add_argument(
        "--matryoshka-dimensions",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="the sizes --dimensions may take when the model's config does not list them, e.g. 512,256,128",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "w8a8"],
        help="none/auto: float32 weights; w8a8 (jax, native CPU kernels): int8 blocks of 32 for weights and "
        "activations, llama.cpp's Q8_0 scheme (faster, cosine to float32 about 0.999-0.9999)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto/float32; bfloat16 (jax): the layers' matrices and their products' inputs in bfloat16, "
        "sums in float32 (cosine to float32 about 0.9999)",
    )
    p.add_argument("--truncate", action="store_true", help="cut inputs longer than the model takes (default: refuse)")
    p.add_argument("--pair", action="store_true", help="cross-encoder: score TEXT[0] against each other text")
    p.set_defaults(func=cmd_embed)


def cmd_embed(args: argparse.Namespace, host: Any) -> int:
    from ruvllm.backend import LoadOptions
    from ruvllm.embedding import load_embedding_model
    from ruvllm.errors import RequestError

    texts = list(args.texts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise RequestError("no texts given (as arguments or one a line on stdin)")
    model = load_embedding_model(
        args.model, backend=args.backend, host=host, matryoshka_dimensions=args.matryoshka_dimensions,
        options=LoadOptions(quantization=args.quantization, dtype=args.dtype),
    )  # fmt: skip
    if args.pair or model.kind == "cross-encoder":
        if len(texts) < 2:
            raise RequestError("--pair scores TEXT[0] against the texts after it: give at least two")
        scores = model.score_pairs([(texts[0], t) for t in texts[1:]], truncate=args.truncate)
        for i, (t, s) in enumerate(zip(texts[1:], scores, strict=True)):
            print(json.dumps({"index": i, "text": t, "score": float(s)}))
        return 0
    vectors = model.embed(texts, prompt_name=args.prompt_name, dimensions=args.dimensions, truncate=args.truncate)
    for i, v in enumerate(vectors):
        print(json.dumps({"index": i, "embedding": [float(x) for x in v]}))
    return 0
