"""The mlx backend (MLX's CPU build here; the same graph runs on Metal) computes what Hugging Face
transformers computes for every family of the architecture table, in float32: every position's
logits within 1e-4 over steps that mix a whole prompt, chunked prefill, a prefix shared through the
block table and decode rows, past every window (the same tiny checkpoints and steps as
tests/test_model_families.py); the GGUF form of the same weights; and Gemma-3's two KV pools through
the engine (tests/test_hybrid_kv.py's run)."""

from __future__ import annotations

import numpy as np
import pytest
from _family_checkpoints import ARCHITECTURE, FAMILIES, hf_all_logits, write_family_checkpoint

from ruvllm.backend import ForwardBatch, LoadOptions, SequenceChunk
from ruvllm.checkpoint import open_checkpoint
from ruvllm.errors import BackendError
from ruvllm.plugins import load_plugins

pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

ATOL = 1e-4
BLOCK = 4


def _load(path, **options):
    ckpt = open_checkpoint(path)
    model = load_plugins().choose_backend("mlx").load(ckpt, LoadOptions(**options))
    return ckpt, model, model.kv_cache(48, BLOCK, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_chunked_prefix_shared_and_decode_steps_match_transformers(family, tmp_path) -> None:
    path = write_family_checkpoint(tmp_path, family)
    if getattr(open_checkpoint(path).config, "num_experts", 0):  # refused by name, never approximated
        with pytest.raises(BackendError, match="num_experts"):
            _load(path)
        return
    ckpt, model, cache = _load(path)
    assert ckpt.config.architecture == ARCHITECTURE[family]
    rng = np.random.default_rng(3)
    vocab = ckpt.config.vocab_size
    a = rng.integers(3, vocab, size=30).tolist()
    b = a[:12] + rng.integers(3, vocab, size=9).tolist()  # shares a's first 12 tokens (3 blocks)
    c = rng.integers(3, vocab, size=23).tolist()
    perm = rng.permutation(48).astype(np.int32)
    table_a, table_c = perm[0:9], perm[9:16]
    table_b = np.concatenate([table_a[:3], perm[16:22]])
    ref = {"a": hf_all_logits(path, a), "b": hf_all_logits(path, b), "c": hf_all_logits(path, c)}
    seqs = {"a": (a, table_a), "b": (b, table_b), "c": (c, table_c)}

    def run(step: list[tuple[str, int, int]]) -> None:
        chunks = [
            SequenceChunk(np.asarray(seqs[k][0][lo:hi], np.int32), lo, seqs[k][1], all_logits=True)
            for k, lo, hi in step
        ]
        out = model.forward(ForwardBatch(chunks, BLOCK), cache)
        for row, (k, lo, hi) in enumerate(step):
            np.testing.assert_allclose(out.all_logits[row], ref[k][lo:hi], atol=ATOL, rtol=0,
                                       err_msg=f"{family} on mlx: sequence {k} positions {lo}..{hi - 1}")  # fmt: skip
            np.testing.assert_array_equal(out.logits[row], out.all_logits[row][-1])

    run([("a", 0, 12), ("c", 0, 5)])
    run([("a", 12, 21), ("b", 12, 13), ("c", 5, 19)])  # b reads a's 3 blocks through its table
    for pos in range(21, 30):
        step = [("a", pos, pos + 1)]
        if 13 <= pos - 8 < len(b):
            step.append(("b", pos - 8, pos - 7))
        if 19 <= pos - 2 < len(c):
            step.append(("c", pos - 2, pos - 1))
        run(step)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2-yarn", "qwen3", "phi3"])
def test_gguf_files_of_each_family_match_transformers(family, tmp_path) -> None:
    from _family_checkpoints import write_family_gguf

    hf_dir = write_family_checkpoint(tmp_path / "hf", family)
    _ckpt, model, cache = _load(write_family_gguf(hf_dir, family, tmp_path / "model.gguf"))
    ids = np.random.default_rng(7).integers(3, 101, size=26).tolist()
    table = np.random.default_rng(8).permutation(48)[:7].astype(np.int32)
    out = model.forward(
        ForwardBatch([SequenceChunk(np.asarray(ids, np.int32), 0, table, all_logits=True)], BLOCK), cache
    )
    np.testing.assert_allclose(out.all_logits[0], hf_all_logits(hf_dir, ids), atol=ATOL, rtol=0)


def test_gemma3_two_pools_through_the_engine_match_transformers(tmp_path, smollm2_checkpoint) -> None:
    from test_hybrid_kv import _check_pools, _run_engine

    from ruvllm.runtime import load_model

    path = write_family_checkpoint(tmp_path, "gemma3")
    llm = load_model(str(path), backend="mlx", host=load_plugins("mlx"))
    engine, prompts, got, local_peak = _run_engine(llm, smollm2_checkpoint)
    _check_pools(engine, llm)
    assert local_peak <= 2 * engine.block_manager.local.peak_blocks(23 + 30, 8)
    for p, (ours, _) in zip(prompts, got, strict=True):
        assert ours == hf_all_logits(path, p + ours)[len(p) - 1 : -1].argmax(-1).tolist()
