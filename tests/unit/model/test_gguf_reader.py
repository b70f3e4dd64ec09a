"""exactrl's GGUF container reader (exactrl/model/gguf_reader.py) against the `gguf` package's GGUFReader, the
oracle: on files the `gguf` package writes (models of several tensor types, byte-level and SentencePiece
tokenizers, every metadata value type, big-endian, a custom alignment) both give the same metadata values, of the
same Python types, and the same tensor bytes, dtypes and shapes; damaged files are ValueErrors naming the file
and what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import make_hf_model

pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from gguf_files import add_spm_tokenizer, train_spm, write_gguf, write_tokenizer_gguf  # noqa: E402

import exactrl  # noqa: E402
from exactrl.model.gguf import open_gguf  # noqa: E402
from exactrl.model.gguf_reader import read_gguf  # noqa: E402
from exactrl.model.tokenizer import build_tokenizer  # noqa: E402

TEXTS = ["Hello world! 12345 + 678", "Ünïcödé façade naïve 🎉 中文", "the cat sat on the mat, didn't it?"]


def _typed(v):
    """A value with the type of every part spelled out, so that 1 == 1.0 == True compare unequal."""
    if isinstance(v, list):
        return ("list", [_typed(x) for x in v])
    return (type(v).__name__, v)


def _flat(v):
    """A nested list flattened as GGUFReader's `contents()` flattens arrays of arrays."""
    return [y for x in v for y in _flat(x)] if isinstance(v, list) else [v]


def assert_same_as_ggufreader(path, nested: bool = False) -> None:
    import gguf

    want = gguf.GGUFReader(str(path), "r")
    got = read_gguf(path)
    fields = {k: f for k, f in want.fields.items() if not k.startswith("GGUF.")}
    assert list(got.metadata) == list(fields)
    for key, f in fields.items():
        ours = got.metadata[key]
        if nested and isinstance(ours, list):
            ours = _flat(ours)
        assert _typed(ours) == _typed(f.contents()), key
    version = want.fields["GGUF.version"].contents()
    assert (got.version, got.alignment, got.data_offset) == (version, int(want.alignment), want.data_offset)
    assert list(got.tensors) == [t.name for t in want.tensors]
    for t in want.tensors:
        ours = got.tensors[t.name]
        assert (ours.tensor_type, ours.shape, ours.n_elements, ours.n_bytes, ours.data_offset) == (
            t.tensor_type,
            tuple(t.shape.tolist()),
            t.n_elements,
            t.n_bytes,
            t.data_offset,
        ), t.name
        a = got.tensor_data(ours)
        assert (a.dtype, a.shape) == (t.data.dtype, t.data.shape), t.name
        assert a.tobytes() == t.data.tobytes(), t.name


def _model(tmp_path, arch, **over):
    make_hf_model(tmp_path / "hf", arch, **over)
    return exactrl.load_model(tmp_path / "hf")


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    return train_spm([t for t in TEXTS for _ in range(20)], vocab_size=300, control=("<|im_end|>",))


