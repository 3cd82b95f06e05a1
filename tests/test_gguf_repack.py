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


@pytest.mark.parametrize("qtypes", [(QT.Q4_K, QT.Q4_K, QT.Q4_K), (QT.Q5_0, QT.Q5_0, QT.Q5_0),
                                    (QT.Q5_1, QT.Q5_K, QT.Q5_1), (QT.Q2_K, QT.Q3_K, QT.Q2_K),
                                    (QT.Q4_0, QT.Q4_1, QT.Q4_K)],
                         ids=lambda ts: "+".join(t.name for t in ts))
def test_repack_fused_parts(qtypes):
    """A fused q/k/v of one or several formats (GroupAffine.cat's rules), with parts of 24, 24 and
    16 rows so that VNNI blocks straddle them: as the reference concatenation. (Q5_0 with Q8_0,
    or Q5_1 with Q5_0, stay row blocks: test_q5_parts_fuse_by_signedness.)"""
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


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
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


needs_vnni = pytest.mark.skipif(not qmatmul.vnni_blocks_fit(16, 256, 32), reason="no AVX-512 VNNI")


def _iq4_xs_layouts(n: int, k: int, seed: int) -> dict[str, qmatmul.VnniBlocks]:
    """One random IQ4_XS weight as VNNI blocks of 4-bit table indices ("nl4", compact and full
    scales) and of its table values widened to int8 codes ("int8", the reference path)."""
    raw = raw_rows(QT.IQ4_XS, n, k // 256, seed=seed)
    lazy = GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (n, k))
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    out = {}
    for form in ("compact", "full"):
        q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, 32, False, True, True, form)
        assert q.dtype == torch.uint8 and q.numel() == n * k // 2
        out[f"nl4-{form}"] = qmatmul.VnniBlocks(q, s, None, n, k, 32, True, form, iq4nl=True)
    q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, 32, False, False, True, "compact")
    out["int8"] = qmatmul.VnniBlocks(q, s, None, n, k, 32, False, "compact")
    return out


@needs_vnni
def test_iq4_xs_table_indices_give_the_widened_bits():
    """IQ4_XS kept as 4-bit table indices (looked up in the kernel) against its table values
    widened to int8 codes: the same output bits on the decode tiles, the panel path and the GEMM
    path, float32 and bfloat16 x, and the same dense weights and rows."""
    n, k = 48, 512
    mats = _iq4_xs_layouts(n, k, seed=7)
    ref = mats["int8"]
    for m in (1, 3, 12, 40):  # decode tiles, the panel path (M > 8), the GEMM path (M > 16)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            want = ref.matmul(x)
            for name in ("nl4-compact", "nl4-full"):
                assert torch.equal(mats[name].matmul(x), want), (name, m, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize(torch.empty(n, k, dtype=dtype))
        for name in ("nl4-compact", "nl4-full"):
            assert torch.equal(mats[name].dequantize(torch.empty(n, k, dtype=dtype)), want), (name, dtype)
    # (the indices read back: the reference form's codes are the table's values at them)
    idx = torch.tensor([0, 17, 47])
    q, s, _ = mats["nl4-compact"].rows(idx)
    table = torch.tensor(qmatmul.IQ4NL_VALUES, dtype=torch.int8)
    ref_q, ref_s, _ = ref.rows(idx)
    assert torch.equal(table[qmatmul.unpack_int4_rows(q).long()], ref_q) and torch.equal(s, ref_s)


@needs_vnni
def test_iq4_xs_layer_keeps_indices():
    """make_linear on IQ4_XS blocks: a GroupIQ4NLLinear at ~0.54 bytes per weight (the file:
    0.53) with the outputs, rows and dense copy of the widened layer, bit for bit; fused with
    another format it stays a row block of its own, in the fused decode step as kind 11."""
    from kvshare.model.fused_decode import _linear
    from kvshare.model.ops import Ops
    from kvshare.model.qlinear import GroupInt8Linear, GroupIQ4NLLinear, StackedLinear, resident_bytes_per_weight

    n, k = 48, 512
    raw = raw_rows(QT.IQ4_XS, n, k // 256, seed=8)
    got = make_linear(GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (n, k)), torch.float32, DequantScratch())
    want = make_linear(to_group_affine(raw, QT.IQ4_XS, (n, k)), torch.float32, DequantScratch())
    assert type(got) is GroupIQ4NLLinear and type(want) is GroupInt8Linear
    assert got.blocks.iq4nl and got.blocks.scale_form == "compact"
    assert got.nbytes / (n * k) == pytest.approx(resident_bytes_per_weight("IQ4_XS")) == 0.5 + 1 / 32 + 2 / 256
    for m in (1, 3, 12, 40):
        x = torch.randn(m, k)
        assert torch.equal(got(x, decode_rows=m), want(x, decode_rows=m)), m
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(got.rows(ids), want.rows(ids))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(got.dense(torch.empty(n, k, dtype=dtype)), want.dense(torch.empty(n, k, dtype=dtype)))
    assert _linear(got, None).kind == 11 and _linear(want, None).kind == 3  # (the group form: full scales)
    # A Q4_K_M-style mix (IQ4_XS q and k, Q5_K v): row blocks, the IQ4_XS part still indices.
    v = GGUFBlocks.of_tensor(raw_rows(QT.Q5_K, 16, 2, seed=9), QT.Q5_K, (16, k))
    fused = make_linear(Ops.fuse([GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (n, k)), v]), torch.float32, DequantScratch())
    assert type(fused) is StackedLinear and type(fused.parts[0]) is GroupIQ4NLLinear
    x = torch.randn(3, k)
    assert torch.equal(fused(x, decode_rows=3)[:, :n], want(x, decode_rows=3))


