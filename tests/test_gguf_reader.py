"""``ruvllm.checkpoint``'s GGUF reader reads metadata arrays whole (a 151k-token vocabulary took the
gguf library 2.5-7 s, element by element): every field's ``contents()`` and types equal the library's,
for strings (empty, multi-byte UTF-8), every number type, empty arrays and scalars; tensors are the
same; a string array that runs past the end of the file is an error, not a short list."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from _gguf_files import write_tiny_llama_gguf

from ruvllm.checkpoint import _fast_gguf_reader, open_checkpoint
from ruvllm.errors import ModelFormatError


def _write(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", ["", "a", "héllo wörld", "日本語", "x" * 1000, "\n\t"])
    w.add_array("test.empty", [])
    w.add_array("test.i32", [1, -2, 3])
    w.add_array("test.f32", [0.5, -1.25, 3.0])
    w.add_array("test.bools", [True, False, True])
    w.add_uint8("test.u8", 7)
    w.add_string("test.string", "one string")
    w.add_float64("test.f64", 2.5)
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_are_the_librarys(tmp_path):
    for path in (_write(tmp_path / "all.gguf"), write_tiny_llama_gguf(tmp_path / "tiny.gguf")):
        ours, ref = _fast_gguf_reader(path), gguf.GGUFReader(path)
        assert list(ours.fields) == list(ref.fields)
        for key, field in ref.fields.items():
            assert ours.fields[key].contents() == field.contents(), key
            assert ours.fields[key].types == field.types, key
        assert [(t.name, t.tensor_type, tuple(t.shape)) for t in ours.tensors] == [
            (t.name, t.tensor_type, tuple(t.shape)) for t in ref.tensors
        ]
        for a, b in zip(ours.tensors, ref.tensors, strict=True):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert _fast_gguf_reader(tmp_path / "all.gguf").fields["test.strings"].contents()[3] == "日本語"


def test_a_string_array_past_the_end_of_the_file_is_an_error(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens")
    (tmp_path / "cut.gguf").write_bytes(data[: at + 2000])
    with pytest.raises(ModelFormatError, match="not a readable GGUF file"):
        open_checkpoint(tmp_path / "cut.gguf")
