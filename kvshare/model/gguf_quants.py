"""GGUF quantized blocks -> an affine per-group form, without requantizing.

Every format handled here stores, per group of `group` consecutive weights of a row, integer
codes q and (after multiplying out the block's super-scales) one scale s and one offset z with

    w = s * q + z          (z = 0 for the symmetric formats)

s and z are products/sums of a float16 and a small integer, so float32 holds them exactly:
the affine form *is* the file's weights, not an approximation. `GroupAffine` carries that form
as torch tensors; `qlinear` turns it into what a kernel consumes.

| GGUF type | group | q range | s, z |
|---|---|---|---|
| Q4_0 | 32 | 0..15 | d, -8d |
| Q4_1 | 32 | 0..15 | d, m |
| Q4_K | 32 | 0..15 | d*sc_j, -dmin*m_j (6-bit sc_j, m_j per 32) |
| Q5_0 | 32 | -16..15 | d, 0 |
| Q5_1 | 32 | 0..31 | d, m |
| Q5_K | 32 | 0..31 | d*sc_j, -dmin*m_j |
| Q6_K | 16 | -32..31 | d*sc_j (int8 sc_j per 16), 0 |
| Q8_0 | 32 | -128..127 | d, 0 |
| Q2_K | 16 | 0..3 | d*sc_j, -dmin*m_j (4-bit sc_j, m_j per 16) |
| Q3_K | 16 | -4..3 | d*(sc_j - 32) (6-bit sc_j per 16), 0 |
| IQ4_XS | 32 | the 16 values of llama.cpp's non-linear 4-bit table, -127..113 | d*(ls_j - 32) (6-bit ls_j per 32), 0 |

(IQ4_XS's code is the table's int8 value, not the 4-bit index: the weight is still scale x code.)

The bit layouts follow ggml's block definitions (ggml-common.h); each decoder is checked
against `gguf.quants.dequantize` in tests/test_qlinear.py.

At load the loader does not decode anything: a weight is a `GGUFBlocks` (the file's bytes, a
view of the memory map, plus which rows), and qlinear turns it into its kernel's layout in one
multi-threaded C++ pass (csrc/gguf_repack.cpp), the arrays this module's numpy decoders and
qlinear's packing would give, bit for bit (tests/test_gguf_repack.py). The numpy path stays the
reference, and what runs where the C++ kernels cannot be built.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvshare.model.kernels import qmatmul

Q = GGMLQuantizationType


@dataclass
class GroupAffine:
    q: torch.Tensor  # int8 (signed formats) or uint8 (unsigned) [N, K]
    scale: torch.Tensor  # float32 [N, K // group]
    zero: torch.Tensor | None  # float32 [N, K // group]; None for symmetric formats
    group: int
    bits: int  # code width: 4 for the Q4 formats (int4 kernels take them), else 2, 3, 5, 6 or 8

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def type_name(self) -> str:
        return f"int{self.bits}/g{self.group}"

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // self.group, self.group).float() * self.scale.unsqueeze(-1)
        if self.zero is not None:
            w += self.zero.unsqueeze(-1)
        return w.view(n, k)

    def row_slice(self, lo: int, hi: int) -> "GroupAffine":
        """Output rows [lo, hi) (rows are independent in the group form)."""
        return GroupAffine(self.q[lo:hi].contiguous(), self.scale[lo:hi].contiguous(),
                           None if self.zero is None else self.zero[lo:hi].contiguous(), self.group, self.bits)

    def col_slice(self, lo: int, hi: int) -> "GroupAffine":
        """Input columns [lo, hi), both on group boundaries."""
        g0, g1 = lo // self.group, hi // self.group
        return GroupAffine(self.q[:, lo:hi].contiguous(), self.scale[:, g0:g1].contiguous(),
                           None if self.zero is None else self.zero[:, g0:g1].contiguous(), self.group, self.bits)

    @staticmethod
    def cat(parts: list["GroupAffine"]) -> "GroupAffine":
        """Row-wise concatenation (fused q/k/v, gate/up); symmetric parts get zero offsets if mixed.

        Parts of one code width fuse as they are. Parts of different widths above 4 bits (e.g. the
        Q5_0 q/k and Q8_0 v of a Q4_K_M file) fuse too: their codes all fit int8 unchanged and they
        run on the same int8-group kernel. 4-bit parts (packed two per byte) fuse only with 4-bit
        parts, and every part must share the group size. Parts still in the file's blocks
        (GGUFBlocks) stay so. IQ4_XS (Q6_K, Q5_0) parts in the file's blocks fuse only with IQ4_XS
        (Q6_K, Q5_0) parts, and Q5_1 / Q5_K parts only with Q5_1 / Q5_K parts (a ValueError
        otherwise: row blocks), so that they can keep their codes at the file's bits (4-bit table
        indices: qlinear.GroupIQ4NLLinear; planes: GroupQ6PlanesLinear, GroupQ5PlanesLinear)."""
        bits, code_dtype = _fused_form(parts)
        if all(isinstance(p, GGUFBlocks) for p in parts):
            if len({(p.iq4_xs, p.q6_k, p.q5_planes) for p in parts}) > 1:
                raise ValueError("IQ4_XS, Q6_K and 5-bit weights fuse only with their own format (their codes "
                                 "stay at the file's bits)")
            return GGUFBlocks.cat(parts, bits, code_dtype)
        first = parts[0]
        if any(p.q.dtype != code_dtype for p in parts):
            parts = [p if p.q.dtype == code_dtype else
                     GroupAffine(p.q.to(code_dtype), p.scale, p.zero, p.group, p.bits) for p in parts]
        if all(p.zero is None for p in parts):
            zero = None
        else:
            zero = torch.cat([p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts])
        return GroupAffine(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero,
                           first.group, bits)

    @property
    def code_dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def has_zero(self) -> bool:
        return self.zero is not None


def _fused_form(parts: list[GroupAffine]) -> tuple[int, torch.dtype]:
    """(code width, code dtype) of the row-wise concatenation of `parts` (GroupAffine.cat's rules),
    or ValueError when they cannot share one packed weight."""
    first = parts[0]
    if any(p.group != first.group for p in parts):
        raise ValueError("cannot fuse weights of different GGUF formats")
    if all(p.bits == first.bits and p.code_dtype == first.code_dtype for p in parts):
        return first.bits, first.code_dtype
    if any(p.bits == 4 or p.bits > 8 or (p.code_dtype == torch.uint8 and p.bits > 7) for p in parts):
        raise ValueError("cannot fuse weights of different GGUF formats")
    return max(p.bits for p in parts), torch.int8


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [nb, 1]


def _k_scales(raw12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed into 12 bytes of a Q4_K / Q5_K super-block."""
    s = raw12.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles32(qs16: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs16 & 0xF, qs16 >> 4], axis=1)


