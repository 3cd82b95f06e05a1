"""Kept-quantized weights: GGUF blocks -> affine group form -> packed kernels, format by format.

Every decoder must reproduce gguf's own dequantization bit for bit (the affine form is the
file's weights, not an approximation). Every kernel must then equal a dense matmul by the
dequantized weights within the arithmetic's rounding:
- float32 activations: float32 accumulation over K terms; |err| <= 1e-5 * sum_k |x_k w_k| + 1e-6.
- bfloat16 activations: scales and offsets stay float32 and the sum is float32, against a
  reference fed the same bfloat16 x; the output is rounded to bfloat16 (2^-9 relative), so with
  m_k = |w_k| + 8|s_k| + |z_k + 8s_k| (bounding |w_k| and the float32 rounding of q s + z):
  |err| <= 2^-8 * sum_k |x_k| m_k + 1e-6.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvshare.model import qlinear
from kvshare.model.gguf_quants import GROUP_AFFINE_TYPES, to_group_affine
from kvshare.model.kernels import qmatmul
from kvshare.model.qlinear import DequantScratch, GroupInt4Linear, make_linear
from test_loader import random_blocks

_QUANTIZABLE = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
_HAND_LAID = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.Q3_K, QT.IQ4_XS]
N, K = 96, 512


def _raw(qtype: QT, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in _QUANTIZABLE:
        x = (rng.standard_normal((n, k)) * rng.uniform(0.05, 2.0, size=(n, 1))).astype(np.float32)
        return gguf.quants.quantize(x, qtype)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, rows=n, blocks_per_row=k // block, rng=rng)


def _reference(raw: np.ndarray, qtype: QT) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", _QUANTIZABLE + _HAND_LAID, ids=lambda q: q.name)
def test_group_affine_form_is_the_files_weights(qtype):
    raw = _raw(qtype)
    w = to_group_affine(raw, qtype, (N, K))
    ref = _reference(raw, qtype)
    assert torch.equal(w.dequantize(), ref)  # bit for bit
    assert ref.abs().max() > 0
    assert qtype in GROUP_AFFINE_TYPES


def _magnitudes(w) -> torch.Tensor:
    """Per weight |w| + 8|s| + |z + 8s|: what the kernels' roundings scale with (see the top)."""
    n, k = w.q.shape
    s = w.scale.double().repeat_interleave(w.group, dim=1)
    z = (w.zero.double() if w.zero is not None else torch.zeros_like(w.scale).double()).repeat_interleave(w.group, 1)
    return w.dequantize().double().abs() + 8 * s.abs() + (z + 8 * s).abs()


