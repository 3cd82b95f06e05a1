"""The `DECODE` library: qmatmul.cpp + paged_attention.cpp + shm_collectives.cpp +
csrc/decode_step.cpp, one translation unit. `kvs_decode_layers` runs every layer of a decode-only
step in one call on the matmul and attention kernels (kvshare/model/fused_decode.py says when it
applies and builds its arguments), with tensor parallelism's all-reduces between them when it is
given the ranks' shared memory."""
from __future__ import annotations

import ctypes

from kvshare.model.kernels.build import KernelLibrary

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_decode(lib: ctypes.CDLL) -> None:
    f = lib.kvs_decode_layers
    f.restype = _int
    f.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr,  # model, h, M, cos, signed sin
                  _ptr,  # each layer's view of the rows (slots, tables, context lengths, windows)
                  _int, ctypes.c_char_p, _i64]  # threads, error buffer


DECODE = KernelLibrary("decode_step", ("qmatmul.cpp", "paged_attention.cpp", "shm_collectives.cpp", "decode_step.cpp"),
                       _setup_decode)