def _decode(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """raw uint8 [nblocks, type_size] -> (q [nb, block], s [nb, groups], z or None, group, bits)."""
    if qtype == Q.Q4_0:
        d = _f16(raw, 0)
        return _nibbles32(raw[:, 2:18]), d, -8 * d, 32, 4
    if qtype == Q.Q4_1:
        return _nibbles32(raw[:, 4:20]), _f16(raw, 0), _f16(raw, 2), 32, 4
    if qtype == Q.Q8_0:
        return raw[:, 2:34].view(np.int8), _f16(raw, 0), None, 32, 8
    if qtype in (Q.Q5_0, Q.Q5_1):
        base = 2 if qtype == Q.Q5_0 else 4
        qh = raw[:, base:base + 4].copy().view(np.uint32)  # [nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        q = _nibbles32(raw[:, base + 4:base + 20]) | high
        if qtype == Q.Q5_0:
            return (q.astype(np.int16) - 16).astype(np.int8), _f16(raw, 0), None, 32, 5
        return q, _f16(raw, 0), _f16(raw, 2), 32, 5
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, mn = _k_scales(raw[:, 4:16])
        if qtype == Q.Q4_K:
            qs = raw[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 weights
            q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)
            bits = 4
        else:
            qh = raw[:, 16:48]  # bit 2i / 2i+1 of byte l: high bit of weight l of sub-block 2i / 2i+1
            qs = raw[:, 48:176].reshape(-1, 4, 32)
            shifts = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
            high = ((qh[:, None, None, :] >> shifts) & 1) << 4  # [nb, 4, 2, 32]
            q = (np.stack([qs & 0xF, qs >> 4], axis=2) | high).reshape(-1, 256)
            bits = 5
        return q, d * sc, -(dmin * mn), 32, bits
    if qtype == Q.Q6_K:
        ql = raw[:, 0:128].reshape(-1, 2, 64)
        qh = raw[:, 128:192].reshape(-1, 2, 32)
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw, 208)
        lo = np.concatenate([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, 256)
        return q, d * sc, None, 16, 6
    if qtype == Q.Q2_K:
        sc = raw[:, 0:16]
        qs = raw[:, 16:80].reshape(-1, 2, 1, 32)  # two halves of 128 weights, 4 two-bit planes each
        q = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)
        d, dmin = _f16(raw, 80), _f16(raw, 82)
        return q, d * (sc & 0xF).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32)), 16, 2
    if qtype == Q.Q3_K:
        hmask, qs, packed = raw[:, 0:32], raw[:, 32:96], raw[:, 96:108]
        low = (packed[:, 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 2, 1).reshape(-1, 16) & 0xF
        high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1).reshape(-1, 16) & 3
        sc = (low | (high << 4)).astype(np.float32) - 32
        ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        qh = (hmask.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = ql.reshape(-1, 256).astype(np.int8) - ((qh.reshape(-1, 256) ^ 1) << 2).astype(np.int8)
        return q, _f16(raw, 108) * sc, None, 16, 3
    if qtype == Q.IQ4_XS:
        d = _f16(raw, 0)
        high = (raw[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [nb, 8]
        low = (raw[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0xF
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
        idx = _nibbles32(raw[:, 8:136].reshape(-1, 16)).reshape(-1, 256)  # per 32: low nibbles, then high
        return IQ4_NL_VALUES[idx], d * ls, None, 32, 8
    raise KeyError(qtype)


# IQ4_NL / IQ4_XS code values (ggml-common.h kvalues_iq4nl): a non-linear 4-bit grid.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

GROUP_AFFINE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q2_K, Q.Q3_K,
                                Q.IQ4_XS})


def to_group_affine(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupAffine:
    """A 2-D GGUF tensor's raw bytes (rows x bytes per row, row-major) in affine group form."""
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * k // block, type_size)
    q, s, z, group, bits = _decode(raw, qtype)
    q_t = torch.from_numpy(np.ascontiguousarray(q).reshape(n, k))
    s_t = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(n, k // group))
    z_t = None if z is None else torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32).reshape(n, k // group))
    return GroupAffine(q_t, s_t, z_t, group, bits)


# Per format, what to_group_affine gives: (group, code width, code dtype, has offsets).
GROUP_AFFINE_FORMS: dict[Q, tuple[int, int, torch.dtype, bool]] = {
    Q.Q4_0: (32, 4, torch.uint8, True), Q.Q4_1: (32, 4, torch.uint8, True), Q.Q5_0: (32, 5, torch.int8, False),
    Q.Q5_1: (32, 5, torch.uint8, True), Q.Q8_0: (32, 8, torch.int8, False), Q.Q4_K: (32, 4, torch.uint8, True),
    Q.Q5_K: (32, 5, torch.uint8, True), Q.Q6_K: (16, 6, torch.int8, False), Q.Q2_K: (16, 2, torch.uint8, True),
    Q.Q3_K: (16, 3, torch.int8, False), Q.IQ4_XS: (32, 8, torch.int8, False),
}


@dataclass(frozen=True, eq=False)
class GGUFRows:
    """Rows of one GGUF tensor as the file stores them: `data` uint8 [rows, bytes per row] (a view
    of the memory map), and which of its rows, in order (None: all)."""

    data: np.ndarray
    qtype: Q
    rows: np.ndarray | None = None  # int64 row indices into data

    @property
    def num_rows(self) -> int:
        return self.data.shape[0] if self.rows is None else len(self.rows)

    def select(self, idx: np.ndarray) -> "GGUFRows":
        return GGUFRows(self.data, self.qtype, idx if self.rows is None else self.rows[idx])

    def row_addresses(self) -> torch.Tensor:
        """int64 [num_rows]: where each row's blocks start in memory (kvs_gguf_repack reads them)."""
        idx = np.arange(self.data.shape[0], dtype=np.int64) if self.rows is None else self.rows.astype(np.int64)
        return torch.from_numpy(self.data.ctypes.data + idx * self.data.strides[0])

    def group_affine(self, k: int) -> GroupAffine:
        data = self.data if self.rows is None else self.data[self.rows]
        return to_group_affine(data, self.qtype, (self.num_rows, k))


class GGUFBlocks(GroupAffine):
    """A GroupAffine that is still the file's blocks: one or more runs of rows of GGUF tensors
    (llama's un-permuted q/k rows, a fused q/k/v, a tensor-parallel shard), converted only when
    used. qlinear builds a layer's kernel layout from it in one C++ pass (`repack`, which gives the
    arrays `to_group_affine` and qlinear's packing give); anything else that reads q / scale / zero
    gets them from `to_group_affine` (the reference path: decoded on first use, then kept with
    this object)."""

    def __init__(self, parts: tuple[GGUFRows, ...], k: int, bits: int | None = None,
                 code_dtype: torch.dtype | None = None, has_zero: bool | None = None) -> None:
        forms = [GROUP_AFFINE_FORMS[p.qtype] for p in parts]
        self.parts = tuple(parts)
        self.k = k
        self.group = forms[0][0]
        self.bits = forms[0][1] if bits is None else bits
        self._code_dtype = forms[0][2] if code_dtype is None else code_dtype
        self._has_zero = any(f[3] for f in forms) if has_zero is None else has_zero
        self._materialized: GroupAffine | None = None

    @staticmethod
    def of_tensor(data: np.ndarray, qtype: Q, shape: tuple[int, int], rows: np.ndarray | None = None) -> "GGUFBlocks":
        """A 2-D tensor's raw bytes [N, bytes per row] (rows: which of them, in order)."""
        return GGUFBlocks((GGUFRows(data, qtype, rows),), shape[1])

    @staticmethod
    def cat(parts: list["GGUFBlocks"], bits: int | None = None, code_dtype: torch.dtype | None = None) -> "GGUFBlocks":
        if bits is None:
            bits, code_dtype = _fused_form(parts)
        return GGUFBlocks(tuple(r for p in parts for r in p.parts), parts[0].k, bits, code_dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.num_rows for p in self.parts), self.k))

    @property
    def code_dtype(self) -> torch.dtype:
        return self._code_dtype

    @property
    def has_zero(self) -> bool:
        return self._has_zero

    @property
    def iq4_xs(self) -> bool:
        """Every run IQ4_XS: its 4-bit indices can be kept as they are (repack with int4)."""
        return all(p.qtype == Q.IQ4_XS for p in self.parts)

    @property
    def q6_k(self) -> bool:
        """Every run Q6_K: its codes can be kept as two planes (repack with planes6)."""
        return all(p.qtype == Q.Q6_K for p in self.parts)

    @property
    def q5_planes(self) -> str | None:
        """"signed" when every run is Q5_0 (codes -16..15), "unsigned" when every run is Q5_1 or
        Q5_K (0..31): its codes can be kept as a 4-bit and a 1-bit plane (repack with planes5);
        else None."""
        if all(p.qtype == Q.Q5_0 for p in self.parts):
            return "signed"
        if all(p.qtype in (Q.Q5_1, Q.Q5_K) for p in self.parts):
            return "unsigned"
        return None

    def materialize(self) -> GroupAffine:
        """The reference form (to_group_affine of each run, joined as GroupAffine.cat joins them)."""
        if self._materialized is None:
            affine = [p.group_affine(self.k) for p in self.parts]
            a = affine[0] if len(affine) == 1 else GroupAffine.cat(affine)
            if a.q.dtype != self._code_dtype or a.bits != self.bits or (a.zero is None) == self._has_zero:
                # rows of a concatenation, taking its form (GroupAffine.cat, then row_slice)
                zero = a.zero if a.zero is not None or not self._has_zero else torch.zeros_like(a.scale)
                a = GroupAffine(a.q.to(self._code_dtype), a.scale, zero, a.group, self.bits)
            self._materialized = a
        return self._materialized

    @property
    def q(self) -> torch.Tensor:  # type: ignore[override]
        return self.materialize().q

    @property
    def scale(self) -> torch.Tensor:  # type: ignore[override]
        return self.materialize().scale

    @property
    def zero(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.materialize().zero

    def repack(self, int4: bool, vnni: bool, planes6: bool = False, planes5: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]:
        """(q, scales, zeros, scale form) in a group kernel's layout, straight from the blocks in
        C++ (qmatmul.repack_gguf_rows; the kernel library must be loaded): the values
        materialize() + qlinear's packing give, bit for bit. In VNNI blocks the scales stay in
        the file's form where every part has one ("compact": K-quants and IQ4_XS, a float16 base
        per super-block times a code per group; "half": one float16 per group), so decode reads
        ~0.06-0.2 bytes per weight less, unless a value has no such form (a non-finite d, say,
        or Q4_0 fused with Q4_1): then "full" (float32 per group)."""
        n, k = self.shape
        runs = [(p.row_addresses(), int(p.qtype)) for p in self.parts]
        types = {int(p.qtype) for p in self.parts}
        form = "compact" if types <= qmatmul.COMPACT_GGML_TYPES else "half" if types <= qmatmul.HALF_GGML_TYPES else "full"
        if vnni and form != "full":
            try:
                return (*qmatmul.repack_gguf_rows(runs, n, k, self.group, self._has_zero, int4, vnni, form, planes6,
                                                  planes5), form)
            except ValueError as e:
                if "no compact or float16 form" not in str(e):
                    raise
        return (*qmatmul.repack_gguf_rows(runs, n, k, self.group, self._has_zero, int4, vnni, planes6=planes6,
                                          planes5=planes5), "full")

    def row_slice(self, lo: int, hi: int) -> "GGUFBlocks":
        parts, start = [], 0
        for p in self.parts:
            a, b = max(lo - start, 0), min(hi - start, p.num_rows)
            if a < b:
                parts.append(p.select(np.arange(a, b, dtype=np.int64)))
            start += p.num_rows
        return GGUFBlocks(tuple(parts), self.k, self.bits, self._code_dtype, self._has_zero)

    def col_slice(self, lo: int, hi: int) -> GroupAffine:
        """Input columns [lo, hi): still the file's blocks where both fall on every part's block
        boundaries (each row's bytes of those blocks: a tensor-parallel rank's share of o / down),
        else from the reference form (on group boundaries)."""
        parts = []
        for p in self.parts:
            block, type_size = GGML_QUANT_SIZES[p.qtype]
            if lo % block or hi % block:
                return self.materialize().col_slice(lo, hi)
            parts.append(GGUFRows(p.data[:, lo // block * type_size:hi // block * type_size], p.qtype, p.rows))
        return GGUFBlocks(tuple(parts), hi - lo, self.bits, self._code_dtype, self._has_zero)

    def __repr__(self) -> str:
        kinds = "+".join(p.qtype.name for p in self.parts)
        return f"GGUFBlocks({kinds}, shape={tuple(self.shape)}, {self.type_name})"

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__
