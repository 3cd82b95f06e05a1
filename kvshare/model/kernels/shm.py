"""The `SHM` library (csrc/shm_collectives.cpp): all-reduce and flag waits between
tensor-parallel ranks through a shared memory segment (kvshare/model/tp_transport.py). Linux only
(futex)."""
from __future__ import annotations

import ctypes

from kvshare.model.kernels.build import KernelLibrary

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_shm(lib: ctypes.CDLL) -> None:
    lib.kvs_shm_post.restype = None
    lib.kvs_shm_post.argtypes = [_ptr, _i64, ctypes.c_uint32]  # flags, rank, seq
    lib.kvs_shm_wait_all.restype = _i64
    lib.kvs_shm_wait_all.argtypes = [_ptr, _i64, ctypes.c_uint32, ctypes.c_double, _i64]  # + spin_us, timeout_ms
    lib.kvs_shm_allreduce_comm.restype = _int
    lib.kvs_shm_allreduce_comm.argtypes = [_ptr, _ptr, _i64, _int, ctypes.c_char_p, _i64]  # comm, x, n, bf16?, error


SHM = KernelLibrary("shm_collectives", "shm_collectives.cpp", _setup_shm)