@pytest.mark.parametrize("arch, qtype", [("llama", "F32"), ("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("llama", "BF16")])
def test_model_files_read_as_ggufreader_reads_them(tmp_path, arch, qtype):
    """Models with a byte-level tokenizer, every weight type the writer quantizes plus a raw Q6_K tensor."""
    src = _model(tmp_path, arch)
    build_tokenizer(tmp_path / "tok", [t * 3 for t in TEXTS] * 5, vocab_size=300)
    raw = None
    if arch == "llama":  # mlp.down_proj [64, 128]: blocks of 256 weights do not fit; an F16 tensor stored raw
        raw = {"blk.1.ffn_down.weight": (np.full((64, 128), 0.5, np.float16).view(np.uint8), "F16")}
    write_gguf(tmp_path / "m.gguf", src, tokenizer_dir=tmp_path / "tok", qtype=qtype, raw=raw)
    assert_same_as_ggufreader(tmp_path / "m.gguf")


def test_k_quant_and_sentencepiece_file_reads_as_ggufreader_reads_it(tmp_path, spm_model):
    src = _model(tmp_path, "llama", intermediate_size=256, vocab_size=300)
    blocks = np.random.default_rng(0).integers(0, 256, (64, 210), dtype=np.uint8)  # Q6_K: 210 bytes per 256
    write_gguf(
        tmp_path / "m.gguf",
        src,
        tokenizer=lambda w: add_spm_tokenizer(w, spm_model, {"<|im_end|>": True}, chat_template="{{ x }}"),
        qtype="Q5_0",
        raw={"blk.0.ffn_down.weight": (blocks, "Q6_K")},
    )
    got = read_gguf(tmp_path / "m.gguf")
    assert got.tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q6_K"
    assert len(got.metadata["tokenizer.ggml.tokens"]) == 300
    assert_same_as_ggufreader(tmp_path / "m.gguf")


def test_vocabulary_only_file_reads_as_ggufreader_reads_it(tmp_path, spm_model):
    path = tmp_path / "v.gguf"
    write_tokenizer_gguf(path, lambda w: add_spm_tokenizer(w, spm_model, {}, merges=["a b", "▁ t"], prefix=False))
    got = read_gguf(path)
    assert got.tensors == {} and got.metadata["tokenizer.ggml.add_space_prefix"] is False
    assert_same_as_ggufreader(path)


def _all_types(w) -> None:
    import gguf

    T = gguf.GGUFValueType
    scalars = [
        (T.UINT8, 255),
        (T.INT8, -128),
        (T.UINT16, 65535),
        (T.INT16, -32768),
        (T.UINT32, 2**32 - 1),
        (T.INT32, -(2**31)),
        (T.FLOAT32, 1e-5),
        (T.BOOL, True),
        (T.UINT64, 2**64 - 1),
        (T.INT64, -(2**63)),
        (T.FLOAT64, 0.1),
    ]
    for vtype, v in scalars:
        w.add_key_value(f"s.{vtype.name}", v, vtype)
        w.add_key_value(f"a.{vtype.name}", [v, v if vtype == T.BOOL else 0, v], T.ARRAY, sub_type=vtype)
    w.add_string("s.STRING", "Ünïcödé 🎉 \x00 中文")
    w.add_array("a.STRING", ["", "a", "▁the", "🎉" * 100])
    w.add_array("nested.int", [[1, 2], [3], [4, 5, 6]])
    w.add_array("nested.str", [["a", "bc"], ["🎉"]])


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_every_value_type_and_byte_order_read_as_ggufreader_reads_them(tmp_path, endian):
    """Every scalar and array element type; arrays of arrays come back nested (GGUFReader flattens them)."""
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endian])
    _all_types(w)
    w.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b", np.arange(32, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_gguf(path)
    assert got.byte_order == ("<" if endian == "LITTLE" else ">")
    assert got.metadata["nested.int"] == [[1, 2], [3], [4, 5, 6]]
    assert got.metadata["nested.str"] == [["a", "bc"], ["🎉"]]
    assert got.metadata["s.FLOAT32"] == float(np.float32(1e-5)) and got.metadata["s.UINT64"] == 2**64 - 1
    assert got.tensor_data(got.tensors["a"]).tolist() == np.arange(64, dtype=np.float32).reshape(2, 32).tolist()
    assert_same_as_ggufreader(path, nested=True)


def test_custom_alignment_moves_the_data_section(tmp_path):
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(256)
    w.add_tensor("a", np.arange(40, dtype=np.float32))
    w.add_tensor("b", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_gguf(path)
    assert got.alignment == 256 and got.data_offset % 256 == 0
    assert got.tensor_data(got.tensors["b"]).tolist() == list(range(8))
    assert_same_as_ggufreader(path)


def test_empty_array_reads_as_an_empty_list(tmp_path):
    """GGUFWriter refuses to write one; llama.cpp's writer does not."""
    kv = struct.pack("<Q", 5) + b"empty" + struct.pack("<IIQ", 9, 4, 0)
    (tmp_path / "e.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    got = read_gguf(tmp_path / "e.gguf")
    assert got.metadata == {"empty": []} and got.data_offset == 64  # 24 + 29 bytes, aligned to 32
    assert_same_as_ggufreader(tmp_path / "e.gguf")


# --------------------------------------------------------------------------- damaged files


@pytest.fixture()
def tok_file(tmp_path, spm_model):
    path = tmp_path / "t.gguf"
    write_tokenizer_gguf(path, lambda w: add_spm_tokenizer(w, spm_model, {}))
    return path


def _patched(path, at: int, fmt: str, value) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def _key_end(data: bytes, key: str) -> int:
    """The offset just past metadata key `key` (where its uint32 value type is)."""
    i = data.index(struct.pack("<Q", len(key)) + key.encode())
    return i + 8 + len(key)


def test_truncated_metadata_is_named(tok_file):
    data = tok_file.read_bytes()
    cut = _key_end(data, "tokenizer.ggml.tokens") + 12 + 8 + 2000  # inside the token list
    tok_file.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"t.gguf is not a readable GGUF file: .*'tokenizer.ggml.tokens'"):
        read_gguf(tok_file)
    tok_file.write_bytes(data[: _key_end(data, "tokenizer.ggml.scores") + 2])
    with pytest.raises(
        ValueError, match=r"metadata key 'tokenizer.ggml.scores': value type at byte \d+ would end at byte"
    ):
        read_gguf(tok_file)
    tok_file.write_bytes(data[:20])
    with pytest.raises(ValueError, match="metadata count at byte 16 would end at byte 24, past the end of the file"):
        open_gguf(tok_file)


def test_bad_value_type_is_named(tok_file):
    _patched(tok_file, _key_end(tok_file.read_bytes(), "tokenizer.ggml.pre"), "<I", 77)
    with pytest.raises(ValueError, match=r"t.gguf .*'tokenizer.ggml.pre': value type 77 at byte \d+ is not a GGUF"):
        read_gguf(tok_file)
    _patched(tok_file, _key_end(tok_file.read_bytes(), "tokenizer.ggml.tokens") + 4, "<I", 99)  # element type
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.pre': value type 77"):  # the first damage found
        read_gguf(tok_file)
    _patched(tok_file, _key_end(tok_file.read_bytes(), "tokenizer.ggml.pre"), "<I", 8)
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.tokens': array element type 99 at byte \d+ is not a GGUF"):
        read_gguf(tok_file)


def test_string_past_the_end_of_the_file_is_named(tok_file):
    data = tok_file.read_bytes()
    _patched(tok_file, _key_end(data, "tokenizer.ggml.model") + 4, "<Q", len(data))
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.model': string of \d+ bytes at byte \d+ would end at"):
        read_gguf(tok_file)
    tok_file.write_bytes(data)
    first = _key_end(data, "tokenizer.ggml.tokens") + 4 + 4 + 8  # type, element type, count: the first length
    at = first + 8 + struct.unpack_from("<Q", data, first)[0]  # the second string's length
    _patched(tok_file, at, "<Q", 2**40)
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.tokens'\[1\]: string of 1099511627776 bytes at byte"):
        read_gguf(tok_file)
    tok_file.write_bytes(data)
    _patched(tok_file, first - 8, "<Q", 2**62)
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.tokens': array of 4611686018427387904 strings"):
        read_gguf(tok_file)


def test_bad_header_tensor_infos_and_data_are_named(tmp_path):
    src = _model(tmp_path, "qwen2")
    write_gguf(tmp_path / "m.gguf", src)
    path, data = tmp_path / "m.gguf", (tmp_path / "m.gguf").read_bytes()
    last = list(read_gguf(path).tensors)[-1]
    _patched(path, 4, "<I", 4)
    with pytest.raises(ValueError, match="m.gguf is not a readable GGUF file: version 4 is not read; read: 2, 3"):
        read_gguf(path)
    path.write_bytes(data[:-100])  # into the last tensor's data
    with pytest.raises(
        ValueError, match=rf"tensor '{last}': its \d+ bytes of data at byte \d+ run past the end of the file"
    ):
        read_gguf(path)
    path.write_bytes(data)
    kind = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 16  # after n_dims and 2 dims
    _patched(path, kind, "<I", 1000)
    with pytest.raises(ValueError, match="tensor 'token_embd.weight' has ggml type 1000, which is not a ggml type"):
        read_gguf(path)
    path.write_bytes(data)
    _patched(
        path, data.index(struct.pack("<Q", len(last)) + last.encode()), "<Q", 10**6
    )  # the last tensor name's length
    with pytest.raises(ValueError, match=r"tensor info 26: name: string of 1000000 bytes at byte \d+ would end"):
        read_gguf(path)
    path.write_bytes(data[: data.index(b"token_embd.weight")])  # each tensor info takes 24 bytes at least
    with pytest.raises(ValueError, match=r"27 tensor infos at byte \d+ would end at byte \d+, past the end"):
        read_gguf(path)


def test_bad_alignment_is_named(tmp_path):
    import gguf

    for value, vtype, match in (
        (48, "UINT32", "general.alignment=48 is not a power of two"),
        (32, "UINT64", "not UINT32"),
    ):
        w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
        w.add_key_value("general.alignment", value, gguf.GGUFValueType[vtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ValueError, match=match):
            read_gguf(tmp_path / "a.gguf")


def _kv_string(key: bytes, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value


def _tensor_info(name: bytes, offset: int) -> bytes:
    return struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 8, 0, offset)  # 1-D, 8 F32


def test_duplicates_and_bad_utf8_are_named(tmp_path):
    """Hand-written files (GGUFWriter writes none of these): a key twice, a tensor name twice, bytes not UTF-8."""
    head = b"GGUF" + struct.pack("<I", 3)
    cases = {
        "metadata key 'a' appears twice": struct.pack("<QQ", 0, 2) + _kv_string(b"a", b"x") + _kv_string(b"a", b"y"),
        r"metadata key 'b': string at byte 45 is not UTF-8 \(invalid start byte\)": struct.pack("<QQ", 0, 1)
        + _kv_string(b"b", b"ok\xff"),
        r"metadata key 'c'\[1\]: string at byte \d+ is not UTF-8": struct.pack("<QQ", 0, 1)
        + struct.pack("<Q", 1)
        + b"c"
        + struct.pack("<IIQ", 9, 8, 2)
        + struct.pack("<Q", 1)
        + b"a"
        + struct.pack("<Q", 2)
        + b"\xc3(",
        "tensor 't' appears twice": struct.pack("<QQ", 2, 0)
        + _tensor_info(b"t", 0)
        + _tensor_info(b"t", 32)
        + bytes(96),
    }
    for i, (match, body) in enumerate(cases.items()):
        (tmp_path / f"{i}.gguf").write_bytes(head + body)
        with pytest.raises(ValueError, match=rf"{i}.gguf is not a readable GGUF file: {match}"):
            read_gguf(tmp_path / f"{i}.gguf")
