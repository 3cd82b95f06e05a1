"""The `DECODE` library: qmatmul.cpp + paged_attention.cpp + shm_collectives.cpp +
csrc/decode_step.cpp, one translation unit. `kvs_decode_layers` runs every layer of a decode-only
step in one call on the matmul and attention kernels (kvshare/model/fused_decode.py says when it
applies and builds its arguments), with tensor parallelism's all-reduces between them when it is
given the ranks' shared memory, and LoRA adapters' deltas on the rows that use one;
`kvs_lora_apply` is that delta for one linear's rows on the step-by-step path
(kvshare/model/lora.py)."""
from __future__ import annotations

import ctypes

from kvshare.model.kernels.build import KernelLibrary

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_decode(lib: ctypes.CDLL) -> None:
    f = lib.kvs_decode_layers
    f.restype = _int
    f.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr,  # model, h, M, cos, signed sin
                  _ptr,  # each layer's view of the rows (slots, tables, context lengths, windows)
                  _ptr,  # the rows' LoRA adapters (kvshare.model.lora), or None
                  _int, ctypes.c_char_p, _i64]  # threads, error buffer
    f = lib.kvs_lora_apply
    f.restype = _int
    f.argtypes = [_ptr, _i64, _i64, _i64,  # adapters, layers, layer, the site's first module
                  _ptr, _i64,  # the site's modules' widths, their count
                  _ptr, _i64, _ptr, _i64, _i64,  # x [M, K], K, y [M, N], N, M
                  _int, _int, _int, ctypes.c_char_p, _i64]  # bfloat16, portable, threads, error buffer


DECODE = KernelLibrary("decode_step", ("qmatmul.cpp", "paged_attention.cpp", "shm_collectives.cpp", "decode_step.cpp"),
                       _setup_decode)