def test_iq4_xs_indices_refuse_rows_kernel():
    raw = raw_rows(QT.IQ4_XS, 16, 1)
    lazy = GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (16, 256))
    q, s, z, form = lazy.repack(True, False)  # (rows: indices two per byte, full scales)
    assert q.shape == (16, 128) and form == "full"
    table = torch.tensor(qmatmul.IQ4NL_VALUES, dtype=torch.int8)
    assert torch.equal(table[qmatmul.unpack_int4_rows(q).long()], lazy.q)
    with pytest.raises(ValueError, match="VNNI blocks"):
        qmatmul._call_group_matmul("kvs_nl4_group_matmul", torch.randn(1, 256), q, s, z, 16, 32, None, "auto",
                                   layout=0)


@needs_vnni
def test_iq4_xs_indices_go_back_to_int8_rows(monkeypatch):
    """If the library cannot run VNNI blocks after all (check_blocks), an IQ4_XS layer kept as
    table indices goes back to rows of its table values (no kernel reads indices in rows)."""
    from kvshare.model.fused_decode import _linear

    n, k = 32, 256
    raw = raw_rows(QT.IQ4_XS, n, 1, seed=12)
    ref = to_group_affine(raw, QT.IQ4_XS, (n, k))
    lin = make_linear(GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (n, k)), torch.float32, DequantScratch())
    monkeypatch.setattr(qmatmul.QMATMUL.lib(), "kvs_qmm_vnni_blocks_fit", lambda *a: 0)
    assert lin.check_blocks() and lin.blocks is None
    assert lin.q.dtype == torch.int8 and torch.equal(lin.q, ref.q) and torch.equal(lin.scale, ref.scale)
    x = torch.randn(3, k)
    assert torch.equal(lin(x, decode_rows=3), qmatmul.int8_group_matmul(x, ref.q, ref.scale, None, 32))
    assert _linear(lin, None).kind == 1