def _tolerance(x: torch.Tensor, mags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mag = x.double().abs() @ mags.T
    if dtype == torch.float32:
        return 1e-5 * mag + 1e-6
    return 2.0**-8 * mag + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", _QUANTIZABLE + _HAND_LAID, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, qlinear.PACKED_MAX_ROWS, qlinear.PACKED_MAX_ROWS + 7])
def test_kept_quantized_matmul_equals_dequantized_reference(qtype, dtype, rows):
    if not qmatmul.QMATMUL.wait_until_built():
        pytest.skip(f"kvshare's C++ kernel cannot be built: {qmatmul.QMATMUL.unavailable_reason()}")
    raw = _raw(qtype, seed=rows)
    ref_w = _reference(raw, qtype)
    affine = to_group_affine(raw, qtype, (N, K))
    mags = _magnitudes(affine)
    lin = make_linear(affine, dtype, DequantScratch())
    four_bit = qtype in (QT.Q4_0, QT.Q4_1, QT.Q4_K)
    expected_kind = "int4-group" if four_bit else "int8-group"
    assert lin.kind == expected_kind
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = lin(x)
    assert got.dtype == dtype and got.shape == (rows, N)
    ref = x.double() @ ref_w.double().T
    err = (got.double() - ref).abs()
    assert (err <= _tolerance(x, mags, dtype)).all(), f"max err {err.max().item():.3g}"
    # Embedding rows come out of the same storage, rounded as the kernel rounds.
    ids = torch.tensor([0, 3, N - 1, 17])
    row_err = (lin.rows(ids).double() - ref_w[ids].double()).abs()
    bound = (2.0**-22 if dtype == torch.float32 else 2.0**-7) * mags[ids]
    assert (row_err <= bound).all(), f"max row err {row_err.max().item():.3g}"


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q6_K], ids=lambda q: q.name)
def test_packed_and_scratch_paths_agree(qtype):
    """Decode-sized calls read packed weights, prefill-sized ones a dequantized scratch: the same
    rows must get the same answer either way: up to float32 summation order, plus, for weights in
    VNNI blocks, the int16 rounding of x (half a step of max|x| / 32767 per group times the
    group's sum |w|, as in tests/test_qmatmul.py)."""
    raw = _raw(qtype)
    scratch = DequantScratch()
    qmatmul.QMATMUL.wait_until_built()
    lin = make_linear(to_group_affine(raw, qtype, (N, K)), torch.float32, scratch)
    x = torch.randn(qlinear.PACKED_MAX_ROWS + 8, K)
    big = lin(x)
    small = torch.cat([lin(x[i:i + 4]) for i in range(0, x.shape[0], 4)])
    mags = _magnitudes(to_group_affine(raw, qtype, (N, K)))
    bound = 1e-5 * (x.double().abs() @ mags.T) + 1e-6
    if lin.blocks is not None:
        g = lin.group
        step = x.double().abs().view(x.shape[0], K // g, g).amax(-1) / 32767
        bound = bound + (0.5 + 3 * 32767 * 2.0**-24) * step @ mags.view(N, K // g, g).sum(-1).T
    assert ((big.double() - small.double()).abs() <= bound).all()
    assert scratch.nbytes == N * K * 4  # one layer's worth, reused


def test_dense_formats_stay_dense():
    w = torch.randn(64, 128)
    lin = make_linear(w, torch.bfloat16, DequantScratch())
    assert lin.kind == "dense" and lin.weight.dtype == torch.bfloat16
    assert torch.equal(lin(torch.ones(1, 128, dtype=torch.bfloat16)),
                       torch.nn.functional.linear(torch.ones(1, 128, dtype=torch.bfloat16), w.bfloat16()))


def test_rows_not_a_multiple_of_32_take_kvshares_group_kernel():
    raw = _raw(QT.Q4_0, n=40)
    lin = make_linear(to_group_affine(raw, QT.Q4_0, (40, K)), torch.float32, DequantScratch())
    assert isinstance(lin, GroupInt4Linear) and lin.kind == "int4-group"
    x = torch.randn(3, K)
    ref = x.double() @ _reference(raw, QT.Q4_0).double().T
    assert ((lin(x).double() - ref).abs() <= 1e-5 * ref.abs().max() + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_0, QT.Q8_0, QT.Q6_K, QT.Q5_K], ids=lambda q: q.name)
def test_cpp_dequantization_into_the_scratch_equals_the_files_weights(qtype, dtype):
    """The prefill scratch is filled by one C++ pass (qmatmul.group_dequantize): the file's
    weights, rounded once to the activation dtype (float32: q * s + z may round once more)."""
    assert qmatmul.QMATMUL.wait_until_built(), qmatmul.QMATMUL.unavailable_reason()
    raw = _raw(qtype)
    affine = to_group_affine(raw, qtype, (N, K))
    lin = make_linear(affine, dtype, DequantScratch())
    out = torch.full((N, K), float("nan"), dtype=dtype)
    assert lin.dense(out) is out
    ref = _reference(raw, qtype).double()
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-8
    assert ((out.double() - ref).abs() <= ulp * _magnitudes(affine)).all()
    assert torch.equal(out, lin._affine(slice(None)).to(dtype))  # the PyTorch fallback forms the same


@pytest.mark.parametrize("gemm_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_rows_numbers_depend_on_its_kind_not_on_its_batch(gemm_dtype):
    """Decode rows take the packed kernel however many share the call; prompt rows the dense GEMM
    in the scratch's dtype however few. So a row alone gets what it gets in any batch: bit for bit
    for decode rows (the kernel's per-output order depends on K only) and for bfloat16 GEMMs;
    float32 GEMM libraries pick other kernels for a few rows (float32 rounding apart)."""
    assert qmatmul.QMATMUL.wait_until_built(), qmatmul.QMATMUL.unavailable_reason()
    lin = make_linear(to_group_affine(_raw(QT.Q4_1), QT.Q4_1, (N, K)), torch.float32, DequantScratch(gemm_dtype))
    x = torch.randn(qlinear.PACKED_MAX_ROWS + 44, K, generator=torch.Generator().manual_seed(3))
    decode = 20
    full = lin(x, decode)
    assert torch.equal(full[:decode], lin(x[:decode], decode))
    assert torch.equal(full[5:6], lin(x[5:6], 1))
    assert torch.equal(full[:decode], lin._kernel(x[:decode].contiguous()))  # the packed kernel itself
    ref = x.double() @ lin.dense().double().T
    for m in (1, 3, 64, x.shape[0] - decode):
        alone = lin(x[decode:decode + m], 0)
        if gemm_dtype == torch.bfloat16:
            assert torch.equal(alone, full[decode:decode + m])
        else:
            assert torch.allclose(alone, full[decode:decode + m], rtol=1e-5, atol=1e-5)
    # prompt rows really went through the GEMM in the scratch's dtype (bfloat16: ~2^-8 relative)
    err = ((full[decode:].double() - ref[decode:]).abs().max() / ref.abs().max()).item()
    assert (2**-12 < err < 2**-5) if gemm_dtype == torch.bfloat16 else err < 1e-5, err


def test_without_the_kernel_every_row_takes_the_dense_copy_from_the_first_call(monkeypatch):
    """No kernel library (no compiler, or KVSHARE_DISABLE_CPP_KERNELS): the layer keeps a dense copy
    made when it is built, so a prompt row gets the same bits before and after the first decode
    call (a copy made on that call would switch prompt rows from the bfloat16 scratch GEMM to it
    mid-run: a row's kernel changing with time)."""
    monkeypatch.setattr(qmatmul.QMATMUL, "settle", lambda: "the kernel library is disabled (test)")
    lin = make_linear(to_group_affine(_raw(QT.Q4_1), QT.Q4_1, (N, K)), torch.float32,
                      DequantScratch(torch.bfloat16))
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(5))
    prompt_before = lin(x, 0)
    lin(x[:2], 2)
    prompt_after = lin(x, 0)
    assert torch.equal(prompt_before, prompt_after)
    assert torch.equal(prompt_before, torch.nn.functional.linear(x, lin.dense()))  # the float32 dense copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stacked_row_blocks_equal_each_block_alone(dtype):
    """A fused weight whose parts differ in format (Q4_K q/k, Q6_K v: group 32 4-bit and group 16
    6-bit codes) stays packed as row blocks (Ops.fuse -> qlinear.StackedLinear): each output
    column block is, bit for bit, what its part gives alone, for decode rows, prompt rows (the
    dense scratch) and a mix, at 1 row and at many."""
    from kvshare.model.ops import Ops
    from kvshare.model.qlinear import RowBlocks, StackedLinear

    parts = [to_group_affine(_raw(t, n, K, seed=i), t, (n, K))
             for i, (t, n) in enumerate([(QT.Q4_K, 64), (QT.Q4_K, 32), (QT.Q6_K, 32)])]
    fused = Ops.fuse(parts)
    assert isinstance(fused, RowBlocks)
    scratch = DequantScratch()
    stacked = make_linear(fused, dtype, scratch)
    assert isinstance(stacked, StackedLinear) and stacked.out_features == 128 and stacked.in_features == K
    alone = [make_linear(p, dtype, scratch) for p in parts]
    assert stacked.nbytes == sum(a.nbytes for a in alone)
    assert torch.equal(stacked.dense(), torch.cat([a.dense() for a in alone]))
    for rows, decode_rows in [(1, 1), (5, None), (40, 40), (40, 0), (40, 17), (300, 300)]:
        x = torch.randn(rows, K).to(dtype)
        y = stacked(x, decode_rows)
        want = torch.cat([a(x, decode_rows) for a in alone], dim=1)
        assert y.dtype == dtype and torch.equal(y, want), (rows, decode_rows)
    # The same formats fuse into one packed weight as before.
    assert not isinstance(Ops.fuse(parts[:2]), RowBlocks)
