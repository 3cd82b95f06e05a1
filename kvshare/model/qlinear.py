"""Linear layers over weights kept in their GGUF quantization, each on the kernel that suits it.

Decode rows (one new token per sequence) are memory-bound: they read the packed weights directly.
In the default mode every row is such a row (token rows, kvshare.model.numerics): prompt rows
take the packed kernels too, so a token's K/V are the same bits whether it was decoded, prefilled
in any chunk, or recomputed (docs/transparency.md). Where rows are not token rows (the runner
says how many leading rows are decode rows), prompt rows are multiplied densely: the weight is
dequantized into a scratch buffer shared by every layer of that shape (one layer's worth of
memory, never the whole model), in bfloat16 where the CPU has avx512_bf16
(EngineConfig.prefill_dtype). Either way a row takes its kernel by what it is, never by how many
rows share its step.

- `GroupInt8Linear`: Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0: int8 codes with a float32 scale (and
  offset) per 16 or 32 weights, through kvshare's C++ kernel (`qmatmul.int8_group_matmul`),
  exact up to float32 accumulation. `GroupInt4Linear`: the Q4 formats (Q4_0 / Q4_1 / Q4_K) the
  same way with their codes packed two per byte (`qmatmul.int4_group_matmul`).
  On AVX-512 VNNI CPUs both keep their codes in VNNI blocks instead (`qmatmul.VnniBlocks`:
  the same bytes, 16 rows interleaved 4 bytes at a time) for the avx512-vnni path, which rounds
  each decode row's x to int16 per group of the weight (step max|x| / 32767) and sums each group
  exactly in int32: 1.3-1.8x the float32 path at 1-64 rows on the bundled model's layers, with
  the same greedy agreement with the exact path (benchmarks/default_mode_accuracy.py).
  (torch's `_weight_int4pack_mm_for_cpu` is not used: its packed layout depends on the CPU's
  capability, so codes packed by hand read wrong on AVX-512 machines, and a copy in torch's own
  layout could not be read back for embeddings and prefill; the fused decode step needs
  kvshare's layout anyway.)
  Q2_K and Q3_K take the int8 kernel too (codes widened to a byte). `GroupIQ4NLLinear`: IQ4_XS
  on AVX-512 VNNI CPUs, its 4-bit indices into the non-linear table kept two per byte and looked
  up in the kernel (`VnniBlocks.iq4nl`), the bits the int8 kernel gives on the table's values;
  elsewhere IQ4_XS takes the int8 kernel with each code widened to its table value.
  `GroupQ6PlanesLinear` / `GroupQ5PlanesLinear`: Q6_K and Q5_0 / Q5_1 / Q5_K on AVX-512 VNNI
  CPUs, each code kept as a 4-bit plane and a 2-bit (1-bit) plane and widened to the int8 code
  inside the kernel (`VnniBlocks.planes6` / `planes5`): the int8 kernel's bits at the file's size.
- `DenseLinear`: everything else (F32, F16, BF16, HF safetensors, or quantization=None), a
  plain tensor in the activation dtype.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from kvshare.model.gguf_quants import GGUFBlocks, GroupAffine
from kvshare.model.kernels import qmatmul

logger = logging.getLogger("kvshare")

# Calls outside a step (no decode_rows given) read the packed weights up to this many rows and the
# dense scratch above; decode rows beyond it take the packed kernel in slices of this many rows.
# (`benchmarks/cpu_decode.py --kernels` times both paths by row count.)
PACKED_MAX_ROWS = 256
# Weights this large (the vocab projection) never get a dense scratch: their many-row calls are
# rare (prompt logprobs) and take the packed kernel in slices of PACKED_MAX_ROWS rows.
SCRATCH_MAX_ELEMENTS = 16 * 2**20


class DequantScratch:
    """One reused dense buffer per weight shape: what a prefill GEMM multiplies by, in the GEMM's
    dtype (bfloat16 on CPUs that multiply it natively, where the activations are float32: x is
    rounded to bfloat16 for the GEMM, and its result widened back; EngineConfig.prefill_dtype)."""

    def __init__(self, gemm_dtype: torch.dtype | None = None) -> None:
        self.gemm_dtype = gemm_dtype  # None: each layer's activation dtype
        self._buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def get(self, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        key = (n, k, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(n, k, dtype=dtype)
        return buf

    def matmul(self, x: torch.Tensor, lin, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ lin's weights by a dense GEMM over the scratch copy, in x's dtype (into `out` when
        given)."""
        dtype = self.gemm_dtype or x.dtype
        w = lin.dense(self.get(lin.out_features, lin.in_features, dtype))
        y = F.linear(x.to(dtype), w)
        if out is None:
            return y.to(x.dtype)
        return out.copy_(y)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class DenseLinear:
    kind = "dense"
    blocks = None  # (never in VNNI blocks)

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.linear(x, self.weight)
        return out.copy_(F.linear(x, self.weight))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dense(self) -> torch.Tensor:
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class GroupInt8Linear:
    kind = "int8-group"
    packed_int4 = False  # codes one per byte (GroupInt4Linear: two)
    iq4nl = False  # 4-bit fields are IQ4_NL table indices (GroupIQ4NLLinear)
    planes6 = False  # Q6_K's codes as a 4-bit and a 2-bit plane (GroupQ6PlanesLinear)
    planes5 = False  # 5-bit codes as a 4-bit and a 1-bit plane (GroupQ5PlanesLinear)
    planes5_signed = False  # (Q5_0's codes -16..15)

    def __init__(self, w: GroupAffine, dtype: torch.dtype, scratch: DequantScratch) -> None:
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        self.scratch = scratch
        # Decided here, once (the engine loads the library before it builds a layer): no step asks
        # whether a build has finished, so a row's kernel never changes mid-run.
        self._kernel_ready = qmatmul.QMATMUL.settle() is None
        self.group = w.group
        # On AVX-512 VNNI CPUs the weight is kept in VNNI blocks instead of rows (the same bytes,
        # reordered), for the avx512-vnni path: decode rows rounded to int16 per group, exact
        # integer group sums (qmatmul.VnniBlocks). q / scale / zero then hold the blocks.
        self.blocks: qmatmul.VnniBlocks | None = None
        vnni = qmatmul.vnni_blocks_fit(self.out_features, self.in_features, self.group)
        if isinstance(w, GGUFBlocks) and self._kernel_ready:
            # Still the file's blocks: decoded once, in C++ across threads, straight into the final
            # layout (the same arrays the steps below make from w.q / w.scale / w.zero).
            self.q, self.scale, self.zero, form = w.repack(self.packed_int4, vnni, planes6=self.planes6,
                                                           planes5=self.planes5)
            if vnni:
                # (Q4_0 in float16 scales: no zeros array, each zero -8 x its scale)
                zero_mul = qmatmul.Q4_0_ZERO_MUL if form == "half" and self.zero is None and w.has_zero else 0.0
                self.blocks = qmatmul.VnniBlocks(self.q, self.scale, self.zero, self.out_features,
                                                 self.in_features, self.group, self.packed_int4, form, zero_mul,
                                                 self.iq4nl, self.planes6, self.planes5, self.planes5_signed)
        else:
            self.q = self._pack(w.q)
            self.scale = w.scale.float().contiguous()
            self.zero = None if w.zero is None else w.zero.float().contiguous()
            if vnni:
                self.blocks = qmatmul.to_vnni_blocks(self.q, self.scale, self.zero, self.group, self.packed_int4)
                if self.iq4nl:
                    self.blocks = dataclasses.replace(self.blocks, iq4nl=True)
                self.q, self.scale, self.zero = self.blocks.q, self.blocks.scales, self.blocks.zeros
        self._blocks_checked = False
        self._fallback: torch.Tensor | None = None
        if not self._kernel_ready:
            # The kernel cannot be loaded here (no compiler, or disabled): a dense copy, made now so
            # that every row takes it from the first step on (made on a first decode call instead,
            # prompt rows would change kernel mid-run). Correct, but not kept quantized.
            logger.warning("kvshare's int8-group kernel is unavailable (%s): weights of %d x %d fall back "
                           "to dense %s", qmatmul.QMATMUL.unavailable_reason(), self.out_features,
                           self.in_features, self.dtype)
            self._fallback = self.dense()

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """decode_rows: how many leading rows of x are decode rows (the model's forward says; the
        rest are prompt tokens). Decode rows take the packed kernel however many there are, prompt
        tokens the dense GEMM in the scratch's dtype, so a row's numbers depend on what the row is,
        never on the size of its batch. None (a call outside a step): up to PACKED_MAX_ROWS rows
        packed, more dense. out: [M, N] of x's dtype with unit last stride (any row stride: a
        column block of a StackedLinear's output)."""
        m = x.shape[0]
        if self._fallback is not None:
            y = F.linear(x, self._fallback)
            return y if out is None else out.copy_(y)
        if decode_rows is None:
            decode_rows = m if m <= PACKED_MAX_ROWS else 0
        if decode_rows >= m or self.out_features * self.in_features > SCRATCH_MAX_ELEMENTS:
            return self._packed(x, out)  # (the vocab projection never gets a scratch copy)
        if decode_rows <= 0:
            return self.scratch.matmul(x, self, out)
        # Both parts written into one output (no torch.cat copy of a prompt-sized result).
        y = torch.empty(m, self.out_features, dtype=x.dtype) if out is None else out
        self._packed(x[:decode_rows], y[:decode_rows])
        self.scratch.matmul(x[decode_rows:], self, y[decode_rows:])
        return y

    def _packed(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if m > PACKED_MAX_ROWS:  # in slices: a row's result does not depend on its slice
            y = torch.empty(m, self.out_features, dtype=x.dtype) if out is None else out
            for i in range(0, m, PACKED_MAX_ROWS):
                self._packed(x[i:i + PACKED_MAX_ROWS], y[i:i + PACKED_MAX_ROWS])
            return y
        self.check_blocks()  # (only with the kernel: without it __call__ takes the dense copy)
        return self._kernel(x.contiguous(), out)

    def check_blocks(self) -> bool:
        """With the kernel library loaded: back to rows if it cannot run VNNI blocks after all
        (they were chosen from /proc/cpuinfo before it loaded; e.g. a compiler without the
        avx512-vnni path). True when the weight moved (FusedDecode.reason rebuilds its pointers
        after settling every layer's weights this way)."""
        if self.blocks is None or self._blocks_checked:
            return False
        self._blocks_checked = True
        if qmatmul.QMATMUL.lib().kvs_qmm_vnni_blocks_fit(self.in_features, self.group):
            return False
        logger.warning("kvshare's avx512-vnni kernel cannot run here: weights of %d x %d go back to rows",
                       self.out_features, self.in_features)
        self.q, self.scale, self.zero = self.blocks.rows(torch.arange(self.out_features))
        self.blocks = None
        return True

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(torch.int8).contiguous()  # codes of 4, 5 and 6 bits fit int8 as they are

    def _kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.blocks is not None:
            return self.blocks.matmul(x, out)
        return self._rows_kernel(x, out)

    def _rows_kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return qmatmul.int8_group_matmul(x, self.q, self.scale, self.zero, self.group, out)

    def _codes(self, packed_rows: torch.Tensor) -> torch.Tensor:
        return packed_rows

    def _rows(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes (as stored in rows), scales and zeros of `rows` (a slice or index tensor)."""
        if self.blocks is None:
            return self.q[rows], self.scale[rows], None if self.zero is None else self.zero[rows]
        idx = rows if isinstance(rows, torch.Tensor) else torch.arange(self.out_features)[rows]
        return self.blocks.rows(idx.reshape(-1))

    def _affine(self, rows, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale, zero = self._rows(rows)
        q = self._codes(packed)
        r = q.shape[0]
        codes = q.view(r, -1, self.group).float()
        scale = scale.unsqueeze(-1)
        # Straight into `out` when it is float32 (the prefill scratch): one pass, no temporary.
        target = out.view(r, -1, self.group) if out is not None and out.dtype == torch.float32 else None
        if zero is not None:
            w = torch.addcmul(zero.unsqueeze(-1), codes, scale, out=target)
        else:
            w = torch.mul(codes, scale, out=target)
        w = w.view(r, self.in_features)
        if out is None:
            return w.to(self.dtype)
        if target is None:
            out.copy_(w)
        return out

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights [N, K] as the kernels form them (into `out` when given: the prefill
        scratch, filled by one C++ pass when the kernel library is built)."""
        if out is not None and out.is_contiguous() and self._kernel_ready:
            self.check_blocks()
            if self.blocks is not None:
                return self.blocks.dequantize(out)
            return qmatmul.group_dequantize(self.q, self.scale, self.zero, self.group, out, self.packed_int4)
        return self._affine(slice(None), out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._affine(ids)

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.numel() * self.zero.element_size()
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size() + zero


class GroupInt4Linear(GroupInt8Linear):
    """4-bit codes (Q4_0 / Q4_1 / Q4_K) packed two per byte, through kvshare's C++
    `int4_group_matmul`: half the bytes per decode step of GroupInt8Linear, same arithmetic."""

    kind = "int4-group"
    packed_int4 = True

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        return qmatmul.pack_int4_rows(q)  # [N, K / 2]

    def _rows_kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return qmatmul.int4_group_matmul(x, self.q, self.scale, self.zero, self.group, out)

    def _codes(self, packed_rows: torch.Tensor) -> torch.Tensor:
        return qmatmul.unpack_int4_rows(packed_rows)


class GroupIQ4NLLinear(GroupInt8Linear):
    """IQ4_XS kept at its file's bits: each weight's 4-bit index into the IQ4_NL table, two per
    byte, in VNNI blocks (compact scales as the file has them); the kernel looks each code up
    (qmatmul.cpp NL4), so results are GroupInt8Linear's on the table's values, bit for bit, from
    half the code bytes. make_linear takes it only for weights still in the file's blocks, every
    part IQ4_XS, on a CPU that keeps VNNI blocks; if the kernel library then cannot run them
    (check_blocks), the weight goes back to rows of int8 table values."""

    kind = "iq4nl-group"
    packed_int4 = True
    iq4nl = True

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """The table's values (int8 [N, K], the reference form) as packed indices."""
        table = torch.tensor(qmatmul.IQ4NL_VALUES, dtype=torch.int16)
        idx = torch.searchsorted(table, q.to(torch.int16).contiguous()).clamp(max=15)
        if not torch.equal(table[idx], q.to(torch.int16)):
            raise ValueError("IQ4_XS codes must be values of the IQ4_NL table")
        return qmatmul.pack_int4_rows(idx)

    def _codes(self, packed_rows: torch.Tensor) -> torch.Tensor:
        if not self.packed_int4:  # (back in rows as int8 values: check_blocks)
            return packed_rows
        table = torch.tensor(qmatmul.IQ4NL_VALUES, dtype=torch.int8)
        return table[qmatmul.unpack_int4_rows(packed_rows).long()]

    def check_blocks(self) -> bool:
        moved = super().check_blocks()
        if moved:  # no kernel reads table indices in rows: the int8 kernel on the table's values
            self.q = self._codes(self.q).contiguous()
            self.packed_int4 = False
        return moved


class GroupQ6PlanesLinear(GroupInt8Linear):
    """Q6_K kept at its file's bits: each code + 32 as a 4-bit and a 2-bit plane in VNNI blocks
    (compact scales as the file has them; `VnniBlocks.planes6`), the kernel forming the int8
    codes' pairs (qmatmul.cpp I6): GroupInt8Linear's results, bit for bit, at 0.82 bytes per
    weight against 1.07. make_linear takes it only for weights still in the file's blocks, every
    part Q6_K, on a CPU that keeps VNNI blocks; if the library then cannot run them
    (check_blocks), the weight goes back to rows of int8 codes."""

    kind = "q6planes-group"
    planes6 = True

    def check_blocks(self) -> bool:
        moved = super().check_blocks()  # (rows of int8 codes: VnniBlocks.rows)
        if moved:
            self.planes6 = False
        return moved


class GroupQ5PlanesLinear(GroupInt8Linear):
    """Q5_0 / Q5_1 / Q5_K kept at their file's bits: each code's low 4 bits as a 4-bit plane and
    its fifth bit as a 1-bit plane in VNNI blocks (scales as the file has them: compact for Q5_K,
    float16 for Q5_0 / Q5_1; `VnniBlocks.planes5`), the kernel forming the int8 codes' pairs
    (qmatmul.cpp I5, and I5S for Q5_0's signed codes): GroupInt8Linear's results, bit for bit, at
    0.625 bytes per code against 1. make_linear takes it only for weights still in the file's
    blocks, every part Q5_0 or every part Q5_1 / Q5_K, on a CPU that keeps VNNI blocks, K a
    multiple of 32; if the library then cannot run them (check_blocks), the weight goes back to
    rows of int8 codes."""

    kind = "q5planes-group"
    planes5 = True

    def __init__(self, w: GroupAffine, dtype: torch.dtype, scratch: DequantScratch) -> None:
        self.planes5_signed = isinstance(w, GGUFBlocks) and w.q5_planes == "signed"
        super().__init__(w, dtype, scratch)

    def check_blocks(self) -> bool:
        moved = super().check_blocks()  # (rows of int8 codes: VnniBlocks.rows)
        if moved:
            self.planes5 = False
        return moved


class RowBlocks(list):
    """Weights fused row-wise whose parts stay in their own formats (Ops.fuse, when the parts'
    group sizes or code widths differ): make_linear gives them a StackedLinear."""


class StackedLinear:
    """One fused weight (q/k/v, gate/up) whose row blocks are kept at their own formats: a
    Q4_K_M file's Q4_K q and k with its Q6_K v, each on its own packed kernel, writing its columns
    of the one output. A row's outputs are what each block gives that row alone, so stacking
    changes no bits; the fused decode step runs the same blocks (decode_step.cpp, kind 5)."""

    kind = "stacked"
    blocks = None  # (each part has its own)

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("row blocks of one linear must share their input width")
        self.out_features = sum(p.out_features for p in parts)
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.out_features)
        self._cols = [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def __call__(self, x: torch.Tensor, decode_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype) if out is None else out
        for part, cols in zip(self.parts, self._cols):
            part(x, decode_rows, out=y[:, cols])
        return y

    def check_blocks(self) -> bool:
        return any([p.check_blocks() for p in self.parts])  # (a list: every part settles)

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        w = torch.cat([p.dense() for p in self.parts])
        return w if out is None else out.copy_(w)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def make_linear(weight: torch.Tensor | GroupAffine | RowBlocks, dtype: torch.dtype, scratch: DequantScratch):
    """The layer for one (possibly fused) weight: packed when it came packed, else dense."""
    if isinstance(weight, RowBlocks):
        return StackedLinear([make_linear(w, dtype, scratch) for w in weight])
    if isinstance(weight, GroupAffine):
        if isinstance(weight, GGUFBlocks) and weight.iq4_xs and \
                qmatmul.vnni_blocks_fit(weight.shape[0], weight.shape[1], weight.group):
            return GroupIQ4NLLinear(weight, dtype, scratch)
        if isinstance(weight, GGUFBlocks) and weight.q6_k and qmatmul.QMATMUL.settle() is None and \
                qmatmul.vnni_blocks_fit(weight.shape[0], weight.shape[1], weight.group):
            return GroupQ6PlanesLinear(weight, dtype, scratch)
        if isinstance(weight, GGUFBlocks) and weight.q5_planes and weight.shape[1] % 32 == 0 and \
                qmatmul.QMATMUL.settle() is None and \
                qmatmul.vnni_blocks_fit(weight.shape[0], weight.shape[1], weight.group):
            return GroupQ5PlanesLinear(weight, dtype, scratch)
        if weight.bits == 4 and weight.group % 32 == 0:
            return GroupInt4Linear(weight, dtype, scratch)
        return GroupInt8Linear(weight, dtype, scratch)
    return DenseLinear(weight, dtype)


_ZERO_OFFSET_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K"})
_GROUP_16_TYPES = frozenset({"Q6_K", "Q2_K", "Q3_K"})
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_COMPACT_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})  # (qmatmul.COMPACT_GGML_TYPES)
_HALF_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})  # (qmatmul.HALF_GGML_TYPES)