@needs_vnni
@pytest.mark.parametrize("k", [256, 512])
def test_q6_k_planes_give_the_int8_bits(k):
    """Q6_K kept as a 4-bit and a 2-bit plane (qmatmul.cpp I6) against its int8 codes in VNNI
    blocks: the same output bits on the decode tiles, the panel and the GEMM paths (float32 and
    bfloat16 x, compact and full scales), the same dense weights, the int8 codes read back."""
    n = 48
    raw = raw_rows(QT.Q6_K, n, k // 256, seed=21)
    lazy = GGUFBlocks.of_tensor(raw, QT.Q6_K, (n, k))
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    q8, s8, _ = qmatmul.repack_gguf_rows(runs, n, k, 16, False, False, True, "compact")
    ref = qmatmul.VnniBlocks(q8, s8, None, n, k, 16, False, "compact")
    mats = {}
    for form in ("compact", "full"):
        q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, 16, False, False, True, form, planes6=True)
        assert q.numel() == n * k * 3 // 4
        mats[form] = qmatmul.VnniBlocks(q, s, None, n, k, 16, False, form, planes6=True)
    for m in (1, 3, 12, 40):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            want = ref.matmul(x)
            for form, b in mats.items():
                assert torch.equal(b.matmul(x), want), (form, m, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize(torch.empty(n, k, dtype=dtype))
        for form, b in mats.items():
            assert torch.equal(b.dequantize(torch.empty(n, k, dtype=dtype)), want), (form, dtype)
    idx = torch.tensor([0, 17, 47])
    q, s, _ = mats["compact"].rows(idx)
    assert torch.equal(q, lazy.q[idx]) and torch.equal(s, ref.rows(idx)[1])


@needs_vnni
def test_q6_k_layer_keeps_planes(monkeypatch):
    """make_linear on Q6_K blocks: a GroupQ6PlanesLinear at the file's 0.82 bytes per weight with
    the widened layer's outputs, rows and dense copy, fused decode kind 13; back to int8 rows if
    the library cannot run VNNI blocks."""
    from kvshare.model.fused_decode import _linear
    from kvshare.model.qlinear import GroupInt8Linear, GroupQ6PlanesLinear, resident_bytes_per_weight

    n, k = 48, 512
    raw = raw_rows(QT.Q6_K, n, 2, seed=22)
    got = make_linear(GGUFBlocks.of_tensor(raw, QT.Q6_K, (n, k)), torch.float32, DequantScratch())
    want = make_linear(to_group_affine(raw, QT.Q6_K, (n, k)), torch.float32, DequantScratch())
    assert type(got) is GroupQ6PlanesLinear and type(want) is GroupInt8Linear
    assert got.nbytes / (n * k) == pytest.approx(resident_bytes_per_weight("Q6_K")) == 0.75 + 1 / 16 + 2 / 256
    assert 0.75 + 1 / 16 + 2 / 256 == 210 / 256  # (the file's bytes per weight)
    for m in (1, 3, 12, 40):
        x = torch.randn(m, k)
        assert torch.equal(got(x, decode_rows=m), want(x, decode_rows=m)), m
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(got.rows(ids), want.rows(ids))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(got.dense(torch.empty(n, k, dtype=dtype)), want.dense(torch.empty(n, k, dtype=dtype)))
    assert _linear(got, None).kind == 13
    ref = to_group_affine(raw, QT.Q6_K, (n, k))
    back = make_linear(GGUFBlocks.of_tensor(raw, QT.Q6_K, (n, k)), torch.float32, DequantScratch())
    monkeypatch.setattr(qmatmul.QMATMUL.lib(), "kvs_qmm_vnni_blocks_fit", lambda *a: 0)
    assert back.check_blocks() and back.blocks is None and torch.equal(back.q, ref.q.to(torch.int8))
    assert _linear(back, None).kind == 1
    x = torch.randn(3, k)
    assert torch.equal(back(x, decode_rows=3), qmatmul.int8_group_matmul(x, back.q, ref.scale, None, 16))


Q5_TYPES = (QT.Q5_0, QT.Q5_1, QT.Q5_K)


def _q5_layouts(qtype: QT, n: int, k: int, seed: int) -> tuple[GGUFBlocks, qmatmul.VnniBlocks, dict]:
    """One random weight of a 5-bit format: its blocks, its int8 codes in VNNI blocks with the
    file's scale form (the reference path), and its 5-bit planes with the file's and the full
    scale form."""
    raw = raw_rows(qtype, n, k // gguf.GGML_QUANT_SIZES[qtype][0], seed=seed)
    lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k))
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    has_zero, file_form = qtype != QT.Q5_0, "compact" if qtype == QT.Q5_K else "half"
    q8, s8, z8 = qmatmul.repack_gguf_rows(runs, n, k, 32, has_zero, False, True, file_form)
    ref = qmatmul.VnniBlocks(q8, s8, z8, n, k, 32, False, file_form)
    mats = {}
    for form in (file_form, "full"):
        q, s, z = qmatmul.repack_gguf_rows(runs, n, k, 32, has_zero, False, True, form, planes5=True)
        assert q.dtype == torch.uint8 and q.numel() == n * k * 5 // 8
        mats[form] = qmatmul.VnniBlocks(q, s, z, n, k, 32, False, form, planes5=True,
                                        planes5_signed=qtype == QT.Q5_0)
    return lazy, ref, mats


