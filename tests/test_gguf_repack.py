"""The C++ repack of GGUF blocks (csrc/gguf_repack.cpp) against the Python reference path: for
every format, the packed codes, scales and zeros, in rows and in VNNI blocks, are the arrays
gguf_quants.to_group_affine + qlinear's packing + qmatmul.to_vnni_blocks give, bit for bit (scales
compared as their float32 bit patterns, so even a zero's sign counts)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_loader import random_blocks

from kvshare.model.gguf_quants import GROUP_AFFINE_FORMS, GGUFBlocks, GroupAffine, to_group_affine
from kvshare.model.kernels import qmatmul
from kvshare.model.qlinear import DequantScratch, make_linear

pytestmark = pytest.mark.skipif(not qmatmul.QMATMUL.wait_until_built(), reason="no C++ compiler")

# The formats gguf.quants can quantize to; the others (K-quants, IQ4_XS) are laid out by hand.
QUANTIZABLE = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)
INT4 = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})


def raw_rows(qtype: QT, n: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, bytes per row] of random blocks of `qtype`."""
    rng = np.random.default_rng(seed)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype in QUANTIZABLE:
        w = (rng.standard_normal((n, blocks_per_row * block)) * rng.uniform(0.01, 2, (n, 1))).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    return random_blocks(qtype, n, blocks_per_row, rng)


def reference(w: GroupAffine, vnni: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What qlinear builds from a weight in group form without the C++ repack."""
    int4 = w.bits == 4
    q = qmatmul.pack_int4_rows(w.q) if int4 else w.q.to(torch.int8).contiguous()
    scale = w.scale.float().contiguous()
    zero = None if w.zero is None else w.zero.float().contiguous()
    if vnni:
        b = qmatmul.to_vnni_blocks(q, scale, zero, w.group, int4)
        return b.q, b.scales, b.zeros
    return q, scale, zero


def full_layout(got):
    """A repack's (q, scales, zeros[, compact]) with compact scales and zeros (VNNI blocks of
    K-quant weights) expanded to the full layout's float32 [N / 16, K / g, 16]."""
    if len(got) == 3:
        return got
    q, s, z, form = got
    if form == "full":
        return q, s, z
    n = q.shape[0] * 16
    k = q.shape[1] * 4 * (2 if q.dtype == torch.uint8 else 1)
    if form == "half":
        g = 32 * k // s.shape[1]  # bytes per block: 32 * (K / g)
    else:
        g = 16 * k // (s.shape[1] - 32 * (k // 256))  # bytes per block: 16 * (K / g) + 32 * (K / 256)
    blocks = qmatmul.VnniBlocks(q, s, z, n, k, g, q.dtype == torch.uint8, form)
    return q, blocks._expanded(s), None if z is None else blocks._expanded(z)


def assert_same(got, want) -> None:
    (gq, gs, gz), (wq, ws, wz) = full_layout(got), full_layout(want)
    if gz is None and wz is not None and len(got) == 4 and got[3] == "half":
        gz = gs * qmatmul.Q4_0_ZERO_MUL  # (Q4_0 in float16 scales: the kernel forms each zero)
    assert gq.dtype == wq.dtype and torch.equal(gq, wq)
    assert gs.shape == ws.shape and torch.equal(gs.view(torch.int32), ws.view(torch.int32))
    assert (gz is None) == (wz is None)
    if wz is not None:
        assert gz.shape == wz.shape and torch.equal(gz.view(torch.int32), wz.view(torch.int32))


@pytest.mark.parametrize("qtype", sorted(GROUP_AFFINE_FORMS, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("n", [16, 48, 7, 40])
def test_repack_equals_reference(qtype, n):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks_per_row = 2 if block == 256 else 5
    raw = raw_rows(qtype, n, blocks_per_row)
    k = blocks_per_row * block
    ref = to_group_affine(raw, qtype, (n, k))
    lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k))
    assert (lazy.group, lazy.bits, lazy.code_dtype, lazy.has_zero) == \
        (ref.group, ref.bits, ref.q.dtype, ref.zero is not None)
    for vnni in (False, True) if n % 16 == 0 else (False,):
        assert_same(lazy.repack(qtype in INT4, vnni), reference(ref, vnni))
    # Not the int4 layout: int8 codes one per byte, for every format.
    assert_same(lazy.repack(False, False), (ref.q.to(torch.int8), ref.scale, ref.zero))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_0], ids=lambda t: t.name)
