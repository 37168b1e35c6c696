"""Tiny random embedding and cross-encoder folders, written the way sentence-transformers' hub models
are (transformers' save_pretrained, a tokenizer.json, hand-written modules.json and module configs),
so sentence-transformers itself can load the same folder as the reference."""

from __future__ import annotations

import json
from pathlib import Path

_WORDS_TEXT = (
    "the a of to and in is it that for on with as was at by an be this are from or have not they we but "
    "what which their all there can one more when so if out about who query document search result text "
    "title none task fox dog cat quick brown lazy jumps over hello world paris france capital city river"
)
WORDS = _WORDS_TEXT.split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789.,:|!?"]
VOCAB += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]


def write_tokenizer(path: Path, max_length: int = 512) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip
    fast.save_pretrained(str(path))


def _modules(path: Path, kinds: list[tuple[str, str]]) -> None:
    entries = [
        {"idx": i, "name": str(i), "path": sub, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, sub) in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(entries))


def _pooling(path: Path, dim: int, mode: str) -> None:
    (path / "1_Pooling").mkdir()
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    cfg = {"word_embedding_dimension": dim, **{k: k == keys[mode] for k in keys.values()}, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def _dense(path: Path, sub: str, n_in: int, n_out: int, bias: bool, activation: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    (path / sub).mkdir()
    cfg = {"in_features": n_in, "out_features": n_out, "bias": bias, "activation_function": activation}
    (path / sub / "config.json").write_text(json.dumps(cfg))
    tensors = {"linear.weight": torch.randn(n_out, n_in, generator=g) * 0.2}
    if bias:
        tensors["linear.bias"] = torch.randn(n_out, generator=g) * 0.1
    save_file(tensors, str(path / sub / "model.safetensors"))


def write_bert_embedder(path: Path, *, pooling: str = "mean", max_seq_length: int = 32) -> Path:
    """all-MiniLM's shape: BERT, Pooling, Normalize."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, type_vocab_size=2,
    )  # fmt: skip
    BertModel(cfg).eval().save_pretrained(str(path))
    write_tokenizer(path)
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    _pooling(path, 32, pooling)
    _modules(path, [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")])
    return path


PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def write_gemma_embedder(path: Path) -> Path:
    """EmbeddingGemma's shape: Gemma-3 layers with bidirectional attention (windowed and global), mean
    pooling, two Dense layers, Normalize, and prompts."""
    import torch
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, intermediate_size=64, sliding_window=6, use_bidirectional_attention=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=64,
        query_pre_attn_scalar=8,
    )  # fmt: skip
    Gemma3TextModel(cfg).eval().save_pretrained(str(path))
    write_tokenizer(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    _pooling(path, 32, "mean")
    _dense(path, "2_Dense", 32, 48, False, "torch.nn.modules.linear.Identity", 2)
    _dense(path, "3_Dense", 48, 24, True, "torch.nn.modules.activation.Tanh", 3)
    _modules(
        path,
        [
            ("Transformer", ""),
            ("Pooling", "1_Pooling"),
            ("Dense", "2_Dense"),
            ("Dense", "3_Dense"),
            ("Normalize", "4_Normalize"),
        ],
    )
    st = {"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return path


def write_qwen3_embedder(path: Path) -> Path:
    """Qwen3-Embedding's form: a causal Qwen3 model, last-token pooling, Normalize."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(2)
    cfg = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    Qwen3Model(cfg).eval().save_pretrained(str(path))
    write_tokenizer(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    _pooling(path, 32, "lasttoken")
    _modules(path, [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")])
    return path


def write_cross_encoder(path: Path) -> Path:
    """An ms-marco-MiniLM-shaped cross-encoder: BertForSequenceClassification with one label."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(3)
    cfg = BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=1, initializer_range=0.2,
    )  # fmt: skip
    BertForSequenceClassification(cfg).eval().save_pretrained(str(path))
    write_tokenizer(path, max_length=64)
    return path


SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "paris is the capital of france",
    "a",
    "what is the capital city of france? it is paris, on a river.",
    "they can search the document for the title text",
    "cat",
    "the dog was not out about the city when we left it there",
]
