"""Linear layers over weights kept in their GGUF quantization, each on the kernel that suits it.

Decode steps (a few rows) are memory-bound: they read the packed weights directly. Prefill steps
(many rows) are compute-bound, where the packed kernels lose to a dense bfloat16 GEMM, so the
weight is dequantized into a scratch buffer shared by every layer of that shape (one layer's
worth of memory, never the whole model) and multiplied densely.

- `Int4Linear`: Q4_0 / Q4_1 / Q4_K, torch's `_weight_int4pack_mm_for_cpu`, which computes
  w = (q - 8) * s' + z' per 32-weight group: s' = s and z' = z + 8 s carry the file's affine form
  over unchanged (exact in float32; in bfloat16 s' and z' are rounded to bfloat16).
- `GroupInt8Linear`: Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0: int8 codes with a float32 scale (and
  offset) per 16 or 32 weights, through kvshare's C++ kernel (`cpu_kernels.int8_group_matmul`),
  exact up to float32 accumulation. `GroupInt4Linear`: the Q4 formats the same way with their
  codes packed two per byte (`cpu_kernels.int4_group_matmul`), where torch's int4 kernel is slow.
- `DenseLinear`: everything else (F32, F16, BF16, Q2_K, Q3_K, HF safetensors, or
  quantization=None), a plain tensor in the activation dtype.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvshare.model import cpu_kernels
from kvshare.model.gguf_quants import GroupAffine

logger = logging.getLogger("kvshare")

# Rows at or below which a step reads the packed weights; above, it dequantizes into a scratch
# buffer and runs a dense GEMM. `benchmarks/cpu_decode.py --kernels` measures where they cross:
# on this AVX2 CPU kvshare's packed kernels beat dequantize + dense at every row count up to 256
# (the dequantization alone costs ~6 ms for a 576 x 1536 weight).
PACKED_MAX_ROWS = 256
# Weights this large (the vocab projection) never get a dense scratch: their many-row calls are
# rare (prompt logprobs) and take the packed kernel in slices of PACKED_MAX_ROWS rows.
SCRATCH_MAX_ELEMENTS = 16 * 2**20


class DequantScratch:
    """One reused dense buffer per (shape, dtype): what a prefill GEMM multiplies by."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def get(self, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        key = (n, k, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(n, k, dtype=dtype)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class DenseLinear:
    kind = "dense"

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dense(self) -> torch.Tensor:
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> the layout `_weight_int4pack_mm_for_cpu` reads: per block of
    32 rows and per column, 16 bytes whose low nibbles are rows 0..15 and high nibbles 16..31.
    (Checked against torch's own `_convert_weight_to_int4pack_for_cpu` in the tests; packing
    ourselves lets us unpack rows again for embeddings and prefill scratch.)"""
    n, k = q.shape
    b = q.to(torch.uint8).reshape(n // 32, 2, 16, k).permute(0, 3, 2, 1)  # [N/32, K, 16, 2]
    return (b[..., 0] | (b[..., 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of pack_int4, for all rows or the given row ids: uint8 codes [R, K]."""
    n = packed.shape[0]
    k = packed.shape[1] * 2
    b = packed.view(n // 32, k, 16)
    if rows is None:
        return torch.cat([b & 15, b >> 4], dim=2).permute(0, 2, 1).reshape(n, k)
    block, within = rows // 32, rows % 32
    picked = b[block, :, within % 16]  # [R, K]
    return torch.where((within >= 16).unsqueeze(1), picked >> 4, picked & 15)


class Int4Linear:
    kind = "int4"

    def __init__(self, w: GroupAffine, dtype: torch.dtype, scratch: DequantScratch) -> None:
        if not can_int4(w):
            raise ValueError("Int4Linear needs 4-bit codes in groups of 32, rows a multiple of 32")
        self.out_features, self.in_features = w.q.shape
        self.dtype = dtype
        self.scratch = scratch
        self.packed = pack_int4(w.q)
        zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
        # [K/32, N, 2]: the kernel's (scale, zero) pairs for w = (q - 8) * scale + zero.
        self.scales_zeros = torch.stack([w.scale, zero + 8 * w.scale], dim=-1).transpose(0, 1).to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m <= PACKED_MAX_ROWS:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, 32, self.scales_zeros)
        if self.out_features * self.in_features > SCRATCH_MAX_ELEMENTS:
            return torch.cat([self(x[i:i + PACKED_MAX_ROWS]) for i in range(0, m, PACKED_MAX_ROWS)])
        return F.linear(x, self.dense(self.scratch.get(self.out_features, self.in_features, self.dtype)))

    def _affine(self, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        sz = self.scales_zeros if rows is None else self.scales_zeros[:, rows]  # [G, R, 2]
        r = q.shape[0]
        groups = self.in_features // 32
        scale = sz[..., 0].transpose(0, 1).unsqueeze(-1)  # [R, G, 1]
        zero = sz[..., 1].transpose(0, 1).unsqueeze(-1)
        codes = q.view(r, groups, 32).to(self.dtype) - 8
        return torch.addcmul(zero, codes, scale).reshape(r, self.in_features)

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights exactly as the kernel reconstructs them, [N, K] in the activation dtype."""
        w = self._affine(unpack_int4(self.packed), None)
        if out is None:
            return w
        out.copy_(w)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._affine(unpack_int4(self.packed, ids), ids)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


class GroupInt8Linear:
    kind = "int8-group"

    def __init__(self, w: GroupAffine, dtype: torch.dtype, scratch: DequantScratch) -> None:
        self.out_features, self.in_features = w.q.shape
        self.dtype = dtype
        self.scratch = scratch
        self.group = w.group
        self._store(w.q)
        self.scale = w.scale.float().contiguous()
        self.zero = None if w.zero is None else w.zero.float().contiguous()
        self._fallback: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self._fallback is not None:
            return F.linear(x, self._fallback)
        if m <= PACKED_MAX_ROWS and _qmatmul_ready():
            return self._kernel(x.contiguous())
        if m > PACKED_MAX_ROWS and self.out_features * self.in_features > SCRATCH_MAX_ELEMENTS:
            return torch.cat([self(x[i:i + PACKED_MAX_ROWS]) for i in range(0, m, PACKED_MAX_ROWS)])
        if m <= PACKED_MAX_ROWS and (cpu_kernels.disabled_by_env() or cpu_kernels.QMATMUL.is_done()):
            # The kernel cannot be built here (no compiler, or disabled): keep a dense copy
            # rather than dequantizing on every call. Correct, but not kept quantized.
            logger.warning("kvshare's int8-group kernel is unavailable (%s): weights of %d x %d fall back "
                           "to dense %s", cpu_kernels.QMATMUL.unavailable_reason(), self.out_features,
                           self.in_features, self.dtype)
            self._fallback = self.dense()
            return F.linear(x, self._fallback)
        if self.out_features * self.in_features > SCRATCH_MAX_ELEMENTS:
            # No kernel (yet, or at all) and no scratch for a weight this large: dequantize in slices.
            step = max(1, SCRATCH_MAX_ELEMENTS // (4 * self.in_features))
            return torch.cat([F.linear(x, self._affine(slice(i, i + step))) for i in range(0, self.out_features, step)],
                             dim=-1)
        return F.linear(x, self.dense(self.scratch.get(self.out_features, self.in_features, self.dtype)))

    def _store(self, q: torch.Tensor) -> None:
        self.q = q.to(torch.int8).contiguous()  # codes of 4, 5 and 6 bits fit int8 as they are

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.int8_group_matmul(x, self.q, self.scale, self.zero, self.group)

    def _codes(self, rows) -> torch.Tensor:
        return self.q[rows]

    def _affine(self, rows, out: torch.Tensor | None = None) -> torch.Tensor:
        q = self._codes(rows)
        r = q.shape[0]
        codes = q.view(r, -1, self.group).float()
        scale = self.scale[rows].unsqueeze(-1)
        # Straight into `out` when it is float32 (the prefill scratch): one pass, no temporary.
        target = out.view(r, -1, self.group) if out is not None and out.dtype == torch.float32 else None
        if self.zero is not None:
            w = torch.addcmul(self.zero[rows].unsqueeze(-1), codes, scale, out=target)
        else:
            w = torch.mul(codes, scale, out=target)
        w = w.view(r, self.in_features)
        if out is None:
            return w.to(self.dtype)
        if target is None:
            out.copy_(w)
        return out

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._affine(slice(None), out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._affine(ids)

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.numel() * 4
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4 + zero


class GroupInt4Linear(GroupInt8Linear):
    """4-bit codes (Q4_0 / Q4_1 / Q4_K) packed two per byte, through kvshare's C++
    `int4_group_matmul`: half the bytes per decode step of GroupInt8Linear, same arithmetic."""

    kind = "int4-group"

    def _store(self, q: torch.Tensor) -> None:
        self.q = cpu_kernels.pack_int4_rows(q)  # [N, K / 2]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.int4_group_matmul(x, self.q, self.scale, self.zero, self.group)

    def _codes(self, rows) -> torch.Tensor:
        return cpu_kernels.unpack_int4_rows(self.q[rows])


def _qmatmul_ready() -> bool:
    # Never waits: False while the kernel is still being built (then the dense fallback runs).
    return cpu_kernels.QMATMUL.available()


def can_int4(w: GroupAffine) -> bool:
    n, k = w.q.shape
    return w.bits == 4 and w.group == 32 and n % 32 == 0 and k % 64 == 0


def torch_int4_is_fast(dtype: torch.dtype) -> bool:
    """torch's int4 CPU kernel is fast only with AVX-512 and bfloat16 activations: on an AVX2
    CPU it is ~7x slower than a dense float32 matmul at one row (benchmarks/cpu_decode.py
    --kernels shows it), so there the int4 formats take kvshare's int8-group kernel too."""
    return dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def make_linear(weight: torch.Tensor | GroupAffine, dtype: torch.dtype, scratch: DequantScratch,
                int4: bool | None = None):
    """The layer for one (possibly fused) weight: packed when it came packed, else dense.
    `int4` forces (True) or refuses (False) torch's int4 kernel for the Q4 formats."""
    if isinstance(weight, GroupAffine):
        use_int4 = torch_int4_is_fast(dtype) if int4 is None else int4
        if use_int4 and can_int4(weight):
            return Int4Linear(weight, dtype, scratch)
        if weight.bits == 4 and weight.group % 32 == 0:
            return GroupInt4Linear(weight, dtype, scratch)
        return GroupInt8Linear(weight, dtype, scratch)
    return DenseLinear(weight, dtype)


_ZERO_OFFSET_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K"})
_GROUP_16_TYPES = frozenset({"Q6_K"})
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})


def resident_bytes_per_weight(type_name: str, dtype: torch.dtype) -> float | None:
    """Bytes per weight kvshare holds for a 2-D GGUF tensor of this type with
    quantization='auto' (what make_linear builds), or None for types it dequantizes to dense."""
    from kvshare.model.gguf_quants import GROUP_AFFINE_TYPES

    if type_name not in {t.name for t in GROUP_AFFINE_TYPES}:
        return None
    elsize = torch.empty(0, dtype=dtype).element_size()
    if type_name in _INT4_TYPES and torch_int4_is_fast(dtype):
        return 0.5 + 2 * elsize / 32  # nibbles + (scale, zero) per 32 in the activation dtype
    group = 16 if type_name in _GROUP_16_TYPES else 32
    per_group = 4 + (4 if type_name in _ZERO_OFFSET_TYPES else 0)  # float32 scale (+ offset)
    code = 0.5 if type_name in _INT4_TYPES else 1  # 4-bit codes two per byte, else one int8
    return code + per_group / group