def test_repack_permuted_and_sliced_rows(qtype):
    """Rows picked and reordered (llama's q/k un-permute) and sliced (a tensor-parallel shard) read
    the rows the reference reads."""
    n, bpr = 64, 256 // gguf.GGML_QUANT_SIZES[qtype][0] * 2
    raw = raw_rows(qtype, n, bpr, seed=1)
    k = bpr * gguf.GGML_QUANT_SIZES[qtype][0]
    perm = np.random.default_rng(2).permutation(n)
    lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k), perm)
    ref = to_group_affine(raw[perm], qtype, (n, k))
    for vnni in (False, True):
        assert_same(lazy.repack(qtype in INT4, vnni), reference(ref, vnni))
    part = lazy.row_slice(16, 48)
    assert part.shape == (32, k)
    assert_same(part.repack(qtype in INT4, True), reference(ref.row_slice(16, 48), True))
    assert torch.equal(part.dequantize(), ref.dequantize()[16:48])


@pytest.mark.parametrize("qtypes", [(QT.Q4_K, QT.Q4_K, QT.Q4_K), (QT.Q5_0, QT.Q5_0, QT.Q8_0),
                                    (QT.Q5_1, QT.Q8_0, QT.Q5_0), (QT.Q4_0, QT.Q4_1, QT.Q4_K)],
                         ids=lambda ts: "+".join(t.name for t in ts))