@needs_vnni
@pytest.mark.parametrize("qtype", Q5_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k_blocks", [1, 3, 9])  # (Q5_0 / Q5_1: K = 32 .. 288, 1152 below; Q5_K: 256 .. 2304)
def test_q5_planes_give_the_int8_bits(qtype, k_blocks):
    """Q5_0 / Q5_1 / Q5_K kept as a 4-bit and a 1-bit plane (qmatmul.cpp I5, I5S) against their
    int8 codes in VNNI blocks: the same output bits on the decode tiles, the panel and the GEMM
    paths (ragged row counts, float32 and bfloat16 x, the file's and full scales), the same dense
    weights, the int8 codes read back; every code of the format's range occurs."""
    n, k = 48, k_blocks * gguf.GGML_QUANT_SIZES[qtype][0]
    lazy, ref, mats = _q5_layouts(qtype, n, k, seed=30 + k_blocks)
    lo, hi = (-16, 15) if qtype == QT.Q5_0 else (0, 31)
    assert lazy.q.min() >= lo and lazy.q.max() <= hi
    if k_blocks == 9:
        assert set(torch.unique(lazy.q).tolist()) == set(range(lo, hi + 1))
    for m in (1, 3, 8, 12, 23, 40):  # decode tiles (M <= 8), the panel path (to 16), the GEMM path
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            want = ref.matmul(x)
            for form, b in mats.items():
                assert torch.equal(b.matmul(x), want), (form, m, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        want = ref.dequantize(torch.empty(n, k, dtype=dtype))
        for form, b in mats.items():
            assert torch.equal(b.dequantize(torch.empty(n, k, dtype=dtype)), want), (form, dtype)
    idx = torch.tensor([0, 17, 47])
    for b in mats.values():
        q, s, z = b.rows(idx)
        rq, rs, rz = ref.rows(idx)
        assert torch.equal(q, lazy.q[idx].to(torch.int8)) and torch.equal(q, rq) and torch.equal(s, rs)
        assert (z is None) == (rz is None) and (z is None or torch.equal(z, rz))


@needs_vnni
def test_q5_0_planes_at_gemma_width():
    """Q5_0 at K = 1152 (Gemma-3-1B's hidden: not a multiple of 256, so llama-quantize falls back
    to Q5_0 for its ffn_gate / up), many rows: the planes' bits are the int8 codes'."""
    n, k = 96, 1152
    _, ref, mats = _q5_layouts(QT.Q5_0, n, k, seed=40)
    for m in (1, 5, 16, 70):
        x = torch.randn(m, k)
        want = ref.matmul(x)
        assert all(torch.equal(b.matmul(x), want) for b in mats.values()), m


def test_q5_planes_refuse_what_they_cannot_take():
    raw = raw_rows(QT.Q5_0, 16, 8)
    runs = [(p.row_addresses(), int(p.qtype)) for p in GGUFBlocks.of_tensor(raw, QT.Q5_0, (16, 256)).parts]
    with pytest.raises(ValueError, match="VNNI blocks only"):
        qmatmul.repack_gguf_rows(runs, 16, 256, 32, False, False, False, planes5=True)
    q6 = raw_rows(QT.Q6_K, 16, 1)
    runs6 = [(p.row_addresses(), int(p.qtype)) for p in GGUFBlocks.of_tensor(q6, QT.Q6_K, (16, 256)).parts]
    with pytest.raises(ValueError, match="5-bit planes"):
        qmatmul.repack_gguf_rows(runs6, 16, 256, 16, False, False, True, planes5=True)
    q51 = raw_rows(QT.Q5_1, 8, 8)
    mixed = [(GGUFBlocks.of_tensor(raw[:8], QT.Q5_0, (8, 256)).parts[0].row_addresses(), int(QT.Q5_0)),
             (GGUFBlocks.of_tensor(q51, QT.Q5_1, (8, 256)).parts[0].row_addresses(), int(QT.Q5_1))]
    with pytest.raises(ValueError, match="signed and unsigned"):
        qmatmul.repack_gguf_rows(mixed, 16, 256, 32, True, False, True, planes5=True)
    with pytest.raises(ValueError, match="VNNI blocks"):
        qmatmul._call_group_matmul("kvs_i5_group_matmul", torch.randn(1, 256), torch.zeros(16, 160, dtype=torch.uint8),
                                   torch.ones(16, 8), None, 16, 32, None, "auto", layout=0)


@needs_vnni
@pytest.mark.parametrize("qtype", Q5_TYPES, ids=lambda t: t.name)
def test_q5_layer_keeps_planes(qtype, monkeypatch):
    """make_linear on Q5_0 / Q5_1 / Q5_K blocks: a GroupQ5PlanesLinear at 0.625 bytes per code
    with the widened layer's outputs, rows and dense copy, its fused decode kind; back to int8 rows
    (the same outputs) if the library cannot run VNNI blocks."""
    from kvshare.model.fused_decode import _linear
    from kvshare.model.qlinear import GroupInt8Linear, GroupQ5PlanesLinear, resident_bytes_per_weight

    n, k = 48, 512
    raw = raw_rows(qtype, n, k // gguf.GGML_QUANT_SIZES[qtype][0], seed=50)
    got = make_linear(GGUFBlocks.of_tensor(raw, qtype, (n, k)), torch.float32, DequantScratch())
    want = make_linear(to_group_affine(raw, qtype, (n, k)), torch.float32, DequantScratch())
    assert type(got) is GroupQ5PlanesLinear and type(want) is GroupInt8Linear
    assert got.blocks.planes5 and got.blocks.planes5_signed == (qtype == QT.Q5_0)
    assert got.nbytes / (n * k) == pytest.approx(resident_bytes_per_weight(qtype.name))
    # (the file's bytes per weight: Q5_0 22 / 32, Q5_1 24 / 32, Q5_K 176 / 256)
    scales = {QT.Q5_0: 2 / 32, QT.Q5_1: 4 / 32, QT.Q5_K: 2 * (1 / 32 + 2 / 256)}[qtype]
    assert got.nbytes / (n * k) == 0.625 + scales
    for m in (1, 3, 12, 40):
        x = torch.randn(m, k)
        assert torch.equal(got(x, decode_rows=m), want(x, decode_rows=m)), m
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(got.rows(ids), want.rows(ids))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(got.dense(torch.empty(n, k, dtype=dtype)), want.dense(torch.empty(n, k, dtype=dtype)))
    assert _linear(got, None).kind == {QT.Q5_0: 19, QT.Q5_1: 16, QT.Q5_K: 15}[qtype]
    ref = to_group_affine(raw, qtype, (n, k))
    back = make_linear(GGUFBlocks.of_tensor(raw, qtype, (n, k)), torch.float32, DequantScratch())
    monkeypatch.setattr(qmatmul.QMATMUL.lib(), "kvs_qmm_vnni_blocks_fit", lambda *a: 0)
    assert back.check_blocks() and back.blocks is None and torch.equal(back.q, ref.q.to(torch.int8))
    assert _linear(back, None).kind == 1
    x = torch.randn(3, k)
    assert torch.equal(back(x, decode_rows=3), qmatmul.int8_group_matmul(x, back.q, back.scale, back.zero, 32))


@needs_vnni
def test_q5_parts_fuse_by_signedness():
    """Q5_K and Q5_1 parts (unsigned codes) fuse into one planes weight; a Q5_0 part (signed)
    beside them makes row blocks, each keeping its planes, the outputs those of the parts."""
    from kvshare.model.ops import Ops
    from kvshare.model.qlinear import GroupQ5PlanesLinear, StackedLinear

    k = 256
    a = GGUFBlocks.of_tensor(raw_rows(QT.Q5_K, 16, 1, seed=60), QT.Q5_K, (16, k))
    b = GGUFBlocks.of_tensor(raw_rows(QT.Q5_1, 32, 8, seed=61), QT.Q5_1, (32, k))
    c = GGUFBlocks.of_tensor(raw_rows(QT.Q5_0, 16, 8, seed=62), QT.Q5_0, (16, k))
    one = make_linear(Ops.fuse([a, b]), torch.float32, DequantScratch())
    assert type(one) is GroupQ5PlanesLinear and not one.blocks.planes5_signed and one.blocks.scale_form == "full"
    with pytest.raises(ValueError, match="fuse only with their own format"):
        GroupAffine.cat([c, GGUFBlocks.of_tensor(raw_rows(QT.Q8_0, 16, 8, seed=63), QT.Q8_0, (16, k))])
    rows = make_linear(Ops.fuse([a, b, c]), torch.float32, DequantScratch())
    assert type(rows) is StackedLinear and [type(p) for p in rows.parts] == [GroupQ5PlanesLinear] * 3
    x = torch.randn(5, k)
    want = torch.cat([make_linear(GroupAffine.cat([p.materialize() for p in (a, b)]), torch.float32,
                                  DequantScratch())(x, decode_rows=5),
                      make_linear(c.materialize(), torch.float32, DequantScratch())(x, decode_rows=5)], dim=1)
    assert torch.equal(one(x, decode_rows=5), want[:, :48])
    assert torch.equal(rows(x, decode_rows=5), want)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(64, 4096), (48, 768), (40, 512)])
def test_vector_repack_equals_scalar(qtype, n, k):
    """The AVX-512 repack (whole 16-row spans of Q4_K's codes and Q5_K's and Q6_K's planes in VNNI
    blocks with compact scales) writes the scalar path's bytes, and Q4_K's the reference's; with float16 bases
    that are subnormal, NaN or (Q4_K) zero in some blocks (their codes go through the checked path), and
    an infinite one under a non-zero code (no compact form: both paths refuse the weight). n = 40:
    runs that end inside a span (the scalar path takes those rows)."""
    int4, planes5, planes6 = qtype == QT.Q4_K, qtype == QT.Q5_K, qtype == QT.Q6_K
    zeros, group = not planes6, 16 if planes6 else 32
    raw = raw_rows(qtype, n, k // 256, seed=70 + n)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(71)
    blocks = raw.reshape(n, k // 256, size)
    at = (208,) if planes6 else (0,)  # d (Q4_K, Q5_K: then dmin at 2)
    # subnormal and NaN bases keep a compact form (NaN's code is 0), so do zero ones under Q4_K's
    # unsigned codes (not under Q6_K's negative ones: -0 is no code times +0); an infinite one with
    # a non-zero code has none
    odd = np.array([0x0001, 0x83FF, 0x7E00, 0xFE01] + ([] if planes6 else [0x0000, 0x8000]), dtype=np.uint16)
    for r, b in zip(rng.integers(0, n, 12), rng.integers(0, k // 256, 12)):
        off = at[0] + (0 if planes6 else 2 * int(rng.integers(0, 2)))
        blocks[r, b, off:off + 2] = odd[rng.integers(0, len(odd))].reshape(1).view(np.uint8)
    for inf in (False, True):
        if inf:
            blocks[n - 1, 0, at[0]:at[0] + 2] = np.array([0x7C00], dtype=np.uint16).view(np.uint8)
            blocks[n - 1, 0, 192 if planes6 else 4] = 5  # (a non-zero scale code under it)
        lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k))
        runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
        if n % 16 == 0:
            out = {}
            for impl in ("scalar", "auto"):
                try:
                    out[impl] = qmatmul.repack_gguf_rows(runs, n, k, group, zeros, int4, True, "compact", planes6,
                                                         planes5, impl=impl)
                except ValueError as e:
                    out[impl] = str(e)
            if inf:
                assert out["auto"] == out["scalar"] and "compact" in out["scalar"]
            else:
                assert not isinstance(out["scalar"], str), out["scalar"]
                for a, b in zip(out["scalar"], out["auto"]):
                    assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))
    # without the odd bases: every block takes the fast codes, against the reference
    raw = raw_rows(qtype, n, k // 256, seed=72 + n)
    lazy = GGUFBlocks.of_tensor(raw, qtype, (n, k))
    if n % 16:  # (a run of 40 rows then one of 24: spans across the runs' border)
        parts = [GGUFBlocks.of_tensor(raw[:40], qtype, (40, k)),
                 GGUFBlocks.of_tensor(raw_rows(qtype, 24, k // 256, 73), qtype, (24, k))]
        lazy, n = GroupAffine.cat(parts), 64
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    got = {impl: qmatmul.repack_gguf_rows(runs, n, k, group, zeros, int4, True, "compact", planes6, planes5,
                                     impl=impl)
           for impl in ("scalar", "auto")}
    for a, b in zip(got["scalar"], got["auto"]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    if int4:  # (the planes against the reference: test_q6_k_planes_give_the_int8_bits, test_q5_planes_...)
        assert_same((*got["auto"], "compact"), reference(lazy.materialize(), True))


@pytest.mark.parametrize("n,k", [(64, 2048), (40, 512)])
def test_vector_repack_iq4_xs_equals_scalar(n, k):
    """The AVX-512 repack of IQ4_XS's 4-bit table indices in VNNI blocks with compact scales writes
    the scalar path's bytes; with zero, subnormal and NaN bases the same bytes or the same refusal
    (a zero base under a negative scale); n = 40: runs of 40 and 24."""
    raw = raw_rows(QT.IQ4_XS, n, k // 256, seed=90 + n)
    blocks = raw.reshape(n, k // 256, 136)
    odd = np.array([0x0000, 0x8000, 0x0001, 0x7E00], dtype=np.uint16).view(np.uint8).reshape(4, 2)
    for t, r in enumerate(range(0, n, 11)):
        blocks[r, t % (k // 256), 0:2] = odd[t % 4]
    lazy = GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (n, k))
    if n % 16:
        lazy = GroupAffine.cat([lazy, GGUFBlocks.of_tensor(raw_rows(QT.IQ4_XS, 24, k // 256, seed=91), QT.IQ4_XS,
                                                           (24, k))])
        n = 64
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    out = {}
    for impl in ("scalar", "auto"):
        try:
            out[impl] = qmatmul.repack_gguf_rows(runs, n, k, 32, False, True, True, "compact", impl=impl)
        except ValueError as e:
            out[impl] = str(e)
    if isinstance(out["scalar"], str):
        assert out["auto"] == out["scalar"]
    else:
        for a, b in zip(out["scalar"], out["auto"]):
            assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))
    # and without the odd bases, never refused
    raw = raw_rows(QT.IQ4_XS, 64, k // 256, seed=92)
    runs = [(p.row_addresses(), int(p.qtype)) for p in GGUFBlocks.of_tensor(raw, QT.IQ4_XS, (64, k)).parts]
    a, b = (qmatmul.repack_gguf_rows(runs, 64, k, 32, False, True, True, "compact", impl=impl)
            for impl in ("scalar", "auto"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] is None and b[2] is None


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(64, 1152), (48, 288), (40, 256)])
def test_vector_repack_q5_planes_equals_scalar(qtype, n, k):
    """The AVX-512 repack of Q5_0 / Q5_1 planes in VNNI blocks with float16 scales (whole 16-row
    spans; K = 288: lines left over after the 16-line transposes) writes the scalar path's bytes;
    n = 40: a run of 40 rows and one of 24, spans across their border."""
    lazy = GGUFBlocks.of_tensor(raw_rows(qtype, n, k // 32, seed=80 + n), qtype, (n, k))
    if n % 16:
        lazy = GroupAffine.cat([lazy, GGUFBlocks.of_tensor(raw_rows(qtype, 24, k // 32, seed=81), qtype, (24, k))])
        n = 64
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    got = {impl: qmatmul.repack_gguf_rows(runs, n, k, 32, qtype == QT.Q5_1, False, True, "half", planes5=True,
                                          impl=impl) for impl in ("scalar", "auto")}
    for a, b in zip(got["scalar"], got["auto"]):
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))
    assert (got["auto"][2] is None) == (qtype == QT.Q5_0)