def _vnni_cpu() -> bool:
    """Whether weights are kept in VNNI blocks here (the kernels' own answer for a common shape)."""
    return qmatmul.vnni_blocks_fit(16, 256, 32)


def resident_bytes_per_weight(type_name: str) -> float | None:
    """Bytes per weight kvshare holds for a 2-D GGUF tensor of this type with
    quantization='auto' (what make_linear builds), or None for types it dequantizes to dense."""
    from kvshare.model.gguf_quants import GROUP_AFFINE_TYPES

    if type_name not in {t.name for t in GROUP_AFFINE_TYPES}:
        return None
    group = 16 if type_name in _GROUP_16_TYPES else 32
    arrays = 2 if type_name in _ZERO_OFFSET_TYPES else 1  # scales (+ offsets)
    code = 0.5 if type_name in _INT4_TYPES else 1  # 4-bit codes two per byte, else one int8
    if type_name == "IQ4_XS" and _vnni_cpu():
        code = 0.5  # (its table indices two per byte: GroupIQ4NLLinear)
    if type_name == "Q6_K" and _vnni_cpu():
        code = 0.75  # (a 4-bit and a 2-bit plane: GroupQ6PlanesLinear)
    if type_name in ("Q5_0", "Q5_1", "Q5_K") and _vnni_cpu():
        code = 0.625  # (a 4-bit and a 1-bit plane: GroupQ5PlanesLinear)
    if type_name in _COMPACT_TYPES and _vnni_cpu():
        # VNNI blocks with compact scales: an int8 code per group, a float16 base per 256
        return code + arrays * (1 / group + 2 / qmatmul.COMPACT_SUPER_BLOCK)
    if type_name in _HALF_TYPES and _vnni_cpu():
        # VNNI blocks with float16 scales (Q4_0: no zeros, each -8 x its scale)
        return code + (1 if type_name == "Q4_0" else arrays) * 2 / group
    return code + arrays * 4 / group  # a float32 per group
