"""A GGUF file read through one memory map: metadata, the tensor table, and raw tensor bytes.

gguf's GGUFReader builds numpy/Python objects for every element of every metadata array (the
tokenizer's vocabulary and merges make that ~6 s for a small model) and slices every tensor up
front. This reader walks the header once with `struct.unpack_from` over the map, decodes
numeric arrays with one numpy call each, and hands out tensor data as zero-copy views of the
map, so nothing is read from disk until a tensor is used.

`read_gguf_header(path)` (for planning, `kvshare memory`) skips arrays longer than `MAX_ARRAY`
without decoding them; `open_gguf_file(path)` reads the whole header and maps the tensors. Every
caller reads GGUF files through these two (the loader, the tokenizer's metadata, the memory
planner), so each check on a corrupt file (alignment, nesting, extents) is made in one place.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvshare.model.load_error import ModelLoadError

MAX_ARRAY = 1024  # read_gguf_header skips longer metadata arrays (vocabularies, merges, scores)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# Arrays of arrays nest at most this deep (llama.cpp reads none): deeper is a corrupt or hostile
# file, refused before the walk recurses past Python's stack.
MAX_ARRAY_DEPTH = 8


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # as stored: innermost dimension first, like GGUFReader's tensor.shape
    type_id: int
    offset: int = 0  # of its data, from the start of the file
    nbytes: int = 0
    data: np.ndarray | None = None  # raw bytes (uint8) as a view of the map; None when not mapped

    @property
    def tensor_type(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.type_id)

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """Row-major shape (outermost first), the HF orientation."""
        return tuple(int(d) for d in reversed(self.shape))


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]  # read_gguf_header: skipped arrays are absent
    tensors: list[TensorInfo]
    path: str = ""

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


class _Walker:
    def __init__(self, buf, path: str, max_array: int | None) -> None:
        self.buf, self.path, self.pos, self.max_array = buf, path, 0, max_array

    def _short(self) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is truncated or corrupt: the GGUF header ends early.")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self._short()
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise self._short()
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int, key: str, depth: int = 0) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            if depth == MAX_ARRAY_DEPTH:
                raise ModelLoadError(f"{self.path}: GGUF metadata {key!r} nests arrays more than {MAX_ARRAY_DEPTH} "
                                     "deep; the file is corrupt.")
            elem, count = self.take("<I"), self.take("<Q")
            skip = self.max_array is not None and count > self.max_array
            if elem in _NUMPY:
                dt = np.dtype(_NUMPY[elem])
                end = self.pos + dt.itemsize * count
                if end > len(self.buf):
                    raise self._short()
                out = None if skip else np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos = end
                return out
            if elem == _STRING:
                if skip:
                    for _ in range(count):
                        n = self.take("<Q")
                        self.pos += n
                    if self.pos > len(self.buf):
                        raise self._short()
                    return None
                return [self.string() for _ in range(count)]
            items = [self.value(elem, key, depth + 1) for _ in range(count)]
            return None if skip else items
        if type_id not in _SCALARS:
            raise ModelLoadError(f"{self.path}: GGUF metadata {key!r} has unknown type {type_id}; the file is corrupt.")
        return self.take(_SCALARS[type_id])


def _tensor_nbytes(path: str, name: str, shape: list[int], type_id: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{path}: tensor {name!r} has GGUF type id {type_id}, which kvshare does not know.") from None
    count = 1
    for d in shape:
        count *= int(d)
    if shape and int(shape[0]) % block:
        raise ModelLoadError(f"{path}: tensor {name!r} rows of {shape[0]} do not fill whole {block}-weight blocks.")
    return count // block * type_size


def _parse(buf, path: str, max_array: int | None, file_size: int) -> GGUFHeader:
    w = _Walker(buf, path, max_array)
    if len(buf) < 4 or bytes(buf[:4]) != b"GGUF":
        start = bytes(buf[:4])
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {start!r}, expected b'GGUF').")
    w.pos = 4
    version = w.take("<I")
    if version > 0xFFFF:
        raise ModelLoadError(f"{path} is a big-endian GGUF file, which kvshare cannot read.")
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or later).")
    n_tensors, n_kv = w.take("<Q"), w.take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = w.string()
        value = w.value(w.take("<I"), key)
        if value is not None:
            meta[key] = value
    tensors = []
    for _ in range(n_tensors):
        name = w.string()
        shape = [w.take("<Q") for _ in range(w.take("<I"))]
        type_id = w.take("<I")
        offset = w.take("<Q")
        tensors.append(TensorInfo(name, shape, type_id, offset, _tensor_nbytes(path, name, shape, type_id)))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise ModelLoadError(f"{path}: GGUF metadata 'general.alignment' is {align!r}; it must be a power of two "
                             f"(the default is {DEFAULT_ALIGNMENT}), so the file is corrupt.")
    data_start = -(-w.pos // align) * align
    for t in tensors:
        t.offset += data_start
        end = t.offset + t.nbytes
        if end > file_size:
            raise ModelLoadError(
                f"{path} is truncated or corrupt: tensor {t.name!r} needs bytes up to {end} but the file "
                f"has {file_size} bytes.")
    return GGUFHeader(meta, tensors, path)


def _check_single_file(header: GGUFHeader) -> None:
    parts = header.metadata.get("split.count")
    if parts is not None and int(parts) > 1:
        raise ModelLoadError(
            f"{header.path} is one part of a {int(parts)}-file split GGUF; kvshare needs a single file "
            f"(merge the parts with llama.cpp's `llama-gguf-split --merge`).")


def read_gguf_header(path: str) -> GGUFHeader:
    """Metadata (arrays longer than MAX_ARRAY left out) and the tensor table; no tensor data."""
    size = os.path.getsize(path)
    if size == 0:
        raise ModelLoadError(f"{path} is not a GGUF file (it is empty).")
    header = _parse(np.memmap(path, dtype=np.uint8, mode="r"), path, MAX_ARRAY, size)
    _check_single_file(header)
    return header


def open_gguf_file(path: str) -> GGUFHeader:
    """The whole header, and each tensor's `data` as a read-only uint8 view of a memory map
    (pages are read from disk, or the page cache, only when the tensor is used)."""
    size = os.path.getsize(path)
    if size == 0:
        raise ModelLoadError(f"{path} is not a GGUF file (it is empty).")
    # The header (100k vocabulary strings for a small model) is walked over a plain mmap, whose
    # slices are cheap bytes; numpy's memmap slicing costs microseconds per string.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        header = _parse(m, path, None, size)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    _check_single_file(header)
    for t in header.tensors:
        t.data = mapped[t.offset:t.offset + t.nbytes]
    return header
