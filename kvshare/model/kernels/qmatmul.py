"""The `QMATMUL` library (csrc/qmatmul.cpp) and its Python bindings.

`int8_group_matmul` / `int4_group_matmul`: x [M, K] times a group-quantized weight [N, K] of int8
codes, or of 4-bit codes packed two per byte (`pack_int4_rows`), with one float32 scale, and
optionally a zero, per group of K; for small M. On AVX-512 VNNI CPUs weights can be kept in VNNI
blocks (`to_vnni_blocks`, `VnniBlocks.matmul`): x rounded to int16 per group, exact int32 group
sums. `group_dequantize` fills a dense copy (the prefill scratch) in one pass.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvshare.model.kernels.build import KernelLibrary, disabled_by_env
from kvshare.model.kernels.build import describe as _desc

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _setup_qmatmul(lib: ctypes.CDLL) -> None:
    lib.kvs_qmm_cpu_paths.restype = _int
    lib.kvs_qmm_cpu_paths.argtypes = []
    for f in (lib.kvs_int8_group_matmul, lib.kvs_int4_group_matmul, lib.kvs_nl4_group_matmul,
              lib.kvs_i6_group_matmul, lib.kvs_i5_group_matmul, lib.kvs_i5s_group_matmul):
        f.restype = _int
        f.argtypes = [_ptr, _i64, _int,  # x, its row stride, bf16?
                      _ptr, _ptr, _ptr,  # q (int8, or packed 4-bit), scales, zeros (null: none)
                      _ptr, _i64,  # y, its row stride
                      _i64, _i64, _i64, _i64,  # M, N, K, group_size
                      _int, _int, ctypes.c_char_p, _i64,  # impl, threads, error buffer
                      _int, ctypes.c_float]  # weight layout (_LAYOUT_*), zeros = scales x this (or 0)
    f = lib.kvs_group_dequantize
    f.restype = _int
    f.argtypes = [_ptr, _int, _ptr, _ptr, _ptr, _int,  # q, codes (_CODES_*), scales, zeros, out, out bf16?
                  _i64, _i64, _i64, _int, _int, ctypes.c_float]  # N, K, group_size, threads, layout, zero_mul
    lib.kvs_qmm_vnni_blocks_fit.restype = _int
    lib.kvs_qmm_vnni_blocks_fit.argtypes = [_i64, _i64]
    f = lib.kvs_gguf_repack
    f.restype = _int
    f.argtypes = [_ptr, _i64, _i64, _int,  # row addresses, rows, first output row, ggml type
                  _i64, _i64, _int, _int,  # N, K, 4-bit packed?, layout (0 rows, 1 VNNI, 2 compact, 3 half)
                  _ptr, _ptr, _ptr, _int,  # q, scales, zeros (null: none), threads
                  _int, ctypes.c_char_p, _i64]  # impl (0 the CPU's fastest, 1 scalar), error buffer


# gguf_repack.cpp turns GGUF blocks into these kernels' layouts (`repack_gguf_rows`).
QMATMUL = KernelLibrary("qmatmul", ("qmatmul.cpp", "gguf_repack.cpp"), _setup_qmatmul)


# qmatmul.cpp's weight layouts: rows, VNNI blocks, VNNI blocks with compact scales and zeros, VNNI
# blocks with float16 scales and zeros.
_LAYOUT_ROWS, _LAYOUT_BLOCKS, _LAYOUT_COMPACT, _LAYOUT_HALF = 0, 1, 2, 3
# kvs_group_dequantize's codes: int8, 4-bit, 4-bit indices into the IQ4_NL table (qmatmul.cpp NL4),
# Q6_K's planes (I6), the 5-bit planes of unsigned codes (I5: Q5_1, Q5_K) and of Q5_0's signed ones (I5S).
_CODES_INT8, _CODES_INT4, _CODES_IQ4NL, _CODES_PLANES6, _CODES_PLANES5, _CODES_PLANES5_SIGNED = 0, 1, 2, 3, 4, 5
# IQ4_NL / IQ4_XS's table (ggml's kvalues_iq4nl; qmatmul.cpp kNl4Values): a 4-bit index's code.
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_XS_GGML_TYPE = 23
# The 5-bit formats whose codes can be kept as a 4-bit and a 1-bit plane (VnniBlocks.planes5):
# Q5_0 (signed codes -16..15), Q5_1 and Q5_K (0..31).
Q5_0_GGML_TYPE = 6
PLANES5_GGML_TYPES = frozenset({Q5_0_GGML_TYPE, 7, 13})
# Compact scales (qmatmul.cpp kLayoutCompact): a float16 base per super-block of this many weights
# times an int8 code per group. GGUF types whose scales take that form (ggml type ids): Q2_K, Q3_K,
# Q4_K, Q5_K, Q6_K, IQ4_XS.
COMPACT_SUPER_BLOCK = 256
COMPACT_GGML_TYPES = frozenset({10, 11, 12, 13, 14, 23})
# Float16 scales (qmatmul.cpp kLayoutHalf): the types whose scale (and offset) is one float16 per
# group of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Q4_0's zero is -8 x its scale (no zeros array).
HALF_GGML_TYPES = frozenset({2, 3, 6, 7, 8})
Q4_0_ZERO_MUL = -8.0

_QMM_IMPLS = {"auto": 0, "scalar": 1, "avx512": 2, "avx2": 3, "avx512-vnni": 4}


def qmatmul_paths() -> list[str]:
    """Code paths `int8_group_matmul` and `int4_group_matmul` can run on this CPU, slowest first
    ("auto" uses the last one for rows that fits the group size): "scalar" always (any group size);
    "avx2" (AVX2 + FMA; group_size % 8 == 0 for int8, % 16 for int4); "avx512" (AVX-512
    F/BW/VL/DQ; group_size % 16 == 0 for int8, % 32 for int4); "avx512-vnni" (AVX-512 VNNI),
    which reads weights in VNNI blocks only (`VnniBlocks.matmul`), never weights in rows."""
    mask = QMATMUL.lib().kvs_qmm_cpu_paths()
    return [name for name, bit in (("scalar", 1), ("avx2", 4), ("avx512", 2), ("avx512-vnni", 8)) if mask & bit]


def int8_group_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_size: int, out: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """y = x @ w.T for a group-quantized weight w[n, k] = q[n, k] * scales[n, k // g]
    (+ zeros[n, k // g]), g = group_size, with float32 accumulation.

    x [M, K] float32 or bfloat16 (unit last stride, any row stride); q int8 [N, K], scales and
    zeros float32 [N, K // g], contiguous; K % g == 0. Returns [M, N] in x's dtype (written into
    `out` when given: [M, N], x's dtype, unit last stride). Made for small M (decode batches).
    The AVX-512 path takes g % 16 == 0 (16, 32, 64, ...), AVX2 g % 8 == 0, the scalar path any
    g; `impl` forces one of `qmatmul_paths()` but "avx512-vnni", which reads VNNI blocks only
    (for tests; a vector path that does not fit g falls back to the next one that does). Blocks until the library is built if it is not yet
    (check `QMATMUL.available()` first on a serving path). Raises ValueError on bad arguments.
    """
    _check_x(x)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor [N, K]; got {_desc(q)}")
    if q.shape[1] != x.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit x {tuple(x.shape)}: want q [N, {x.shape[1]}]")
    return _group_matmul("kvs_int8_group_matmul", x, "q", q, scales, zeros, group_size, out, impl)


def int4_group_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_size: int, out: torch.Tensor | None = None, *, impl: str = "auto") -> torch.Tensor:
    """y = x @ w.T for a group-quantized 4-bit weight w[n, k] = q[n, k] * scales[n, k // g]
    (+ zeros[n, k // g]), g = group_size, unsigned codes q in 0..15, float32 accumulation.

    Layout of `packed`: uint8 [N, K // 2], contiguous (K even), two codes per byte, in order
    along the row: byte j of row n holds q[n, 2j] in its low nibble (bits 0..3) and q[n, 2j + 1]
    in its high nibble (bits 4..7), i.e. packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4
    (`pack_int4_rows(q)` builds it, `unpack_int4_rows` inverts it). Read as a little-endian
    stream of 4-bit fields, code k is field k of the row. This is not GGUF's Q4_0 / Q4_1 block
    order (there a 32-code block's 16 bytes hold codes 0..15 in the low nibbles and 16..31 in
    the high ones): repack GGUF codes with `pack_int4_rows(unpacked codes)`. (The vector paths
    widen one byte per int32 lane and multiply the low and high nibbles by x's even and odd
    columns, from a copy of x reordered once per call, so this layout costs them nothing.)

    Everything else as `int8_group_matmul`: x [M, K] float32 or bfloat16 (unit last stride, any
    row stride), scales and zeros float32 [N, K // g] contiguous, K % g == 0; returns [M, N] in
    x's dtype (or writes `out`); float32 accumulation; a row's result does not depend on the
    other rows, the thread count or N. The AVX-512 path takes g % 32 == 0, AVX2 g % 16 == 0
    (every GGUF 4-bit format's g = 32 runs on both), the scalar path any g dividing K; `impl`
    forces one of `qmatmul_paths()` but "avx512-vnni" (a vector path that does not fit g falls
    back to the next one that does). Zeros are folded into each dequantized weight (one fma), as in the int8
    kernel. Blocks until the library is built. Raises ValueError on bad arguments, naming the
    argument.
    """
    _check_x(x)
    k = x.shape[1]
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [N, K // 2]; got {_desc(packed)}")
    if k % 2:
        raise ValueError(f"x has K={k} columns: packed 4-bit rows need an even K")
    if packed.shape[1] * 2 != k:
        raise ValueError(f"packed {tuple(packed.shape)} does not fit x {tuple(x.shape)}: want packed [N, {k // 2}]")
    return _group_matmul("kvs_int4_group_matmul", x, "packed", packed, scales, zeros, group_size, out, impl)


def group_dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     out: torch.Tensor, int4: bool) -> torch.Tensor:
    """The dense weights of int8 codes q [N, K] (int4=False) or packed 4-bit codes [N, K // 2]
    (int4=True), written into `out` [N, K] (float32 or bfloat16, contiguous): q * scale + zero
    per group in float32, rounded once to out's dtype. Returns out."""
    if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous() or out.dim() != 2:
        raise ValueError(f"out must be a contiguous float32 or bfloat16 [N, K] tensor; got {_desc(out)}")
    n, k = out.shape
    want = (n, k // 2) if int4 else (n, k)
    if tuple(q.shape) != want or q.dtype != (torch.uint8 if int4 else torch.int8) or not q.is_contiguous():
        raise ValueError(f"q must be contiguous {'uint8' if int4 else 'int8'} {list(want)}; got {_desc(q)}")
    if k % group_size or tuple(scales.shape) != (n, k // group_size) or scales.dtype != torch.float32 \
            or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float32 [{n}, {k // group_size}]; got {_desc(scales)}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.float32 or not zeros.is_contiguous()):
        raise ValueError(f"zeros must be None or like scales; got {_desc(zeros)}")
    QMATMUL.lib().kvs_group_dequantize(q.data_ptr(), int(int4), scales.data_ptr(),
                                       zeros.data_ptr() if zeros is not None else None, out.data_ptr(),
                                       int(out.dtype == torch.bfloat16), n, k, group_size, torch.get_num_threads(),
                                       _LAYOUT_ROWS, 0.0)
    return out


# ---- weights in VNNI blocks (the avx512-vnni path) ----------------------------------------------
_VNNI_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma"})


def vnni_blocks_fit(n: int, k: int, group_size: int) -> bool:
    """Whether a group-quantized weight [N, K] can be kept in VNNI blocks here: N a multiple of 16,
    a group size in 8..256 that is a multiple of 8 and divides K, and a kernel library that runs
    the avx512-vnni path (asked when it is loaded; before that, /proc/cpuinfo's flags answer, so
    loading never waits for a build, and GroupInt8Linear.check_blocks settles it once the library
    is there). Off where the C++ kernels are disabled."""
    from kvshare.config import cpu_flags

    if disabled_by_env() or n <= 0 or n % 16 or not 8 <= group_size <= 256 or group_size % 8 or k % group_size:
        return False
    if QMATMUL.available():
        return bool(QMATMUL.lib().kvs_qmm_vnni_blocks_fit(k, group_size))
    return _VNNI_CPU_FLAGS <= cpu_flags()


@dataclass(frozen=True, eq=False)
class VnniBlocks:
    """A group-quantized weight [N, K] (int8 codes, or 4-bit codes packed two per byte) in the
    layout the avx512-vnni path reads (qmatmul.cpp, "VNNI blocks"): rows in blocks of 16, each
    block as 64-byte lines of 4 bytes from each of its rows: q [N / 16, row_bytes / 4, 16, 4];
    scales and zeros float32 [N / 16, K / g, 16] (scale_form "full"), or, for weights repacked
    from a GGUF file, as the file has them (the same float32 values): "compact" (K-quants:
    qmatmul.cpp kLayoutCompact) uint8 [N / 16, cs] holding per block int8 codes [K / g, 16] and
    float16 bases [K / 256, 16], scale = base * code; "half" (Q4_0, Q8_0, ...: kLayoutHalf)
    uint8 [N / 16, 32 K / g], float16 [K / g, 16] per block, and with zero_mul != 0 no zeros
    array (Q4_0: zero = -8 x scale). iq4nl (with int4): the 4-bit fields are indices into the
    IQ4_NL table (IQ4_XS; IQ4NL_VALUES), whose values are the codes: the same results as the
    weight with those values as int8 codes, at half the bytes. Built by `to_vnni_blocks` or
    `repack_gguf_rows`; `rows` reads rows back (iq4nl: the indices, packed). planes6 (Q6_K, int4
    False): each code + 32 as a 4-bit plane (K / 8 lines, packed as int4 codes are) and a 2-bit
    plane (K / 16 lines) per block, q [N / 16, 3 K / 16, 16, 4]: the int8 codes' results at 0.75
    bytes per code (qmatmul.cpp I6); `rows` gives the int8 codes. planes5 (Q5_0 / Q5_1 / Q5_K, int4
    False): each code's low 4 bits as a 4-bit plane (K / 8 lines) and its fifth bit as a 1-bit
    plane (K / 32 lines), q [N / 16, 5 K / 32, 16, 4]: the int8 codes' results at 0.625 bytes per
    code (qmatmul.cpp I5; planes5_signed, Q5_0: I5S, the fifth bit the sign of codes -16..15);
    `rows` gives the int8 codes."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group: int
    int4: bool
    scale_form: str = "full"
    zero_mul: float = 0.0
    iq4nl: bool = False
    planes6: bool = False
    planes5: bool = False
    planes5_signed: bool = False

    @property
    def layout(self) -> int:
        return {"full": _LAYOUT_BLOCKS, "compact": _LAYOUT_COMPACT, "half": _LAYOUT_HALF}[self.scale_form]

    def _expanded(self, t: torch.Tensor) -> torch.Tensor:
        """Compact or float16 scales or zeros as the full layout's float32 [N / 16, K / g, 16]."""
        groups = self.k // self.group
        if self.scale_form == "half":
            return t.contiguous().view(torch.float16).float().reshape(-1, groups, 16)
        codes = t[:, :16 * groups].view(torch.int8).reshape(-1, groups, 16).float()
        bases = t[:, 16 * groups:].contiguous().view(torch.float16).float().reshape(-1, self.k // COMPACT_SUPER_BLOCK, 16)
        return codes * bases.repeat_interleave(COMPACT_SUPER_BLOCK // self.group, dim=1)

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The codes (int8 [R, K] or packed uint8 [R, K / 2]), scales and zeros [R, K / g] of rows
        idx (a long tensor), in row layout."""
        b, r = idx // 16, idx % 16
        q = self.q[b, :, r, :]
        if self.planes6:
            q = _planes6_codes(q, self.k)
        elif self.planes5:
            q = _planes5_codes(q, self.k, self.planes5_signed)
        elif self.int4:
            q = _u4_lanes(q, to_blocks=False)
        if self.scale_form == "full":
            return q.reshape(len(idx), -1), self.scales[b, :, r], None if self.zeros is None else self.zeros[b, :, r]
        # (only the blocks the rows are in: an embedding looks up a few rows of a large table)
        scales = self._expanded(self.scales[b])[torch.arange(len(idx)), :, r]
        if self.zeros is not None:
            zeros = self._expanded(self.zeros[b])[torch.arange(len(idx)), :, r]
        else:
            zeros = scales * self.zero_mul if self.zero_mul else None
        return q.reshape(len(idx), -1), scales, zeros

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ w.T on the avx512-vnni path (x rounded to int16 per row and group, exact int32
        group sums): x [M, K] float32 or bfloat16, unit last stride; y [M, N] in x's dtype."""
        _check_x(x)
        if x.shape[1] != self.k:
            raise ValueError(f"x {tuple(x.shape)} does not fit a weight of K={self.k}")
        if x.stride(1) != 1 and self.k > 1:
            raise ValueError(f"x must have contiguous rows (unit last stride); got strides {x.stride()}")
        return _call_group_matmul(self._matmul_fn, x, self.q, self.scales, self.zeros, self.n, self.group, out, "auto",
                                  layout=self.layout, zero_mul=self.zero_mul)

    @property
    def _matmul_fn(self) -> str:
        if self.planes5:
            return "kvs_i5s_group_matmul" if self.planes5_signed else "kvs_i5_group_matmul"
        if self.planes6:
            return "kvs_i6_group_matmul"
        return "kvs_nl4_group_matmul" if self.iq4nl else "kvs_int4_group_matmul" if self.int4 else "kvs_int8_group_matmul"

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The dense weights into out [N, K] (float32 or bfloat16, contiguous), the values
        `group_dequantize` gives for the same weight in rows."""
        if out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous() \
                or tuple(out.shape) != (self.n, self.k):
            raise ValueError(f"out must be a contiguous float32 or bfloat16 [{self.n}, {self.k}] tensor; "
                             f"got {_desc(out)}")
        QMATMUL.lib().kvs_group_dequantize(
            self.q.data_ptr(), self._codes_kind, self.scales.data_ptr(),
            self.zeros.data_ptr() if self.zeros is not None else None, out.data_ptr(),
            int(out.dtype == torch.bfloat16), self.n, self.k, self.group, torch.get_num_threads(), self.layout,
            self.zero_mul)
        return out

    @property
    def _codes_kind(self) -> int:
        """kvs_group_dequantize's codes argument (_CODES_*) for this weight's codes."""
        if self.planes5:
            return _CODES_PLANES5_SIGNED if self.planes5_signed else _CODES_PLANES5
        if self.planes6:
            return _CODES_PLANES6
        return _CODES_IQ4NL if self.iq4nl else int(self.int4)


def to_vnni_blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   int4: bool) -> VnniBlocks:
    """A weight in rows (q int8 [N, K], or packed 4-bit uint8 [N, K / 2] with int4; scales and
    zeros float32 [N, K / g]) copied into VNNI blocks. N % 16 == 0 and the row's bytes % 4 == 0."""
    n, row_bytes = q.shape
    k = row_bytes * (2 if int4 else 1)
    if n % 16 or row_bytes % 4:
        raise ValueError(f"VNNI blocks need N % 16 == 0 and a multiple of 4 bytes per row; got q {tuple(q.shape)}")
    if not 8 <= group_size <= 256 or group_size % 8 or k % group_size:
        raise ValueError(f"VNNI blocks need a group size in 8..256, a multiple of 8 dividing K={k}; got {group_size}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and tuple(t.shape) != (n, k // group_size):
            raise ValueError(f"{name} must be [{n}, {k // group_size}] (N, K // group_size); got {_desc(t)}")

    def blocked(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N / 16, G, 16]
        return t.reshape(n // 16, 16, -1).transpose(1, 2).contiguous()

    qb = q.reshape(n // 16, 16, row_bytes // 4, 4).permute(0, 2, 1, 3).contiguous()
    if int4:  # each 4-byte lane's codes rearranged for the kernel's 2-op pair extraction
        qb = _u4_lanes(qb, to_blocks=True)
    return VnniBlocks(qb, blocked(scales.float()), None if zeros is None else blocked(zeros.float()), n, k,
                      group_size, int4)


def _u4_lanes(lanes: torch.Tensor, to_blocks: bool) -> torch.Tensor:
    """4-byte lanes [..., 4] (uint8) of packed 4-bit codes, code i at bits 4i of the little-endian
    lane in rows, rearranged for VNNI blocks (to_blocks) or back: in blocks code 2p sits at bits 4p
    and code 2p + 1 at bits 16 + 4p (qmatmul.cpp, VnniCodes<U4>)."""
    v = lanes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(v)
    for p in range(4):
        if to_blocks:
            out |= ((v >> (8 * p)) & 15) << (4 * p) | ((v >> (8 * p + 4)) & 15) << (16 + 4 * p)
        else:
            out |= ((v >> (4 * p)) & 15) << (8 * p) | ((v >> (16 + 4 * p)) & 15) << (8 * p + 4)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).reshape(lanes.shape)


def _planes6_codes(lanes: torch.Tensor, k: int) -> torch.Tensor:
    """A VNNI block's 4-byte lanes of one row each [R, 3 K / 16, 4] (uint8) in the 6-bit planes
    layout (VnniBlocks.planes6) as int8 codes [R, K]."""
    r = lanes.shape[0]
    low = unpack_int4_rows(_u4_lanes(lanes[:, :k // 8], to_blocks=False).reshape(r, -1)).to(torch.int16)
    v = lanes[:, k // 8:].contiguous().view(torch.int32).to(torch.int64).reshape(r, k // 16, 1) & 0xFFFFFFFF
    shifts = torch.tensor([16 * (i % 2) + 2 * (i // 2) for i in range(16)], dtype=torch.int64)
    high = ((v >> shifts) & 3).reshape(r, k).to(torch.int16)
    return ((low | (high << 4)) - 32).to(torch.int8)


def _planes5_codes(lanes: torch.Tensor, k: int, signed: bool) -> torch.Tensor:
    """A VNNI block's 4-byte lanes of one row each [R, 5 K / 32, 4] (uint8) in the 5-bit planes
    layout (VnniBlocks.planes5) as int8 codes [R, K] (signed: Q5_0's, the fifth bit worth -16)."""
    r = lanes.shape[0]
    low = unpack_int4_rows(_u4_lanes(lanes[:, :k // 8], to_blocks=False).reshape(r, -1)).to(torch.int16)
    v = lanes[:, k // 8:].contiguous().view(torch.int32).to(torch.int64).reshape(r, k // 32, 1) & 0xFFFFFFFF
    # code 8t + 2p + o of 32 at bit 16 o + 4t + p
    shifts = torch.tensor([16 * (i % 2) + 4 * (i // 8) + (i % 8) // 2 for i in range(32)], dtype=torch.int64)
    high = ((v >> shifts) & 1).reshape(r, k).to(torch.int16)
    return (low - 16 * high if signed else low | (high << 4)).to(torch.int8)


def repack_gguf_rows(runs: list[tuple[torch.Tensor, int]], n: int, k: int, group_size: int, zeros: bool,
                     int4: bool, vnni: bool, scale_form: str = "full", planes6: bool = False,
                     planes5: bool = False, *, impl: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight [N, K] stored as GGUF blocks, in the layout the group kernels read, by one C++
    pass over its rows on torch's threads (csrc/gguf_repack.cpp). runs: (row addresses int64 [R],
    ggml type id) per run of rows, in order, R summing to N; each address is where that row's
    blocks start in memory (a mapped file: the caller keeps it alive). Returns (q, scales, zeros):
    int4 packed uint8 [N, K / 2] (Q4_0 / Q4_1 / Q4_K codes, IQ4_XS's table indices: every run
    IQ4_XS, or none) or int8 [N, K] codes and float32
    [N, K / g] scales and zeros (None unless `zeros`), as `pack_int4_rows` / qlinear's int8 codes
    of gguf_quants.to_group_affine give them; with vnni, in VNNI blocks as `to_vnni_blocks` lays
    them out (N % 16 == 0); with vnni and scale_form "compact" (every run in COMPACT_GGML_TYPES) or
    "half" (every run in HALF_GGML_TYPES), scales and zeros in that form (VnniBlocks.scale_form):
    uint8 [N / 16, bytes per block]; "half" with every run Q4_0 writes no zeros (zero_mul).
    planes6 (every run Q6_K, vnni, not int4): the codes as VnniBlocks.planes6 holds them; planes5
    (every run in PLANES5_GGML_TYPES, all Q5_0 or none, vnni, not int4) as VnniBlocks.planes5 does.
    impl "scalar" skips the vector path (AVX-512: Q4_K, IQ4_XS, Q5_K and Q6_K in VNNI blocks with
    compact scales, Q5_0 / Q5_1 planes with "half"; for tests: the same bytes either way). Raises
    ValueError for what the layout cannot take (a scale with no such form, say)."""
    if impl not in ("auto", "scalar"):
        raise ValueError(f"impl must be 'auto' or 'scalar'; got {impl!r}")
    if sum(len(addrs) for addrs, _ in runs) != n:
        raise ValueError(f"runs of rows must add up to N={n}")
    if int4 and len({int(qtype) == IQ4_XS_GGML_TYPE for _, qtype in runs}) > 1:
        raise ValueError("4-bit codes and IQ4_XS table indices cannot share one packed weight")
    if planes5 and (len({int(qtype) == Q5_0_GGML_TYPE for _, qtype in runs}) > 1
                    or any(int(qtype) not in PLANES5_GGML_TYPES for _, qtype in runs)):
        raise ValueError("5-bit planes take Q5_0 runs alone, or Q5_1 / Q5_K runs (signed and unsigned codes "
                         "cannot share one weight)")
    row_bytes = k // 2 + k // 4 if planes6 else k // 2 + k // 8 if planes5 else k // 2 if int4 else k
    g = k // group_size
    if not vnni:
        scale_form = "full"
    if scale_form == "half" and all(int(qtype) == 2 for _, qtype in runs):
        zeros = False  # (Q4_0: zero = -8 x scale, formed by the kernel)
    if vnni:
        q = torch.empty(n // 16, row_bytes // 4, 16, 4, dtype=torch.uint8 if int4 or planes6 or planes5 else torch.int8)
        shape = (n // 16, g, 16)
    else:
        q = torch.empty(n, row_bytes, dtype=torch.uint8 if int4 else torch.int8)
        shape = (n, g)
    if scale_form == "compact":  # (qmatmul.cpp compact_block_bytes)
        shape, sdtype = (n // 16, 16 * g + 32 * (k // COMPACT_SUPER_BLOCK)), torch.uint8
    elif scale_form == "half":  # (half_block_bytes)
        shape, sdtype = (n // 16, 32 * g), torch.uint8
    else:
        sdtype = torch.float32
    scales = torch.empty(shape, dtype=sdtype)
    zero_t = torch.empty(shape, dtype=sdtype) if zeros else None
    layout = {"compact": _LAYOUT_COMPACT, "half": _LAYOUT_HALF}.get(scale_form, int(vnni))
    lib = QMATMUL.lib()
    err = ctypes.create_string_buffer(256)
    row0 = 0
    for addrs, qtype in runs:
        addrs = addrs.to(torch.int64).contiguous()
        rc = lib.kvs_gguf_repack(addrs.data_ptr(), len(addrs), row0, int(qtype), n, k,
                                 2 if planes6 else 3 if planes5 else int(int4), layout,
                                 q.data_ptr(), scales.data_ptr(), zero_t.data_ptr() if zero_t is not None else None,
                                 torch.get_num_threads(), int(impl == "scalar"), err, len(err))
        if rc:
            raise ValueError(err.value.decode(errors="replace"))
        row0 += len(addrs)
    return q, scales, zero_t


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (an integer tensor [..., K] of values 0..15, K even) two per byte into
    uint8 [..., K // 2], the layout `int4_group_matmul` reads: out[..., j] = q[..., 2j] |
    q[..., 2j + 1] << 4. Raises ValueError on a non-integer tensor, odd K or codes outside 0..15."""
    if not isinstance(q, torch.Tensor) or q.dim() < 1 or q.dtype.is_floating_point or q.dtype.is_complex \
            or q.dtype == torch.bool:
        raise ValueError(f"q must be an integer tensor [..., K]; got {_desc(q)}")
    if q.shape[-1] % 2:
        raise ValueError(f"q must have an even number of columns K; got shape {tuple(q.shape)}")
    if q.numel() and (q.min().item() < 0 or q.max().item() > 15):
        raise ValueError(f"q must hold 4-bit codes 0..15; got values in [{q.min().item()}, {q.max().item()}]")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: uint8 [..., K // 2] -> uint8 codes [..., K] (0..15)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [..., K // 2]; got {_desc(packed)}")
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _check_x(x: object) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K]; got {_desc(x)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16; got {x.dtype}")


def _group_matmul(fn: str, x: torch.Tensor, q_name: str, q: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, group_size: int, out: torch.Tensor | None, impl: str) -> torch.Tensor:
    """The checks both formats share (x and the codes' shape checked by the caller), and the call."""
    m, k = x.shape
    n = q.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing K={k}")
    groups = k // group_size
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales must be float32 [{n}, {groups}] (N, K // group_size); got {_desc(scales)}")
    if zeros is not None and (not isinstance(zeros, torch.Tensor) or zeros.dtype != torch.float32
                              or tuple(zeros.shape) != (n, groups)):
        raise ValueError(f"zeros must be None or float32 [{n}, {groups}] (N, K // group_size); got {_desc(zeros)}")
    named = [("x", x), (q_name, q), ("scales", scales)] + ([("zeros", zeros)] if zeros is not None else [])
    for name, t in named:
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x must have contiguous rows (unit last stride); got strides {x.stride()}")
    for name, t in named[1:]:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if impl not in _QMM_IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {sorted(_QMM_IMPLS)}")
    return _call_group_matmul(fn, x, q, scales, zeros, n, group_size, out, impl, layout=_LAYOUT_ROWS)


def _call_group_matmul(fn: str, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       n: int, group_size: int, out: torch.Tensor | None, impl: str, layout: int,
                       zero_mul: float = 0.0) -> torch.Tensor:
    """`out` checked (or made) and the C call, for weights in rows and in VNNI blocks alike (x and
    the weight checked by the caller)."""
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype
          or out.device.type != "cpu" or (out.stride(1) != 1 and n > 1)):
        raise ValueError(f"out must be a CPU tensor [{m}, {n}] of x's dtype {x.dtype} with unit last stride; "
                         f"got {_desc(out)}")
    lib = QMATMUL.lib()
    if m == 0 or n == 0:
        return out
    err = ctypes.create_string_buffer(256)
    rc = getattr(lib, fn)(
        x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16,
        q.data_ptr(), scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
        out.data_ptr(), out.stride(0), m, n, k, group_size,
        _QMM_IMPLS[impl], torch.get_num_threads(), err, len(err), layout, zero_mul)
    if rc:
        raise ValueError(err.value.decode(errors="replace"))
    return out
