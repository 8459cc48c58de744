"""common/gguf_metadata.py reads the same header as gguf.GGUFReader, fast and without numpy."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from common.gguf_metadata import GGUFFormatError, read_gguf_header


def _assert_same_as_gguf_reader(path: Path) -> None:
    ours = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, value in fields.items():
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value), key
        else:
            assert ours.metadata[key] == value, key
    assert [(t.name, t.shape, t.ggml_type) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors
    ]
    assert ours.data_offset == int(reader.data_offset)
    assert ours.file_size == path.stat().st_size
    assert [t.offset for t in ours.tensors] == [
        int(t.data_offset) - int(reader.data_offset) for t in reader.tensors
    ]


def test_default_model_header(smollm2_gguf):
    start = time.perf_counter()
    header = read_gguf_header(smollm2_gguf)
    elapsed = time.perf_counter() - start
    assert header.version == 3 and len(header.tensors) == 272
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.metadata["tokenizer.ggml.merges"]) == 48900
    assert elapsed < 1.5  # GGUFReader needs ~2.5 s here; we need ~0.1 s
    _assert_same_as_gguf_reader(smollm2_gguf)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_both_endians(tmp_path, endian):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama", endianess=endian)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ☃")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "日本"])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_gguf_header(path)
    assert header.metadata["t.str"] == "héllo ☃" and header.metadata["t.u64"] == 2**60
    assert header.metadata["t.strs"] == ["a", "", "日本"]
    assert [(t.name, t.shape) for t in header.tensors] == [("a.weight", (4, 3)), ("b.weight", (5,))]
    if endian == gguf.GGUFEndian.LITTLE:  # GGUFReader reads big-endian files only on BE hosts
        _assert_same_as_gguf_reader(path)


def test_not_gguf_and_truncated(tmp_path, smollm2_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_header(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:100_000])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf_header(cut)