def test_repack_fused_parts(qtypes):
    """A fused q/k/v of one or several formats (GroupAffine.cat's rules), with parts of 24, 24 and
    16 rows so that VNNI blocks straddle them: as the reference concatenation."""
    k = 512
    parts, refs = [], []
    for i, (qtype, n) in enumerate(zip(qtypes, (24, 24, 16))):
        bpr = k // gguf.GGML_QUANT_SIZES[qtype][0]
        raw = raw_rows(qtype, n, bpr, seed=10 + i)
        parts.append(GGUFBlocks.of_tensor(raw, qtype, (n, k)))
        refs.append(to_group_affine(raw, qtype, (n, k)))
    fused, ref = GroupAffine.cat(parts), GroupAffine.cat(refs)
    assert isinstance(fused, GGUFBlocks)
    assert (fused.bits, fused.code_dtype, fused.has_zero) == (ref.bits, ref.q.dtype, ref.zero is not None)
    int4 = ref.bits == 4
    for vnni in (False, True):
        assert_same(fused.repack(int4, vnni), reference(ref, vnni))
    # The reference form on demand (what dequantize, embeddings' rows and TP read).
    assert torch.equal(fused.q, ref.q) and torch.equal(fused.scale, ref.scale)
    # A shard of the fused rows keeps the fused form (int8 codes, zeros), as GroupAffine's does.
    shard = fused.row_slice(30, 46)
    want = ref.row_slice(30, 46)
    assert torch.equal(shard.q, want.q) and shard.q.dtype == want.q.dtype
    assert (shard.zero is None) == (want.zero is None)
    assert_same(shard.repack(int4, True), reference(want, True))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_repack_column_slice(qtype):
    """A tensor-parallel rank's input columns: on block boundaries still the file's blocks (each
    row's bytes of those blocks), elsewhere the reference form's slice; both as the reference."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, bpr = 32, 4
    raw = raw_rows(qtype, n, bpr, seed=5)
    k = bpr * block
    perm = np.random.default_rng(6).permutation(n)
    lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k), perm)
    ref = to_group_affine(raw[perm], qtype, (n, k))
    part = lazy.col_slice(block, 3 * block)
    assert isinstance(part, GGUFBlocks) and part.shape == (n, 2 * block)
    for vnni in (False, True):
        assert_same(part.repack(qtype in INT4, vnni), reference(ref.col_slice(block, 3 * block), vnni))
    g = 32 if block == 256 else 0  # (inside a super-block: on a group boundary only)
    if g:
        inner = lazy.col_slice(g, block + g)
        assert not isinstance(inner, GGUFBlocks)
        want = ref.col_slice(g, block + g)
        assert torch.equal(inner.q, want.q) and torch.equal(inner.scale, want.scale)


def test_mixed_group_sizes_stay_row_blocks():
    k = 512
    a = GGUFBlocks.of_tensor(raw_rows(QT.Q4_K, 16, 2), QT.Q4_K, (16, k))
    b = GGUFBlocks.of_tensor(raw_rows(QT.Q6_K, 16, 2), QT.Q6_K, (16, k))
    with pytest.raises(ValueError):
        GroupAffine.cat([a, b])


def test_every_float16_scale():
    """Every float16 bit pattern as a Q8_0 / Q4_0 block scale (subnormals, infinities, NaNs):
    converted as numpy converts it."""
    for qtype in (QT.Q8_0, QT.Q4_0):
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = np.random.default_rng(3).integers(0, 256, (65536, size), dtype=np.uint8)
        raw[:, 0:2] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(2048, 32 * size)
        k = 32 * 32
        with np.errstate(invalid="ignore"):  # (NaN scales times -8)
            ref = to_group_affine(raw, qtype, (2048, k))
        got = GGUFBlocks.of_tensor(raw, qtype, (2048, k)).repack(qtype in INT4, False)
        assert_same(got, reference(ref, False))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0], ids=lambda t: t.name)
def test_make_linear_from_blocks_equals_reference(qtype):
    """qlinear's layer built from the file's blocks holds the same arrays, and gives the same
    outputs, as one built from the group form."""
    n, bpr = 48, 2 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 16
    k = bpr * gguf.GGML_QUANT_SIZES[qtype][0]
    raw = raw_rows(qtype, n, bpr, seed=4)
    got = make_linear(GGUFBlocks.of_tensor(raw, qtype, (n, k)), torch.float32, DequantScratch())
    want = make_linear(to_group_affine(raw, qtype, (n, k)), torch.float32, DequantScratch())
    assert type(got) is type(want) and (got.blocks is None) == (want.blocks is None)
    # In VNNI blocks the scales keep the file's form: compact for the K-quants (a base per
    # super-block, a code per group), float16 for the rest (Q4_0 without a zeros array); the group
    # form's layer holds them in full. The same values, and every path the same bits.
    form = "full" if got.blocks is None else got.blocks.scale_form
    if got.blocks is not None:
        assert form == ("compact" if qtype in (QT.Q4_K, QT.Q6_K) else "half")
        assert (got.zero is None) == (qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q6_K))
    assert_same((got.q, got.scale, got.zero, form), (want.q, want.scale, want.zero))
    for m in (1, 3, 12, 40):  # decode tiles, the panel path (M > 8), the GEMM path (M > 16)
        x = torch.randn(m, k)
        assert torch.equal(got(x, decode_rows=m), want(x, decode_rows=m)), m
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(got.rows(ids), want.rows(ids))
    for dtype in (torch.float32, torch.bfloat16):  # the prefill scratch's dense copy
        assert torch.equal(got.dense(torch.empty(n, k, dtype=dtype)), want.dense(torch.empty(n, k, dtype=dtype)))
    if form != "full":
        assert got.nbytes < want.nbytes


def test_repack_refuses_what_the_layout_cannot_take():
    raw = raw_rows(QT.Q6_K, 8, 1)
    with pytest.raises(ValueError, match="two per byte"):
        GGUFBlocks.of_tensor(raw, QT.Q6_K, (8, 256)).repack(True, False)
    with pytest.raises(ValueError, match="VNNI"):
        GGUFBlocks.of_tensor(raw, QT.Q6_K, (8, 256)).repack(False, True)
