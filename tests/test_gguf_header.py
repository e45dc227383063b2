"""The GGUF header reader (pipeline.infra.gguf_file.read_header) against gguf-py's own GGUFReader: every field
and every tensor of a file written by gguf-py's writer, and of llama.cpp's real vocabulary files."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.infra.gguf_file import gguf_metadata, read_header, tensor_types, type_elements


def _reader_view(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), t.tensor_type.name, int(t.n_elements), int(t.n_bytes))
               for t in r.tensors]
    return fields, tensors


def _ours(path, arrays):
    h = read_header(path, arrays=tuple(arrays))
    return h.fields, [(t.name, t.shape, t.type, t.n_elements, t.n_bytes) for t in h.tensors]


@pytest.fixture
def written(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 65000)
    w.add_int32("t.i32", -123456)
    w.add_uint32("t.u32", 4000000000)
    w.add_uint64("t.u64", 2 ** 40 + 1)
    w.add_int64("t.i64", -(2 ** 40))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("tokenizer.ggml.pre", "llama-bpe")
    w.add_string("t.unicode", "Grüße ▁ 你好")
    w.add_array("t.strings", ["a", "", "Ġ Ġ", "✓"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    w.add_array("t.bools", [True, False])
    w.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), dtype=np.float16))
    # a Q8_0 tensor of 2 rows x 64: 2 blocks of 34 bytes per row
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 68), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_field_and_tensor_as_gguf_py_reads_them(written):
    theirs_fields, theirs_tensors = _reader_view(written)
    fields, tensors = _ours(written, arrays=theirs_fields)
    assert tensors == theirs_tensors
    assert [t[2] for t in tensors] == ["F32", "F16", "Q8_0"] and tensors[2][1] == (64, 2) and tensors[2][4] == 136
    assert set(fields) == set(theirs_fields)
    for key, value in theirs_fields.items():
        assert fields[key] == pytest.approx(value) if isinstance(value, float) else fields[key] == value, key


def test_arrays_not_asked_for_are_stepped_over(written):
    h = read_header(written)
    assert h.fields["t.strings"] is None and h.fields["t.ints"] is None
    assert h.fields["t.unicode"] == "Grüße ▁ 你好"          # fields after the skipped arrays still read right
    assert tensor_types(written) == {"F16": 1, "F32": 1, "Q8_0": 1}
    assert type_elements(written) == {"F16": 32 * 32, "F32": 8 * 32, "Q8_0": 2 * 64}
    assert gguf_metadata(written, "tokenizer.ggml.pre") == "llama-bpe"
    assert gguf_metadata(written, "t.strings") == ["a", "", "Ġ Ġ", "✓"]
    assert gguf_metadata(written, "absent.key") is None


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match=r"x\.gguf is not a GGUF file"):
        read_header(bad)


@pytest.mark.integration
@pytest.mark.parametrize("vocab", ["llama-spm", "qwen2"])
def test_real_vocabulary_files(vocab):
    from pipeline.infra.make_paths import vocab_dir

    path = vocab_dir() / f"ggml-vocab-{vocab}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent: `make setup` fetches llama.cpp's source with its vocabulary files")
    theirs_fields, theirs_tensors = _reader_view(path)
    keys = [k for k in theirs_fields if k.startswith("tokenizer.")]
    fields, tensors = _ours(path, arrays=keys)
    assert tensors == theirs_tensors
    for key in keys:
        mine, theirs = fields[key], theirs_fields[key]
        if isinstance(theirs, list) and theirs and isinstance(theirs[0], float):
            assert np.allclose(mine, theirs), key
        else:
            assert mine == theirs, key
