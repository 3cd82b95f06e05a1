"""The `ATTENTION` library (csrc/paged_attention.cpp) and its Python bindings.

`paged_decode_attention` computes attention for decode rows (one query per sequence) straight
from the paged KV cache: each (row, kv head) task walks its own block table, reads every K and V
vector of its context exactly once, and keeps an online softmax with float32 accumulation. No
padded gather, no score matrix in memory. GQA/MQA/MHA, float32 or bfloat16 queries; float32,
bfloat16 or float16 caches, or int8 / float8 e4m3 caches with one scale per (kv head, slot)
(applied to the scores and the probabilities, not per element); any block size >= 1, any
head_dim. Code paths, picked at run time by CPU features: AVX-512 for head_dim <= 128, plus
vdpbf16ps dot products where the CPU has AVX512_BF16 and both q and the cache are bfloat16;
AVX2 + FMA (+ F16C) for any head_dim (and where AVX-512 does not fit); a portable scalar path
everywhere else. Rows are spread over torch's thread count with OpenMP (the libgomp torch
already loaded), longest first; each (row, kv head) is computed by one thread, so results do not
depend on the thread count. Rows of a prompt chunk (token rows: consecutive rows sharing a table,
context lengths growing, every position visible) are taken in blocks, one task per block x kv head
walking the shared keys once; each row still replays exactly its own task's operations, so a row's
output is bitwise what it gives alone, whatever its neighbours (tests/test_paged_attention_rows.py). `causal_prefill_attention`: a prompt chunk from position 0 over its
own keys (AVX-512 CPUs).
"""
from __future__ import annotations

import ctypes

import torch

from kvshare.model.kernels.build import KernelLibrary
from kvshare.model.kernels.build import describe as _desc

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_attention(lib: ctypes.CDLL) -> None:
    lib.kvs_cpu_paths.restype = _int
    lib.kvs_cpu_paths.argtypes = []
    f = lib.kvs_paged_decode_attention
    f.restype = _int
    f.argtypes = [_ptr, _i64, _i64, _int,  # q
                  _ptr, _i64, _i64, _ptr, _i64, _i64, _int,  # k, v, cache kind
                  _ptr, _i64, _ptr, _i64,  # k scales, v scales (null for float caches)
                  _ptr, _i64, _ptr,  # tables, max_blocks, context lengths
                  _ptr, _ptr,  # per-row sink end, window start (null: every position visible)
                  _ptr, _i64, _i64,  # out
                  _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_double,  # n, H, KVH, D, block_size, num_blocks, scale
                  _int, _int, ctypes.c_char_p, _i64]  # impl, threads, error buffer
    f = lib.kvs_causal_prefill_attention
    f.restype = _int
    f.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64,  # q, k, v, out and their position strides
                  _i64, _i64, _i64, _i64, ctypes.c_double,  # T, H, KVH, D, scale
                  _int, ctypes.c_char_p, _i64]  # threads, error buffer


ATTENTION = KernelLibrary("paged_attention", "paged_attention.cpp", _setup_attention)


# ---- the attention library's state, module level (kept for existing callers) ----------------
def available() -> bool:
    """Non-blocking: the paged-attention kernel is loaded and not disabled (see
    `KernelLibrary.available`: the first call loads a cached build or starts the build)."""
    return ATTENTION.available()


def wait_until_built(timeout: float | None = None) -> bool:
    """Blocking: build or load the paged-attention kernel; True when loaded."""
    return ATTENTION.wait_until_built(timeout)


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None when it is True."""
    return ATTENTION.unavailable_reason()


def build_seconds() -> float | None:
    """Wall time of the attention kernel's build (or of loading its cached build) in this process."""
    return ATTENTION.build_seconds()


def _lib() -> ctypes.CDLL:
    return ATTENTION.lib()


_IMPLS = {"auto": 0, "scalar": 1, "avx512": 2, "avx512bf16": 3, "avx2": 4}


def _paths(lib: ctypes.CDLL) -> list[str]:
    mask = lib.kvs_cpu_paths()
    return [name for name, bit in (("scalar", 1), ("avx2", 8), ("avx512", 2), ("avx512bf16", 4)) if mask & bit]


def cpu_paths() -> list[str]:
    """Code paths the kernel can run on this CPU, slowest first ("auto" uses the last):
    "scalar" always; "avx2" (AVX2 + FMA + F16C, any head_dim); "avx512" (AVX-512 F/BW/VL/DQ,
    head_dim <= 128, else it falls back to "avx2"); "avx512bf16" (also AVX512_BF16: used when
    both the cache and q are bfloat16)."""
    return _paths(_lib())


_DTYPES = (torch.float32, torch.bfloat16)
# Cache storage dtypes -> the kernel's cache_kind; int8 and float8 come with per-slot scales.
_CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_SCALED_KINDS = (3, 4)


