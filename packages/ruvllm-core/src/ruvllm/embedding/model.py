"""An embedding or cross-encoder model as one object: the folder's pipeline
(:mod:`~ruvllm.embedding.pipeline`), its tokenizer and a backend's encoder (:mod:`ruvllm.encoder`).

Inputs longer than the model takes are refused naming the limit unless the caller asks to truncate
them (sentence-transformers truncates silently; ``truncate=True`` does what it does: the tokenizer cuts
the text, keeping the special tokens, and a token list keeps its first ``max_tokens``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ruvllm.embedding import heads
from ruvllm.embedding.pipeline import Pipeline, is_cross_encoder, read_classifier, read_pipeline
from ruvllm.encoder import EncodeBatch, LoadedEncoder, load_encoder
from ruvllm.errors import ModelFormatError, RequestError

if TYPE_CHECKING:
    from ruvllm.backend import LoadOptions
    from ruvllm.plugins import PluginHost


@dataclass(frozen=True)
class Encoded:
    """Inputs as the encoder takes them, and how many tokens they were."""

    token_ids: list[list[int]]
    token_types: list[list[int]] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def is_encoder_folder(path: Path) -> bool:
    """Whether ``path`` is a model folder served as embeddings or scores rather than generation: a
    sentence-transformers folder (``modules.json``), a sequence classifier, or an encoder-only config."""
    if not path.is_dir():
        return False
    if (path / "modules.json").is_file():
        return True
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    c = json.loads(cfg.read_text(encoding="utf-8"))
    return is_cross_encoder(c) or c.get("model_type") == "bert" or bool(c.get("use_bidirectional_attention"))


class EmbeddingModel:
    """``kind`` ``embedding`` (:meth:`embed`) or ``cross-encoder`` (:meth:`score_pairs`)."""

    def __init__(
        self,
        name: str,
        root: Path,
        encoder: LoadedEncoder,
        pipeline: Pipeline,
        *,
        matryoshka_dimensions: Sequence[int] | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        self.name = name
        self.root = root
        self.encoder = encoder
        self.pipeline = pipeline
        self.config = encoder.checkpoint.config
        tok_file = pipeline.transformer_path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFormatError(f"{pipeline.transformer_path}: no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.max_tokens = self._max_tokens()
        self._truncating = Tokenizer.from_file(str(tok_file))
        self._truncating.no_padding()
        self._truncating.enable_truncation(self.max_tokens)
        self._tok_lock = threading.Lock()  # a tokenizers.Tokenizer is not to be shared across threads mid-call
        self.kind = "cross-encoder" if pipeline.classifier is not None else "embedding"
        self.dimensions = self._dimensions()
        dims = tuple(int(d) for d in (matryoshka_dimensions or ())) or self._declared_matryoshka()
        bad = [d for d in dims if not 0 < d <= self.dimensions]
        if bad:
            raise ModelFormatError(f"matryoshka dimensions {bad} are outside 1..{self.dimensions}")
        self.matryoshka_dimensions: tuple[int, ...] = tuple(sorted(set(dims) | {self.dimensions}, reverse=True))

    # -- what the model is ------------------------------------------------------------------------

    def _max_tokens(self) -> int:
        limit = self.config.max_position_embeddings
        if self.pipeline.max_seq_length:
            limit = min(limit, self.pipeline.max_seq_length)
        tc = self.pipeline.transformer_path / "tokenizer_config.json"
        if tc.is_file():
            mml = json.loads(tc.read_text(encoding="utf-8")).get("model_max_length")
            if isinstance(mml, int) and 0 < mml < limit and not self.pipeline.max_seq_length:
                limit = mml
        return int(limit)

    def _dimensions(self) -> int:
        if self.pipeline.classifier is not None:
            return self.pipeline.classifier.num_labels
        width = self.config.hidden_size * len(self.pipeline.pooling.modes if self.pipeline.pooling else ("mean",))
        return int(self.pipeline.dense[-1].weight.shape[0]) if self.pipeline.dense else width

    def _declared_matryoshka(self) -> tuple[int, ...]:
        c = json.loads((self.pipeline.transformer_path / "config.json").read_text(encoding="utf-8"))
        return tuple(int(d) for d in c.get("matryoshka_dimensions") or ())

    # -- inputs ------------------------------------------------------------------------------------

    def prompt_text(self, prompt_name: str | None, prompt: str | None = None) -> str:
        """The text put before each input: ``prompt`` as given, else the named prompt, else the
        model's default prompt, else none."""
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.pipeline.default_prompt_name
        if name is None:
            return ""
        if name not in self.pipeline.prompts:
            known = ", ".join(self.pipeline.prompts) or "none"
            raise RequestError(f"unknown prompt_name {name!r} (this model's prompts: {known})", param="prompt_name")
        return self.pipeline.prompts[name]

    def role_prompt(self, role: str) -> str | None:
        """The prompt sentence-transformers' ``encode_query`` / ``encode_document`` use: the model's
        prompt named ``query`` or ``document`` where it has one, else its default."""
        return role if role in self.pipeline.prompts else None

    def _text(self, text: str, i: int, param: str) -> str:
        if not isinstance(text, str):
            raise RequestError(f"input {i} is a {type(text).__name__}, not a string", param=param)
        if not text:
            raise RequestError(f"input {i} is an empty string", param=param)
        return text.lower() if self.pipeline.do_lower_case else text

    def _over(self, i: int, n: int, param: str) -> RequestError:
        return RequestError(
            f"input {i} is {n} tokens, more than this model's {self.max_tokens} (set truncate_prompt_tokens to cut it)",
            param=param,
        )

    def _limit(self, truncate: bool | int | None) -> int | None:
        """Tokens an input is cut to: None (longer ones are refused), the model's limit (``True`` or
        -1), or ``truncate`` tokens when fewer."""
        if truncate is None or truncate is False:
            return None
        if truncate is True or truncate < 0 or truncate > self.max_tokens:
            return self.max_tokens
        if truncate == 0:
            raise RequestError(
                "truncate_prompt_tokens must be -1 (the model's limit) or at least 1", param="truncate_prompt_tokens"
            )
        return int(truncate)

    def _encode(self, items: list[Any], truncate: bool | int | None, param: str) -> list[Any]:
        limit = self._limit(truncate)
        with self._tok_lock:
            enc = self._tokenizer.encode_batch(items)
            bound = self.max_tokens if limit is None else limit
            over = [i for i, e in enumerate(enc) if len(e.ids) > bound]
            if over and limit is None:
                raise self._over(over[0], len(enc[over[0]].ids), param)
            if over:
                self._truncating.enable_truncation(bound)
                for i, e in zip(over, self._truncating.encode_batch([items[i] for i in over]), strict=True):
                    enc[i] = e
        return enc

    def pieces(self, text: str, tokens: int, n: int) -> list[str]:
        """``n`` texts of ``tokens`` tokens each (without the special tokens), cut from ``text``
        (repeated as needed) at successive token offsets (``ruvllm benchmark``'s inputs)."""
        with self._tok_lock:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            if not ids:
                raise RequestError("the text has no tokens")
            while len(ids) < tokens + n:
                ids = ids + ids
            return [self._tokenizer.decode(ids[i : i + tokens]) for i in range(n)]

    def tokenize(
        self, texts: Sequence[str], *, prompt: str = "", truncate: bool | int | None = False, param: str = "input"
    ) -> Encoded:
        """Texts (``prompt`` before each) as token ids with the model's special tokens."""
        full = [prompt + self._text(t, i, param) for i, t in enumerate(texts)]
        return Encoded([e.ids for e in self._encode(full, truncate, param)])

    def tokenize_pairs(
        self, pairs: Sequence[tuple[str, str]], *, truncate: bool | int | None = False, param: str = "input"
    ) -> Encoded:
        """Sentence pairs as one sequence each, with token types (a cross-encoder's input)."""
        texts = [(self._text(a, i, param), self._text(b, i, param)) for i, (a, b) in enumerate(pairs)]
        enc = self._encode(texts, truncate, param)
        return Encoded([e.ids for e in enc], [e.type_ids for e in enc])

    def check_ids(
        self, token_ids: Sequence[Sequence[int]], *, truncate: bool | int | None = False, param: str = "input"
    ) -> Encoded:
        """Token arrays given by the caller, checked (taken as they are: no special tokens added)."""
        limit = self._limit(truncate)
        out = []
        for i, ids in enumerate(token_ids):
            if not ids:
                raise RequestError(f"input {i} is an empty token list", param=param)
            bad = next(
                (
                    t
                    for t in ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.config.vocab_size
                ),
                None,
            )
            if bad is not None:
                raise RequestError(
                    f"input {i} has token id {bad!r}, outside 0..{self.config.vocab_size - 1}", param=param
                )
            if len(ids) > (self.max_tokens if limit is None else limit):
                if limit is None:
                    raise self._over(i, len(ids), param)
                ids = ids[:limit]
            out.append(list(ids))
        return Encoded(out)

    # -- outputs -----------------------------------------------------------------------------------

    def _hidden(self, enc: Encoded) -> list[np.ndarray]:
        types = [np.asarray(t, dtype=np.int32) for t in enc.token_types] if enc.token_types is not None else None
        batch = EncodeBatch([np.asarray(t, dtype=np.int32) for t in enc.token_ids], types)
        return self.encoder.encode(batch)

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimensions:
            return
        if dimensions not in self.matryoshka_dimensions:
            accepted = ", ".join(str(d) for d in self.matryoshka_dimensions)
            raise RequestError(
                f"dimensions={dimensions} is not one this model gives (accepted: {accepted}; "
                "declare Matryoshka sizes with --matryoshka-dimensions)",
                param="dimensions",
            )

    def embed_encoded(self, enc: Encoded, *, dimensions: int | None = None) -> np.ndarray:
        """float32 ``[n, dimensions]`` sentence embeddings of encoded inputs."""
        if self.pipeline.pooling is None:
            raise RequestError(f"{self.name} is a cross-encoder: it scores pairs, it does not embed", param="model")
        self.check_dimensions(dimensions)
        hidden = self._hidden(enc)
        pooled = np.stack([heads.pool(h, self.pipeline.pooling) for h in hidden])
        x = heads.dense(pooled, self.pipeline.dense)
        if self.pipeline.normalize:
            x = heads.normalize(x)
        return heads.truncate(x, dimensions)

    def embed(
        self,
        texts: Sequence[str],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        truncate: bool | int | None = False,
    ) -> np.ndarray:
        """Sentence embeddings of ``texts`` as the model's own pipeline computes them."""
        enc = self.tokenize(texts, prompt=self.prompt_text(prompt_name, prompt), truncate=truncate)
        return self.embed_encoded(enc, dimensions=dimensions)

    def score_encoded(self, enc: Encoded) -> np.ndarray:
        """A cross-encoder's scores ``[n, labels]`` of encoded pairs."""
        head = self.pipeline.classifier
        if head is None:
            raise RequestError(f"{self.name} is not a cross-encoder", param="model")
        hidden = self._hidden(enc)
        return heads.classify(np.stack([h[0] for h in hidden]), head)

    def score_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool | int | None = False) -> np.ndarray:
        """One score per pair: a cross-encoder's (``CrossEncoder.predict``; one label's column), or an
        embedding model's cosine of the two texts' embeddings."""
        if self.pipeline.classifier is not None:
            scores = self.score_encoded(self.tokenize_pairs(pairs, truncate=truncate))
            if scores.shape[1] != 1:
                raise RequestError(f"{self.name} has {scores.shape[1]} labels; a score needs one", param="model")
            return scores[:, 0]
        a = self.embed([p[0] for p in pairs], prompt_name=self.role_prompt("query"), truncate=truncate)
        b = self.embed([p[1] for p in pairs], prompt_name=self.role_prompt("document"), truncate=truncate)
        return np.sum(heads.normalize(a) * heads.normalize(b), axis=-1)


