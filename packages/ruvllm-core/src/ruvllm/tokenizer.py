"""Tokenizers built from a GGUF file's metadata or a Hugging Face ``tokenizer.json``, chat templates
rendered the way Hugging Face transformers renders them, and streaming detokenization.

The tokenization itself is done by the ``tokenizers`` library; this module only assembles the right
model, pre-tokenizer and decoder from what a GGUF file says (llama.cpp's key names and pre-tokenizer
names), so ids match what llama.cpp and the model's own ``tokenizer.json`` produce.

A byte-level GGUF whose ``tokenizer.ggml.pre`` names a pre-tokenizer not in
:data:`BPE_PRE_TOKENIZERS` still loads: it falls back to GPT-2's split and logs a warning, since
slightly different ids for some texts (usually digits and whitespace runs) beat refusing the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ruvllm.errors import ModelFormatError, RequestError

if TYPE_CHECKING:
    import jinja2

log = structlog.get_logger("ruvllm.tokenizer")


class GGUFMetadata(Protocol):
    """What :meth:`Tokenizer.from_gguf` reads of a GGUF file (a :class:`ruvllm.checkpoint.GGUFCheckpoint`
    is one); the checkpoint module builds tokenizers, so this one names only what it needs of it."""

    @property
    def chat_template(self) -> str | None: ...

    def meta(self, key: str, default: Any = None) -> Any: ...


# llama.cpp's token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of llama.cpp's BPE pre-tokenizers. Each pattern splits every piece the previous one
# left (matches and the text between them both become pieces), as llama.cpp's unicode_regex_split does.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SINGLE_DIGITS = r"\p{N}"

_GPT2_NAMES = ("gpt-2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code",
               "gigachat", "roberta-bpe", "mpt", "olmo", "jais", "trillion")
_DIGITS_GPT2_NAMES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "dbrx", "smaug-bpe")
# Llama 3 style vocabularies take a whole pre-token that is itself a token before trying merges.
_IGNORE_MERGES_NAMES = frozenset(_LLAMA3_NAMES) - {"dbrx", "smaug-bpe"}
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")

#: ``tokenizer.ggml.pre`` -> split patterns, applied in order, before byte-level encoding.
BPE_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # llama.cpp's fallback for files without a pre-tokenizer name: punctuation runs, GPT-2, digit runs, triples.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(_GPT2_NAMES, (_GPT2,)),
    **dict.fromkeys(_DIGITS_GPT2_NAMES, (_SINGLE_DIGITS, _GPT2)),
    **dict.fromkeys(_LLAMA3_NAMES, (_LLAMA3,)),
    **dict.fromkeys(_QWEN2_NAMES, (_QWEN2,)),
}


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build one with :meth:`from_gguf` or :meth:`from_hf_dir`; ``inner`` is the underlying
    ``tokenizers.Tokenizer``.
    """

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ) -> None:
        self._inner = inner
        self._vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        #: Ids of SentencePiece byte-fallback tokens (``<0xE4>``); empty for byte-level BPE.
        self.byte_fallback_ids = _byte_fallback_ids(inner)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, checkpoint: GGUFMetadata) -> Tokenizer:
        """The tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata, llama.cpp's layout)."""
        where = str(getattr(checkpoint, "path", "GGUF"))
        kind = checkpoint.meta("tokenizer.ggml.model")
        if kind is None:
            raise ModelFormatError(f"{where}: GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        tokens = checkpoint.meta("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError(f"{where}: GGUF tokenizer has no tokens (tokenizer.ggml.tokens)")
        token_types = checkpoint.meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelFormatError(f"{where}: GGUF has {len(tokens)} tokens but {len(token_types)} token types")

        def special_id(name: str) -> int | None:
            value = checkpoint.meta(f"tokenizer.ggml.{name}_token_id")
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise ModelFormatError(f"{where}: tokenizer.ggml.{name}_token_id={value} is outside the vocabulary")
            return int(value)

        bos, eos, unk = special_id("bos"), special_id("eos"), special_id("unknown")
        if kind == "gpt2":
            merges = checkpoint.meta("tokenizer.ggml.merges")
            if not merges:
                raise ModelFormatError(f"{where}: byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
            inner = _byte_level_bpe(tokens, merges, checkpoint.meta("tokenizer.ggml.pre"), where)
            add_bos_default = False
        elif kind == "llama":
            scores = checkpoint.meta("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ModelFormatError(f"{where}: SentencePiece tokenizer without one score per token")
            add_prefix = checkpoint.meta("tokenizer.ggml.add_space_prefix", True)
            inner = _sentencepiece_bpe(tokens, scores, token_types, unk, bool(add_prefix))
            add_bos_default = True  # llama.cpp and transformers both add BOS to SentencePiece vocabularies by default
        else:
            raise ModelFormatError(
                f"{where}: tokenizer model {kind!r} is not supported "
                "(supported: gpt2 byte-level BPE, llama SentencePiece)"
            )

        # Control tokens (chat markup, BOS/EOS) and user-defined ones are matched whole in the input, the
        # way llama.cpp does; ``normalized=False`` keeps them from being rewritten before matching.
        typed = [(t, ty) for t, ty in zip(tokens, token_types, strict=True) if t]
        inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _CONTROL])
        inner.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _USER_DEFINED])
        add_bos = bool(checkpoint.meta("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(checkpoint.meta("tokenizer.ggml.add_eos_token", False))
        _set_bos_eos_processor(inner, tokens, bos if add_bos else None, eos if add_eos else None, where)

        eos_ids = [i for i in (eos, special_id("eot"), special_id("eom")) if i is not None]
        template = checkpoint.chat_template
        return cls(inner, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template)

    @classmethod
    def from_hf_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory: ``tokenizer.json`` plus the BOS/EOS settings
        of ``tokenizer_config.json`` (and the EOS ids of ``generation_config.json``). The chat template
        is ``chat_template`` if given, else the one in ``tokenizer_config.json`` or ``chat_template.jinja``."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelFormatError(
                f"{path}: no tokenizer.json (ruvllm needs the fast-tokenizer file, not only tokenizer.model)"
            )
        try:
            inner = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ModelFormatError(f"{tj}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from exc
        config = _read_json(path / "tokenizer_config.json")

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, Mapping):
                tok = tok.get("content")
            return inner.token_to_id(tok) if isinstance(tok, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        if isinstance(config.get("add_bos_token"), bool) or isinstance(config.get("add_eos_token"), bool):
            # The config's flags win over the post-processor tokenizer.json ships, as in transformers.
            adds_bos = bos is not None and inner.encode("").ids[:1] == [bos]
            want_bos = config.get("add_bos_token", adds_bos)
            adds_eos = eos is not None and inner.encode("").ids[-1:] == [eos]
            want_eos = config.get("add_eos_token", adds_eos)
            if (want_bos, want_eos) != (adds_bos, adds_eos):
                vocab = {i: t for t, i in inner.get_vocab(with_added_tokens=True).items()}
                tokens = [vocab.get(i, "") for i in range(max(vocab) + 1)]
                _set_bos_eos_processor(inner, tokens, bos if want_bos else None, eos if want_eos else None, str(path))
        eos_ids = [eos] if eos is not None else []
        generation = _read_json(path / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if isinstance(gen_eos, int) else [])
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template and (path / "chat_template.jinja").is_file():  # where transformers 5 saves it
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(inner, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template or None)

    # -- properties ------------------------------------------------------------------------------
    @property
    def inner(self) -> tokenizers.Tokenizer:
        return self._inner

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation (EOS, and end-of-turn/end-of-message where the model has them)."""
        return self._eos_token_ids

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token markup in it (``<|im_start|>``) becomes single ids.
        ``add_special_tokens`` adds the BOS/EOS the model asks for."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a string, not {type(text).__name__}")
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = self._checked_ids(ids)
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling for BPE, ``▁`` for
        spaces in SentencePiece)."""
        (token_id,) = self._checked_ids([token_id])
        token = self._inner.id_to_token(token_id)
        if token is None:
            raise RequestError(f"token id {token_id} has no entry in the vocabulary")
        return token

    def _checked_ids(self, ids: Iterable[int]) -> list[int]:
        # tokenizers silently drops unknown ids; a bad id here is a caller's bug worth reporting.
        try:
            out = [int(i) for i in ids]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"token ids must be integers ({exc})") from None
        if out and (min(out) < 0 or max(out) >= self._vocab_size):
            bad = next(i for i in out if not 0 <= i < self._vocab_size)
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self._vocab_size - 1})")
        return out

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``), rendered with the
        model's chat template as transformers' ``apply_chat_template`` renders it. ``content`` may be a
        list of ``{"type": "text", "text": ...}`` parts: passed as they are to a template that reads parts'
        types, else joined with newlines. Extra keyword arguments
        (``tools``, ``documents``, template switches) are passed to the template."""
        template = self._template()
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_token_strings(), **kw}
        try:
            return template.render(
                messages=_plain_messages(messages, bool(_READS_PARTS.search(self.chat_template or ""))),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except RequestError:
            raise
        except Exception as exc:  # raise_exception() in the template, or a template tripping over the input
            import jinja2

            detail = str(exc) if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
            raise RequestError(f"the chat template rejected these messages: {detail}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered chat (``kw`` as for :meth:`apply_chat_template`); the template
        writes any BOS itself, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kw), add_special_tokens=False)

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self.chat_template:
                raise RequestError("this model has no chat template; send a plain prompt (completions) instead")
            self._compiled_template = _compile_chat_template(self.chat_template)
        return self._compiled_template

    def _special_token_strings(self) -> dict[str, str]:
        # Templates refer to these by name (``{{ bos_token }}``).
        out = {}
        if self._bos_token_id is not None:
            out["bos_token"] = self._inner.id_to_token(self._bos_token_id) or ""
        if self._eos_token_ids:
            out["eos_token"] = self._inner.id_to_token(self._eos_token_ids[0]) or ""
        return out


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces.

    ``push`` returns only complete characters: a byte-level token that ends inside a multi-byte
    UTF-8 character is held until the rest arrives. The pieces concatenate to
    ``tokenizer.decode(all_ids)``; ``flush`` returns whatever is still held (a truncated character
    then decodes to U+FFFD, as ``decode`` does).

    SentencePiece byte-fallback tokens (``<0xE4>``) are held until a run of them ends, because the
    decoder turns a whole run into U+FFFD when any byte of it is invalid, so a run's text is only
    final once the run is.

    Each step decodes a short window that starts one emitted step back, so decoders that treat the
    first token of a sequence differently (SentencePiece's leading-space strip) see the same context
    in both decodes and the difference is exactly the new text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Each id is checked once, when pushed, so the windows go straight to the inner tokenizer
        # (a subclass that decodes its own way keeps its decode).
        plain = isinstance(tokenizer, Tokenizer) and type(tokenizer).decode is Tokenizer.decode
        self._inner_decode = tokenizer._inner.decode if plain else None
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: the step before the last emitted one
        self._read_offset = 0  # ids up to here have been emitted

    def push(self, token_id: int) -> str:
        if self._inner_decode is not None:
            (token_id,) = self._tokenizer._checked_ids((token_id,))  # an invalid id raises before it is kept
        self._ids.append(token_id)
        try:
            return self._emit(final=False)
        except RequestError:
            self._ids.pop()  # an invalid id leaves the stream as it was
            raise

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._inner_decode is not None:
            decode, skip = self._inner_decode, self._skip_special
            prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
            text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        else:
            prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
            text = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(text) <= len(prefix):
            return ""  # nothing new yet
        if not final and (text.endswith("\ufffd") or self._ids[-1] in self._tokenizer.byte_fallback_ids):
            return ""  # the last character, or the byte run it belongs to, may still change
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]


# -- builders ------------------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None, where: str) -> tokenizers.Tokenizer:
    vocab = _vocab(tokens)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ModelFormatError(f"{where}: malformed BPE merge {m!r}")
        pairs.append((left, right))
    name = pre if pre is not None else "default"
    if name not in BPE_PRE_TOKENIZERS:
        # An unknown pre-tokenizer still gives usable (if not id-exact) tokenization with GPT-2's split;
        # refusing the model outright would be worse than a warning that names the cause.
        log.warning(
            "unknown GGUF pre-tokenizer; falling back to the GPT-2 split, ids may differ from the reference",
            pre=pre,
            path=where,
        )
        name = "gpt-2"
    elif pre is None:
        log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's default BPE split", path=where)
    inner = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=name in _IGNORE_MERGES_NAMES))
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in BPE_PRE_TOKENIZERS[name]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    inner.decoder = decoders.ByteLevel()
    return inner


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], token_types: list[int], unk: int | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """llama.cpp's SentencePiece (``llama``) vocabulary as a score-ranked BPE with byte fallback.

    SentencePiece BPE repeatedly merges the adjacent pair whose concatenation has the highest score;
    a BPE whose merges are ranked by that score does the same.
    """
    vocab = _vocab(tokens)
    candidates = []
    for merged_id, piece in enumerate(tokens):
        if token_types[merged_id] != _NORMAL or vocab.get(piece) != merged_id:
            continue
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left is not None and right is not None:
                candidates.append((-float(scores[merged_id]), merged_id, left, right))
    candidates.sort()
    merges = [(tokens[left], tokens[right]) for _, _, left, right in candidates]
    inner = tokenizers.Tokenizer(
        models.BPE(
            vocab, merges, unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True
        )
    )
    # Like llama.cpp (and sentencepiece on plain text): spaces become "▁" and every run of text gets a
    # leading "▁", even one that already starts with a space or follows a special token. (transformers'
    # Metaspace pre-tokenizer skips the prefix in both cases, which changes the ids of such text.)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    inner.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    inner.decoder = decoders.Sequence(decode_steps)
    return inner


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_fallback_ids(inner: tokenizers.Tokenizer) -> frozenset[int]:
    model = inner.model
    if not (isinstance(model, models.BPE) and model.byte_fallback):
        return frozenset()
    return frozenset(i for t, i in inner.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t))


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated entry keeps its first id, as a dict lookup in llama.cpp does
    return vocab


def _set_bos_eos_processor(
    inner: tokenizers.Tokenizer, tokens: list[str], bos: int | None, eos: int | None, where: str
) -> None:
    if bos is None and eos is None:
        inner.post_processor = None
        return
    pre = [f"{tokens[bos]}"] if bos is not None else []
    post = [f"{tokens[eos]}"] if eos is not None else []
    specials = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    try:
        inner.post_processor = processors.TemplateProcessing(
            single=[*pre, "$A", *post], pair=[*pre, "$A", *post, *pre, "$B:1", *post], special_tokens=specials
        )
    except Exception as exc:
        raise ModelFormatError(f"{where}: BOS/EOS tokens {specials} cannot be added to sequences ({exc})") from exc


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{file}: invalid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


# -- chat templates ------------------------------------------------------------------------------


#: A template that looks at a part's ``type`` renders list-of-parts content itself (Gemma-3, Llama-3.2,
#: Qwen2.5-VL); others get the text parts joined (the way vLLM picks its "openai" or "string" format).
_READS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")


def _plain_messages(messages: Sequence[Mapping[str, Any]], keep_parts: bool = False) -> list[dict[str, Any]]:
    """Copies of the messages with list-of-parts content checked (text parts only) and, unless
    ``keep_parts``, joined into one string with newlines."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"message {n} must be an object with a string 'role'")
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise RequestError(f"message {n}: only text content parts are supported, got {kind!r}")
                texts.append(part["text"])
            copy["content"] = [dict(p) for p in content] if keep_parts else "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"message {n}: content must be a string or a list of text parts")
        out.append(copy)
    return out


def _compile_chat_template(source: str) -> jinja2.Template:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
        transformers; for rendering, its body is output as is."""

        tags = {"generation"}  # noqa: RUF012 (jinja declares it a plain set)

        def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes; chat templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # Templates come with model files, so they run sandboxed; the whitespace settings are transformers'.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(
            f"the model's chat template is not valid Jinja (line {exc.lineno}: {exc.message})"
        ) from exc