def causal_prefill_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `causal_prefill_attention` takes these (v laid out as k): float32, head_dim % 64 ==
    0, contiguous heads and head_dim, an AVX-512 CPU (the library's avx512 path)."""
    return (q.dtype == torch.float32 and k.dtype == torch.float32 and q.shape[-1] % 64 == 0
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k))
            and "avx512" in cpu_paths())


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk from position 0 over its own keys: q [T, H, D], k and v
    [T, KVH, D] (H % KVH == 0, D % 64 == 0), float32, heads and head_dim contiguous (any position
    stride). Position t attends to keys 0 .. t. Returns [T, H, D] (into `out` when given: the
    same layout rules). Skips the hidden keys in tiles of 64 (torch's CPU SDPA computes them
    below 512 keys): csrc/paged_attention.cpp. Raises ValueError on bad arguments."""
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor [T, heads, D]; got {_desc(t)}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must have contiguous heads and head_dim; got strides {t.stride()}")
    n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or h % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, KVH, D] for q {tuple(q.shape)}")
    if out is None:
        out = torch.empty(n, h, d)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}; got {tuple(out.shape)}")
    err = ctypes.create_string_buffer(256)
    rc = _lib().kvs_causal_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                             v.stride(0), out.data_ptr(), out.stride(0), n, h, k.shape[1], d,
                                             scale, torch.get_num_threads(), err, len(err))
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, *, out: torch.Tensor | None = None, impl: str = "auto",
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           sink_end: torch.Tensor | None = None,
                           window_start: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per row over that row's paged context.

    q [n, H, D]; k_cache, v_cache [KVH, num_blocks * block_size, D] (H % KVH == 0); block_tables
    [n, max_blocks] (int64 or int32; entries past a row's last needed block are never read, nor
    checked); context_lens [n]: row r attends to positions 0 .. context_lens[r] - 1, position p
    living in slot block_tables[r, p // block_size] * block_size + p % block_size. Returns
    [n, H, D] in q's dtype (written into `out` when given). float32 or bfloat16 q; float32,
    bfloat16 or float16 caches, or int8 / float8_e4m3fn caches with float32 `k_scale`, `v_scale`
    [KVH, slots] (stored value x its slot's scale); float32 math. `impl` forces one of
    `cpu_paths()` (for tests).
    Bounded-KV policies pass `sink_end` and `window_start` ([n] integers, both or either): row r
    then sees positions [0, sink_end[r]) and [window_start[r], context_lens[r]) only (a sliding
    window: sink_end 0; attention sinks: the sinks, then the recent window); table entries of
    blocks wholly between the two are never read, nor checked.
    Raises ValueError on inconsistent inputs or a block id outside the cache.
    """
    lib = ATTENTION.lib()
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [n, H, D] and caches [KVH, slots, D]; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    n, heads, dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    if k_cache.shape[2] != dim or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head_dim must match "
                         f"and heads must be a multiple of kv_heads")
    if q.dtype not in _DTYPES or k_cache.dtype not in _CACHE_KINDS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; want q float32 "
                         f"or bfloat16, caches one of {sorted(str(d) for d in _CACHE_KINDS)}, k and v alike")
    kind = _CACHE_KINDS[k_cache.dtype]
    if kind in _SCALED_KINDS:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or tuple(sc.shape) != (kv_heads, slots) or sc.dtype != torch.float32:
                raise ValueError(f"{k_cache.dtype} caches need {name} float32 [{kv_heads}, {slots}]; got "
                                 f"{None if sc is None else (tuple(sc.shape), sc.dtype)}")
        k_scale = k_scale if k_scale.stride(1) == 1 else k_scale.contiguous()
        v_scale = v_scale if v_scale.stride(1) == 1 else v_scale.contiguous()
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{k_cache.dtype} caches take no scales")
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("CPU tensors only")
    block_size = int(block_size)
    if block_size < 1 or slots % block_size:
        raise ValueError(f"block_size={block_size} must be >= 1 and divide the cache's {slots} slots")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or tuple(context_lens.shape) != (n,):
        raise ValueError(f"want block_tables [n, max_blocks] and context_lens [n] for n={n}; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if block_tables.is_floating_point() or context_lens.is_floating_point():
        raise ValueError("block_tables and context_lens must be integer tensors")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(2) != 1:
        v_cache = v_cache.contiguous()
    tables = block_tables.to(device="cpu", dtype=torch.int64).contiguous()
    ctx = context_lens.to(device="cpu", dtype=torch.int64).contiguous()
    ranges = []
    for name, r in (("sink_end", sink_end), ("window_start", window_start)):
        if r is not None and (tuple(r.shape) != (n,) or r.is_floating_point()):
            raise ValueError(f"{name} must be an integer tensor [{n}]; got {_desc(r)}")
        ranges.append(None if r is None else r.to(device="cpu", dtype=torch.int64).contiguous())
    if out is None:
        out = torch.empty(n, heads, dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device.type != "cpu" or out.stride(2) != 1:
        raise ValueError("out must be a CPU tensor shaped and typed like q, with unit last stride")
    if n == 0:
        return out
    err = ctypes.create_string_buffer(256)
    rc = lib.kvs_paged_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), q.dtype == torch.bfloat16,
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), kind,
        k_scale.data_ptr() if k_scale is not None else None, k_scale.stride(0) if k_scale is not None else 0,
        v_scale.data_ptr() if v_scale is not None else None, v_scale.stride(0) if v_scale is not None else 0,
        tables.data_ptr(), tables.shape[1], ctx.data_ptr(),
        *(None if r is None else r.data_ptr() for r in ranges),
        out.data_ptr(), out.stride(0), out.stride(1),
        n, heads, kv_heads, dim, block_size, slots // block_size, float(scale),
        _IMPLS[impl], torch.get_num_threads(), err, len(err))
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out
