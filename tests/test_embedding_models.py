"""Embedding and cross-encoder models on both backends against sentence-transformers on the same tiny
random folders: BERT (mean and CLS pooling), Gemma-3 with bidirectional attention (two Dense layers,
prompts), a Qwen3 decoder pooled at its last token, and a BERT cross-encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _embedding_fixtures import (
    SENTENCES,
    write_bert_embedder,
    write_cross_encoder,
    write_gemma_embedder,
    write_qwen3_embedder,
)

pytest.importorskip("sentence_transformers")

BACKENDS = ["candle-compat", "jax"]
#: float32 on both sides; BERT and Gemma sum a few hundred products per value.
ATOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedders")
    return {
        "bert": write_bert_embedder(root / "bert"),
        "bert-cls": write_bert_embedder(root / "bert-cls", pooling="cls"),
        "gemma": write_gemma_embedder(root / "gemma"),
        "qwen3": write_qwen3_embedder(root / "qwen3"),
        "cross": write_cross_encoder(root / "cross"),
    }


def _st(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["bert", "bert-cls", "gemma", "qwen3"])
def test_embeddings_equal_sentence_transformers(folders, name, backend) -> None:
    from ruvllm.embedding import load_embedding_model

    model = load_embedding_model(str(folders[name]), backend=backend)
    ref = _st(folders[name]).encode(SENTENCES, batch_size=3)
    got = model.embed(SENTENCES)
    assert got.shape == ref.shape == (len(SENTENCES), model.dimensions)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompts_and_matryoshka(folders, backend) -> None:
    """A named prompt is the text sentence-transformers puts first; Matryoshka keeps the first
    dimensions and renormalises (sentence-transformers' truncate_dim, then unit length)."""
    from ruvllm.embedding import load_embedding_model
    from ruvllm.errors import RequestError

    st = _st(folders["gemma"])
    model = load_embedding_model(str(folders["gemma"]), backend=backend, matryoshka_dimensions=[16, 8])
    for prompt in ("query", "document"):
        np.testing.assert_allclose(
            model.embed(SENTENCES, prompt_name=prompt), st.encode(SENTENCES, prompt_name=prompt), atol=ATOL
        )
    assert not np.allclose(model.embed(SENTENCES[:2], prompt_name="query"), model.embed(SENTENCES[:2]), atol=1e-3)
    ref = st.encode(SENTENCES, truncate_dim=8, normalize_embeddings=True)
    np.testing.assert_allclose(model.embed(SENTENCES, dimensions=8), ref, atol=ATOL)
    with pytest.raises(RequestError, match="accepted: 24, 16, 8") as info:
        model.embed(SENTENCES, dimensions=12)
    assert info.value.param == "dimensions"
    with pytest.raises(RequestError, match=r"unknown prompt_name 'passage'.*query, document"):
        model.embed(SENTENCES, prompt_name="passage")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_encoder_scores_equal_crossencoder_predict(folders, backend) -> None:
    from sentence_transformers import CrossEncoder

    from ruvllm.embedding import load_embedding_model

    pairs = [(SENTENCES[i], SENTENCES[j]) for i, j in ((0, 1), (2, 4), (3, 3), (5, 6), (7, 0))]
    ref = CrossEncoder(str(folders["cross"]), device="cpu").predict(pairs)
    model = load_embedding_model(str(folders["cross"]), backend=backend)
    assert model.kind == "cross-encoder"
    got = model.score_pairs(pairs)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    assert np.ptp(ref) > 1e-4  # the pairs score differently, so the comparison has something to see


def test_over_length_input_is_refused_or_truncated_as_asked(folders) -> None:
    from ruvllm.embedding import load_embedding_model
    from ruvllm.errors import RequestError

    model = load_embedding_model(str(folders["bert"]), backend="candle-compat")
    long = " ".join(["the quick brown fox"] * 20)  # 80 words: over the folder's max_seq_length of 32
    with pytest.raises(RequestError, match="more than this model's 32"):
        model.embed([long])
    ref = _st(folders["bert"]).encode([long])  # sentence-transformers truncates to max_seq_length
    np.testing.assert_allclose(model.embed([long], truncate=True), ref, atol=ATOL)
    with pytest.raises(RequestError, match="token id 999"):
        model.check_ids([[2, 999, 3]])
    with pytest.raises(RequestError, match="empty string"):
        model.embed(["ok", ""])


def test_what_is_not_implemented_is_refused_by_name(folders, tmp_path) -> None:
    import shutil

    from ruvllm.embedding import load_embedding_model
    from ruvllm.errors import BackendError, ModelFormatError
    from ruvllm.runtime import load_model

    with pytest.raises(BackendError, match="'mlx' does not run encoder models"):
        load_embedding_model(str(folders["bert"]), backend="mlx")
    with pytest.raises(BackendError, match=r"encoder model .*cannot generate text"):
        load_model(str(folders["gemma"]), backend="candle-compat")
    edited = shutil.copytree(folders["bert"], tmp_path / "edited")
    pooling = json.loads((edited / "1_Pooling" / "config.json").read_text())
    (edited / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    with pytest.raises(ModelFormatError, match="include_prompt=False"):
        load_embedding_model(str(edited), backend="candle-compat")
    modules = json.loads((edited / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (edited / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelFormatError, match=r"'sentence_transformers\.models\.LayerNorm' is not implemented"):
        load_embedding_model(str(edited), backend="candle-compat")
    cfg = json.loads((folders["bert"] / "config.json").read_text())
    shutil.rmtree(edited)
    edited = shutil.copytree(folders["bert"], tmp_path / "edited2")
    (edited / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelFormatError, match="position_embedding_type='relative_key'"):
        load_embedding_model(str(edited), backend="candle-compat")


def test_cli_embed_writes_json_lines(folders, capsys) -> None:
    from sentence_transformers import SentenceTransformer

    from ruvllm.cli import main

    assert (
        main(["embed", str(folders["gemma"]), *SENTENCES[:3], "--prompt-name", "query", "--backend", "candle-compat"])
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ref = SentenceTransformer(str(folders["gemma"]), device="cpu").encode(SENTENCES[:3], prompt_name="query")
    assert [line["index"] for line in lines] == [0, 1, 2]
    np.testing.assert_allclose([line["embedding"] for line in lines], ref, atol=ATOL)
    assert main(["embed", str(folders["cross"]), SENTENCES[0], SENTENCES[1], "--backend", "candle-compat"]) == 0
    (scored,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert scored["text"] == SENTENCES[1] and 0.0 < scored["score"] < 1.0
    assert main(["generate", str(folders["bert"]), "hi", "--backend", "candle-compat"]) == 1
    assert "cannot generate text" in capsys.readouterr().err
    assert main(["embed", str(folders["bert"]), "hi", "--backend", "candle-compat", "--quantization", "w8a8"]) == 1
    assert "quantization 'w8a8'" in capsys.readouterr().err


def test_the_jax_encoder_pads_to_few_lengths_with_little_waste() -> None:
    """Lengths a pass is padded to: multiples of 8 up to 64, of 16 up to 128, of 64 up to 512, of 256
    beyond; each at least the sequence, with fewer than 8 padding positions up to 64, 16 up to 128 and
    64 up to 512 (a power of two padded up to half), and 18 of them up to 512."""
    pytest.importorskip("ruvllm_jax")
    from ruvllm_jax.encoder import padded_length

    got = {n: padded_length(n) for n in (1, 8, 9, 16, 17, 33, 100, 128, 129, 200, 512, 513, 1000)}
    assert got == {1: 8, 8: 8, 9: 16, 16: 16, 17: 24, 33: 40, 100: 112, 128: 128, 129: 192, 200: 256,
                   512: 512, 513: 768, 1000: 1024}  # fmt: skip
    lengths = [padded_length(n) for n in range(1, 513)]
    assert all(p >= n for n, p in enumerate(lengths, 1))
    assert all(p - n < (8 if n <= 64 else 16 if n <= 128 else 64) for n, p in enumerate(lengths, 1))
    assert len(set(lengths)) == 18
    from ruvllm_jax.encoder import padded_rows

    assert [padded_rows(n) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 8, 8, 12, 20, 32, 36]


def test_packed_passes_place_each_sequence_whole_once() -> None:
    """Sequences packed into rows: each whole in one row of one pass, with its own segment number and
    positions from 0; no two overlap; a pass's shape is the bucket's length and row count; a pass
    holds at most the positions asked (a sequence alone excepted); short ones share rows."""
    from ruvllm.encoder import EncodeBatch, packed_passes

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 90, 300)] + [300, 1]
    batch = EncodeBatch([rng.integers(1, 1000, n).astype(np.int32) for n in lengths])
    passes = packed_passes(batch, 2048, bucket=lambda n: -(-n // 16) * 16, pack_length=128,
                           row_count=lambda r: -(-r // 8) * 8)  # fmt: skip
    seen = []
    shared = 0
    for p in passes:
        rows, length = p.ids.shape
        assert length % 16 == 0 and rows % 8 == 0 and length >= 128
        assert rows * length <= 2048 + 8 * length
        used = np.zeros(p.ids.shape, bool)
        for i, row, start in p.places:
            n = lengths[i]
            span = slice(start, start + n)
            assert not used[row, span].any()
            used[row, span] = True
            np.testing.assert_array_equal(p.ids[row, span], batch.token_ids[i])
            np.testing.assert_array_equal(p.positions[row, span], np.arange(n))
            assert len(set(p.segments[row, span].tolist())) == 1 and p.segments[row, start] > 0
            seen.append(i)
        assert (p.segments > 0).sum() == used.sum()
        shared += sum(np.unique(p.segments[r][p.segments[r] > 0]).size > 1 for r in range(rows))
    assert sorted(seen) == list(range(len(lengths)))
    assert shared > 50


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["bert", "gemma", "qwen3"])
def test_sequences_sharing_a_row_get_what_they_get_alone(folders, name, backend) -> None:
    """Several sequences packed into one row (bidirectional, windowed and causal attention) give
    each the vectors it gets encoded alone, and sentence-transformers' (float32 on both sides)."""
    from ruvllm.embedding import load_embedding_model

    model = load_embedding_model(str(folders[name]), backend=backend)
    texts = SENTENCES * 3
    got = model.embed(texts)
    alone = np.stack([model.embed([t])[0] for t in SENTENCES])
    np.testing.assert_allclose(got, np.concatenate([alone] * 3), atol=ATOL)
    np.testing.assert_allclose(got, _st(folders[name]).encode(texts, batch_size=1), atol=ATOL)


@pytest.mark.parametrize("name", ["bert", "gemma", "qwen3", "cross"])
def test_jax_w8a8_encoder_is_the_q8_0_arithmetic_close_to_float(folders, name, monkeypatch) -> None:
    """``quantization="w8a8"`` on the jax encoder: the native kernels' products (Q8_0 weights, int8
    activations per 32) give what XLA's formulation of the same arithmetic gives, and the
    vectors stay within cosine 0.999 of sentence-transformers' float32 ones (scores within 0.02)."""
    pytest.importorskip("ruvllm_jax")
    from ruvllm.backend import LoadOptions
    from ruvllm.embedding import load_embedding_model
    from ruvllm_jax import encoder as jax_encoder
    from ruvllm_jax import native
    from ruvllm_jax.quant import linear

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    options = LoadOptions(quantization="w8a8")
    model = load_embedding_model(str(folders[name]), backend="jax", options=options)
    assert model.encoder.model.options.quantization == "w8a8"
    pairs = list(zip(SENTENCES[:4], SENTENCES[4:], strict=True))
    got = model.score_pairs(pairs) if name == "cross" else model.embed(SENTENCES)
    monkeypatch.setattr(jax_encoder, "_products", lambda x, ws: [linear(x, w) for w in ws])
    xla_model = load_embedding_model(str(folders[name]), backend="jax", options=options)
    xla = xla_model.score_pairs(pairs) if name == "cross" else xla_model.embed(SENTENCES)
    # One activation code rounded the other way (a float32 rounding apart before quantization) moves
    # a tiny random model's vector by up to ~2e-3; the arithmetic itself is the same.
    np.testing.assert_allclose(got, xla, atol=5e-3)
    assert np.mean(np.abs(got - xla) < 1e-5) > 0.8
    if name == "cross":
        from sentence_transformers import CrossEncoder

        ref = CrossEncoder(str(folders[name]), device="cpu").predict(pairs)
        np.testing.assert_allclose(got, ref, atol=0.02)
        return
    ref = _st(folders[name]).encode(SENTENCES)
    cos = np.sum(got * ref, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, cos


def test_encoder_quantizations_not_offered_are_refused_by_name(folders) -> None:
    from ruvllm.backend import LoadOptions
    from ruvllm.embedding import load_embedding_model
    from ruvllm.errors import BackendError

    for backend, q in (("jax", "q4"), ("candle-compat", "w8a8")):
        with pytest.raises(BackendError, match=q):
            load_embedding_model(str(folders["bert"]), backend=backend, options=LoadOptions(quantization=q))


def test_the_heads_products_keep_numpy_blas_on_one_thread() -> None:
    """The Dense and classifier heads multiply with NumPy's BLAS limited to one thread (its spinning
    workers would take the cores from the encoder's next pass), and restore the limit after."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from ruvllm.embedding import heads
    from ruvllm.embedding.pipeline import Dense

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    seen = []
    layer = Dense(np.eye(4, dtype=np.float32), None, "Identity")
    real = heads._act

    def act(x, name):
        seen.extend(blas_threads())
        return real(x, name)

    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        heads._act = act
        try:
            out = heads.dense(np.ones((3, 4), np.float32), [layer])
        finally:
            heads._act = real
        assert blas_threads() == before and 2 in before
    assert seen and set(seen) == {1}
    np.testing.assert_array_equal(out, np.ones((3, 4), np.float32))


@pytest.mark.parametrize("name", ["bert", "gemma", "qwen3"])
def test_jax_bfloat16_encoder_against_float64_of_the_same_rounding(folders, name) -> None:
    """``dtype="bfloat16"`` on the jax encoder: the final states equal a float64 NumPy pass of the same
    model definition whose products round their input and weights to bfloat16 (float32 sums against
    float64), and the vectors stay within cosine 0.999 of sentence-transformers' float32 ones."""
    pytest.importorskip("ruvllm_jax")
    import ml_dtypes

    from ruvllm.backend import LoadOptions
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.embedding import load_embedding_model, read_pipeline
    from ruvllm.encoder import EncodeBatch, packed_passes
    from ruvllm.modeling.encoder import encode_hidden, load_encoder_weights

    model = load_embedding_model(str(folders[name]), backend="jax", options=LoadOptions(dtype="bfloat16"))
    assert model.encoder.model.options.dtype == "bfloat16"
    enc = model.tokenize(SENTENCES)
    batch = EncodeBatch([np.asarray(t, np.int32) for t in enc.token_ids])
    got = model.encoder.encode(batch)

    checkpoint = open_checkpoint(read_pipeline(folders[name]).transformer_path)
    cfg = checkpoint.config
    weights = load_encoder_weights(cfg, lambda n, shape: np.asarray(checkpoint.tensor(n), np.float64))

    def bf16(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    def products(x, ws):
        return [bf16(x) @ bf16(w).T for w in ws]

    for i, ids in enumerate(batch.token_ids):
        (p,) = packed_passes(EncodeBatch([ids]), 4096)
        want = encode_hidden(weights, cfg, p.ids, p.types, p.segments, p.positions, products)[0]
        # An input a float32 rounding from a bfloat16 boundary rounds the other way (a step of 2^-8 of
        # itself): a few values move by up to ~1e-3 of the largest; nearly all agree to 5e-4.
        top = np.abs(want).max()
        np.testing.assert_allclose(got[i], want, atol=2e-3 * top)
        assert np.mean(np.abs(got[i] - want) <= 5e-4 * top) >= 0.95
    vectors = model.embed(SENTENCES)
    ref = _st(folders[name]).encode(SENTENCES)
    cos = np.sum(vectors * ref, axis=1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, cos
    from ruvllm.errors import BackendError

    with pytest.raises(BackendError, match="dtype bfloat16 does not apply"):
        options = LoadOptions(dtype="bfloat16", quantization="w8a8")
        load_embedding_model(str(folders[name]), backend="jax", options=options)
