"""A reader of the GGUF container (llama.cpp's file format): header, metadata and tensor infos, file memory-mapped.

Invariant: `read_gguf(path)` gives every metadata value exactly as the `gguf` package's `GGUFReader` gives it
(`ReaderField.contents()`: Python str, int, float, bool, or a list of them; nested arrays as nested lists,
where GGUFReader flattens them) and every tensor's bytes as GGUFReader's `ReaderTensor.data` (the same dtype and
shape over the same file bytes), or raises a ValueError that names the file, the byte offset and what is wrong.
Nothing is read past the end of the file: each read checks its bounds first.

Layout (GGUF versions 2 and 3; little-endian, or big-endian when the version's low 16 bits are zero, as
GGUFReader decides): magic "GGUF", uint32 version, uint64 tensor count, uint64 KV count; then each KV pair
(string key, uint32 value type, value); then each tensor info (string name, uint32 n_dims, n_dims x uint64
dims innermost first, uint32 ggml type, uint64 offset into the data section); then padding to
`general.alignment` (uint32, a power of two, default 32), where the data section starts. A string is a uint64
byte length and UTF-8 bytes; an array is a uint32 element type, a uint64 length and the elements.

Speed: GGUFReader makes numpy records for every array element, several per token of a vocabulary; here a
numeric array is one `np.frombuffer` and a string array one tight loop over the mapped bytes (figures:
docs/performance.md). Only the enums and block sizes come from the `gguf` package (GGMLQuantizationType,
GGML_QUANT_SIZES).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUF value types that are not fixed-size scalars
# GGUF value type -> (name, numpy dtype code without byte order); the fixed-size scalar types
SCALARS = {
    0: ("UINT8", "u1"),
    1: ("INT8", "i1"),
    2: ("UINT16", "u2"),
    3: ("INT16", "i2"),
    4: ("UINT32", "u4"),
    5: ("INT32", "i4"),
    6: ("FLOAT32", "f4"),
    7: ("BOOL", "?"),
    10: ("UINT64", "u8"),
    11: ("INT64", "i8"),
    12: ("FLOAT64", "f8"),
}
# ggml types whose tensor data GGUFReader types by element (shape in elements); every other type is bytes
TYPED = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the file's tensor info section."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    n_elements: int
    n_bytes: int  # its data's size in the file
    data_offset: int  # absolute byte offset of its data in the file


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata in file order, tensor infos by name in file order, the mapped bytes."""

    path: Path
    version: int
    byte_order: str  # "<" little-endian, ">" big-endian
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int  # where the data section starts
    buf: Any = field(repr=False)  # the read-only mmap of the whole file

    def tensor_data(self, t: TensorInfo) -> np.ndarray:
        """A read-only numpy view of tensor `t`'s bytes in the mapped file, as GGUFReader's `ReaderTensor.data`:
        typed elements in torch order for TYPED types, else uint8 rows of blocks (innermost dim in bytes)."""
        from gguf import GGML_QUANT_SIZES

        dims = tuple(reversed(t.shape))
        kind = TYPED.get(t.tensor_type.name)
        if kind is not None:
            a = np.frombuffer(self.buf, self.byte_order + kind, t.n_elements, t.data_offset)
            return a.reshape(dims)
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        a = np.frombuffer(self.buf, np.uint8, t.n_bytes, t.data_offset)
        return a.reshape((*dims[:-1], dims[-1] // block * size) if dims else ())


class _Cursor:
    """Bounds-checked reads from the mapped file at a moving offset; every failure names the file and offset."""

    def __init__(self, path: Path, buf, order: str) -> None:
        self.path, self.buf, self.order, self.off, self.size = path, buf, order, 0, len(buf)
        self.u32 = struct.Struct(order + "I")
        self.u64 = struct.Struct(order + "Q")

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {what} (file size {self.size} bytes)")

    def need(self, n: int, what: str) -> None:
        if self.off + n > self.size:
            raise self.fail(f"{what} at byte {self.off} would end at byte {self.off + n}, past the end of the file")

    def uint(self, s: struct.Struct, what: str) -> int:
        self.need(s.size, what)
        (v,) = s.unpack_from(self.buf, self.off)
        self.off += s.size
        return v

    def string(self, what: str) -> str:
        n = self.uint(self.u64, f"{what}: string length")
        self.need(n, f"{what}: string of {n} bytes")
        raw = self.buf[self.off : self.off + n]
        try:
            s = str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}: string at byte {self.off} is not UTF-8 ({e.reason})") from None
        self.off += n
        return s

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: one loop over the mapped bytes, bounds checked per string."""
        self.need(8 * count, f"{what}: array of {count} strings")  # each at least its 8-byte length
        buf, off, size, u64, out = self.buf, self.off, self.size, self.u64.unpack_from, []
        append = out.append
        for i in range(count):
            if off + 8 > size:
                raise self.fail(f"{what}[{i}]: string length at byte {off} runs past the end of the file")
            (n,) = u64(buf, off)
            end = off + 8 + n
            if end > size:
                raise self.fail(f"{what}[{i}]: string of {n} bytes at byte {off + 8} runs past the end of the file")
            try:
                append(str(buf[off + 8 : end], "utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}]: string at byte {off + 8} is not UTF-8 ({e.reason})") from None
            off = end
        self.off = off
        return out

    def value(self, vtype: int, what: str) -> Any:
        """One metadata value of GGUF value type `vtype` as GGUFReader's `contents()` gives it."""
        if vtype == STRING:
            return self.string(what)
        if vtype in SCALARS:
            dt = np.dtype(self.order + SCALARS[vtype][1])
            self.need(dt.itemsize, f"{what}: {SCALARS[vtype][0]} value")
            v = np.frombuffer(self.buf, dt, 1, self.off)[0].item()
            self.off += dt.itemsize
            return v
        if vtype == ARRAY:
            return self.array(what)
        raise self.fail(f"{what}: value type {vtype} at byte {self.off - 4} is not a GGUF value type (0-12)")

    def array(self, what: str) -> list:
        etype = self.uint(self.u32, f"{what}: array element type")
        count = self.uint(self.u64, f"{what}: array length")
        if etype == STRING:
            return self.strings(count, what)
        if etype in SCALARS:
            dt = np.dtype(self.order + SCALARS[etype][1])
            self.need(count * dt.itemsize, f"{what}: array of {count} {SCALARS[etype][0]}")
            a = np.frombuffer(self.buf, dt, count, self.off)
            self.off += count * dt.itemsize
            return a.tolist()
        if etype == ARRAY:
            self.need(12 * count, f"{what}: array of {count} arrays")  # each at least its type and length
            return [self.array(f"{what}[{i}]") for i in range(count)]
        raise self.fail(f"{what}: array element type {etype} at byte {self.off - 12} is not a GGUF value type (0-12)")


def read_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, memory-mapped and parsed (module doc); a damaged file is a ValueError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GGUF file {p} " + ("is a directory" if p.is_dir() else "does not exist"))
    with p.open("rb") as f:
        head = f.read(8)
        if head[:4] != MAGIC:
            raise ValueError(f"{p} is not a GGUF file: it starts with {head[:4]!r}, a GGUF file with {MAGIC!r}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    order = ">" if len(head) == 8 and struct.unpack("<I", head[4:])[0] & 0xFFFF == 0 else "<"
    cur = _Cursor(p, buf, order)
    cur.off = 4
    version = cur.uint(cur.u32, "version")
    if version not in VERSIONS:
        raise cur.fail(f"version {version} is not read; read: {', '.join(map(str, VERSIONS))}")
    n_tensors = cur.uint(cur.u64, "tensor count")
    n_kv = cur.uint(cur.u64, "metadata count")
    metadata = _metadata(cur, n_kv)
    alignment = _alignment(cur, metadata)
    infos = [_tensor_info(cur, i) for i in range(_count(cur, n_tensors, 24, "tensor infos"))]
    data_offset = -(-cur.off // alignment) * alignment
    tensors = _tensors(cur, infos, data_offset)
    return GGUFFile(p, version, order, metadata, tensors, alignment, data_offset, buf)


def _count(cur: _Cursor, n: int, least: int, what: str) -> int:
    """`n` entries, each at least `least` bytes, checked to fit in the rest of the file before any is read."""
    cur.need(n * least, f"{n} {what}")
    return n


def _metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(_count(cur, n_kv, 20, "metadata entries")):  # key length, value type, smallest value
        key = cur.string(f"metadata entry {i}: key")
        if key in out:
            raise cur.fail(f"metadata key {key!r} appears twice")
        vtype = cur.uint(cur.u32, f"metadata key {key!r}: value type")
        out[key] = cur.value(vtype, f"metadata key {key!r}")
        if vtype != 4 and key == "general.alignment":
            raise cur.fail(f"metadata key 'general.alignment' has value type {vtype}, not UINT32 (4)")
    return out


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    a = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if a <= 0 or a & (a - 1):
        raise cur.fail(f"general.alignment={a} is not a power of two")
    return a


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor info {i}: name")
    what = f"tensor {name!r}"
    n_dims = cur.uint(cur.u32, f"{what}: dimension count")
    cur.need(8 * n_dims, f"{what}: {n_dims} dimensions")
    dims = struct.unpack_from(f"{cur.order}{n_dims}Q", cur.buf, cur.off)
    cur.off += 8 * n_dims
    kind = cur.uint(cur.u32, f"{what}: type")
    offset = cur.uint(cur.u64, f"{what}: data offset")
    return name, dims, kind, offset


def _tensors(cur: _Cursor, infos, data_offset: int) -> dict[str, TensorInfo]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out: dict[str, TensorInfo] = {}
    for name, dims, kind, offset in infos:
        what = f"tensor {name!r}"
        if name in out:
            raise cur.fail(f"{what} appears twice")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise cur.fail(f"{what} has ggml type {kind}, which is not a ggml type") from None
        block, size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise cur.fail(f"{what} of {qtype.name} has shape {list(dims)}: {dims[0]} is not a multiple of {block}")
        n = int(np.prod(dims, dtype=object)) if dims else 1
        n_bytes = n // block * size
        start = data_offset + offset
        if start + n_bytes > cur.size:
            raise cur.fail(f"{what}: its {n_bytes} bytes of data at byte {start} run past the end of the file")
        out[name] = TensorInfo(name, qtype, tuple(dims), n, n_bytes, start)
    return out
