"""A GGUF file's metadata and tensor shapes, read from the header alone.

For planning (`kvshare memory`): gguf's GGUFReader builds Python objects for every element of
every metadata array, and the tokenizer's vocabulary and merges make that seconds for a small
model. This reader walks the same header, skips arrays of more than `MAX_ARRAY` elements
without decoding them, and never touches tensor data.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from kvshare.model.loader import ModelLoadError

MAX_ARRAY = 1024  # longer metadata arrays (vocabularies, merges, scores) are skipped
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # as stored: innermost dimension first, like GGUFReader's tensor.shape
    type_id: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]  # skipped arrays are absent
    tensors: list[TensorInfo]


class _Reader:
    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f, self.path = f, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise ModelLoadError(f"{self.path} is truncated or corrupt: the GGUF header ends early.")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.f.read(n)
        if len(raw) != n:
            raise ModelLoadError(f"{self.path} is truncated or corrupt: the GGUF header ends early.")
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            elem, count = self.take("<I"), self.take("<Q")
            if count > MAX_ARRAY:
                self.skip_array(elem, count)
                return None
            return [self.value(elem) for _ in range(count)]
        if type_id not in _SCALARS:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata type {type_id}; the file is corrupt.")
        return self.take(_SCALARS[type_id])

    def skip_array(self, elem: int, count: int) -> None:
        if elem in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[elem]) * count, 1)
        elif elem == _STRING:
            for _ in range(count):
                self.f.seek(self.take("<Q"), 1)
        else:
            for _ in range(count):
                self.value(elem)


def read_gguf_header(path: str) -> GGUFHeader:
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file.")
        version = r.take("<I")
        if version < 2:
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or later).")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            value = r.value(r.take("<I"))
            if value is not None:
                meta[key] = value
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            shape = [r.take("<Q") for _ in range(r.take("<I"))]
            type_id = r.take("<I")
            r.take("<Q")  # data offset: not needed
            tensors.append(TensorInfo(name, shape, type_id))
    return GGUFHeader(meta, tensors)
