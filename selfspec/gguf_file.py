"""A GGUF file's header and its tensors' raw blocks, read directly.

The header (metadata, then one record per tensor: name, shape, block type, offset) is parsed
here rather than by `gguf.GGUFReader`, which builds a numpy view per item of every metadata
array: a 262k-token vocabulary made it the slowest part of a load. String arrays (the
vocabulary, merges) are skipped over, not decoded: the tokenizer is built from the file by
transformers, once (gguf_load.py). Tensor data is read with `os.pread`, a chunk of rows at a
time, into memory of its own: no mapping of the file stays resident while a model is laid out.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

from selfspec.errors import SelfSpecError

# metadata value types (the GGUF spec's numbering) -> struct format of one scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, skipped over: its length only."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. shape is numpy's order, [rows, cols] for a matrix (GGUF lists
    the dimensions innermost first); a row is cols values in whole blocks of its type."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute, in the file

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


class _Cursor:
    """Sequential little-endian reads over the header's bytes."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n])
        if len(s) != n:
            raise ValueError("truncated string")
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos = struct.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + unpack("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata type {vtype}")
        itype, count = self.scalar("<I"), self.scalar("<Q")
        if itype == _STRING:
            if count <= 64:  # small lists (tags, languages) are kept
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return StringArray(count)
        if itype not in _NUMPY:
            return [self.value(itype) for _ in range(count)]  # arrays of arrays: rare, small
        dt = np.dtype(_NUMPY[itype])
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += dt.itemsize * count
        return arr


class GGUFFile:
    """metadata: {key: value} (numbers, strings, numpy arrays, StringArray); tensors: {name:
    TensorInfo} in file order. read_rows gives a tensor's raw blocks, rows a..b-1."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._map: np.memmap | None = None  # the whole file, mapped read-only on first mapped_rows
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                self.size = len(mm)
                self._parse(mm)
        except (OSError, ValueError, struct.error, KeyError, OverflowError) as e:
            raise SelfSpecError(f"cannot read GGUF file {self.path}: {e}") from e

    def _parse(self, buf) -> None:
        c = _Cursor(buf)
        if c.scalar("<I") != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = c.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.scalar("<I"))
        records = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.scalar("<Q") for _ in range(c.scalar("<I"))]
            qtype, offset = c.scalar("<I"), c.scalar("<Q")
            records.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        self.data_offset = -(-c.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, offset in records:
            try:
                qt = GGMLQuantizationType(qtype)
            except ValueError:
                raise ValueError(f"tensor {name} has an unknown block type {qtype}") from None
            info = TensorInfo(name, qt, tuple(int(d) for d in reversed(dims)), self.data_offset + offset)
            if qt not in GGML_QUANT_SIZES or info.shape[-1] % GGML_QUANT_SIZES[qt][0]:
                raise ValueError(f"tensor {name}: rows of {info.shape[-1]} are not whole {qt.name} blocks")
            if info.offset + info.nbytes > self.size:
                raise ValueError(f"truncated: tensor {name} ends past the end of the file")
            self.tensors[name] = info

    def header_bytes(self) -> int:
        """Bytes before the tensor data (the metadata and tensor records)."""
        return self.data_offset

    def mapped_rows(self, info: TensorInfo) -> np.ndarray:
        """All the raw blocks of a tensor as a read-only view of the file mapped in memory:
        uint8 [rows, row_bytes]. The pages are the page cache's, faulted in as they are first read:
        no anonymous copy to fault in, which on a VM costs far more than mapping (benchmarks/RESULTS.md).
        The file must not change while the view lives."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[info.offset : info.offset + info.nbytes].reshape(info.rows, info.row_bytes)

    def drop_pages(self, info: TensorInfo, a: int = 0, b: int | None = None) -> None:
        """Let the kernel take back the pages of rows a..b-1 of a tensor's mapping (all of it by
        default) that this process holds: rows copied elsewhere (repacked) would count twice in
        the peak. The views stay valid; what reads them later faults back in from the page cache."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page, b = mmap.PAGESIZE, info.rows if b is None else b
        lo, hi = info.offset + a * info.row_bytes, info.offset + b * info.row_bytes
        lo, hi = -(-lo // page) * page, hi // page * page  # whole pages inside the rows
        if hi > lo:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def read_rows(self, info: TensorInfo, a: int, b: int) -> np.ndarray:
        """Raw blocks of rows a..b-1: uint8 [b - a, row_bytes], a copy of its own."""
        rb = info.row_bytes
        n = (b - a) * rb
        out = np.empty((b - a, rb), dtype=np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(out).cast("B")], info.offset + a * rb) if n else 0
        finally:
            os.close(fd)
        if got != n:
            raise SelfSpecError(f"cannot read GGUF file {self.path}: short read of {info.name}")
        return out