def load_embedding_model(
    ref: str,
    *,
    backend: str | None = None,
    options: LoadOptions | None = None,
    host: PluginHost | None = None,
    cache_dir: str | None = None,
    matryoshka_dimensions: Sequence[int] | None = None,
) -> EmbeddingModel:
    """Resolve ``ref`` (a folder, or a Hub model in the cache) and load its pipeline and encoder."""
    from ruvllm.checkpoint import open_checkpoint
    from ruvllm.resolve import resolve

    root = Path(resolve(ref, cache=cache_dir))
    if not root.is_dir():
        raise ModelFormatError(f"{root}: an embedding or cross-encoder model is a folder (config.json, safetensors)")
    pipe = read_pipeline(root)
    checkpoint = open_checkpoint(pipe.transformer_path)
    hf_config: dict[str, Any] = json.loads((pipe.transformer_path / "config.json").read_text(encoding="utf-8"))
    if is_cross_encoder(hf_config):
        if checkpoint.config.layout != "bert":
            raise ModelFormatError(
                f"{root}: a sequence classifier of {checkpoint.config.architecture} is not implemented"
            )
        pipe.classifier = read_classifier(root, hf_config, checkpoint.tensor, checkpoint.tensor_names())
        pipe.pooling = None
    encoder = load_encoder(checkpoint, backend=backend, options=options, host=host)
    return EmbeddingModel(Path(ref).name or ref, root, encoder, pipe, matryoshka_dimensions=matryoshka_dimensions)
