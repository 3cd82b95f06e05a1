"""The C++ group-quantized matmuls (`qmatmul.int8_group_matmul`, and `int4_group_matmul` over
4-bit codes packed by `pack_int4_rows`) against a float64 reference, on every code path this CPU
runs (the scalar one included), plus the packing layout and argument checks.

Run this file as a script for a timing sanity check: `python tests/test_qmatmul.py [threads]`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import subprocess
import time

import pytest
import torch

from kvshare.model.kernels import build, qmatmul
from kvshare.model.kernels.qmatmul import (QMATMUL, int4_group_matmul, int8_group_matmul, pack_int4_rows,
                                           unpack_int4_rows)

if build.find_compiler() is None:
    pytest.skip("no C++ compiler ($CXX, c++ or g++) to build the qmatmul kernel", allow_module_level=True)
# A compiler exists, so the build must work: a failure here is a real error, not a skip.
assert QMATMUL.wait_until_built(), QMATMUL.unavailable_reason()

# The paths for weights kept in rows, slowest first ("scalar" is always there); "avx512-vnni"
# reads weights in VNNI blocks only, tested at the end of this file.
VNNI = "avx512-vnni"
PATHS = [p for p in qmatmul.qmatmul_paths() if p != VNNI]

# float32: the kernel rounds each dequantized weight once (q * scale + zero, an fma) and sums
# K products in float32 (16 or 8 lane-wise partial sums of K / 16 or K / 8 terms each, then a 4-
# or 3-level tree, on AVX-512 / AVX2; sequentially on the scalar path). The rounding error of
# such a sum is at most (number of sequential additions + 2) * 2^-24 times sum_k |x_k| |w_k|:
# ~100 * 6e-8 = 6e-6 for K = 1536 on AVX-512 (~1.2e-5 on AVX2 in the worst case, where every
# rounding goes the same way); errors of random sign, as here, add up like sqrt(n): ~1e-6 on the
# vector paths, ~sqrt(K) * 6e-8 = 2.4e-6 on the scalar one. So the bound is 1e-5 of that "scale"
# of each output (not of |y|, which cancellation can make arbitrarily small). The same holds for
# the 4-bit codes (w = q * s + z with q in 0..15: the same single rounding, the same sums).
F32_RTOL = 1e-5
# bfloat16: the float32 result (error as above, tiny) is rounded to bf16 (8 significant bits).
# The reference is rounded to bf16 too; the two roundings can land on neighbouring bf16 values
# when the exact value sits near a rounding boundary, so they may differ by one bf16 ulp, which
# is at most 2^-7 of the value's magnitude; never more.
BF16_ULP = 2.0 ** -7
# VNNI blocks (the avx512-vnni path) round x to int16 first, per row and group: X = round(x *
# 32767 / max|x|), so each x is off by half a step d = max|x| / 32767, plus the float32 roundings
# of 32767 / max|x|, of x times it and of d (2^-24 of up to 32767 steps each: 3 * 32767 * 2^-24
# steps in all); sum_g d_g (0.5 + 0.006) * sum_{k in g} |w_k| is added to the bound. The int32
# group sums are exact; the epilogue's float32 roundings fit in F32_RTOL.


def make_problem(seed: int, m: int, k: int, n: int, group: int, with_zeros: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3  # like max|w| / 127 per group
    zeros = torch.randn(n, k // group, generator=g) * 0.05 if with_zeros else None
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, q, scales, zeros


def dequantize(q, scales, zeros, group):
    w = q.double() * scales.double().repeat_interleave(group, dim=1)
    if zeros is not None:
        w = w + zeros.double().repeat_interleave(group, dim=1)
    return w


def reference(x, q, scales, zeros, group):
    """x.double() @ w.double().T, and the scale sum_k |x_k| (|q_k s| + |z|) of each output."""
    ref = x.double() @ dequantize(q, scales, zeros, group).T
    mag = q.double().abs() * scales.double().repeat_interleave(group, dim=1)
    if zeros is not None:
        mag = mag + zeros.double().abs().repeat_interleave(group, dim=1)
    return ref, x.double().abs() @ mag.T


def x_rounding_bound(x, q, scales, zeros, group):
    """The error VNNI blocks' int16 rounding of x may add to each output [M, N]."""
    m, k = x.shape
    step = x.double().abs().view(m, k // group, group).amax(-1) / 32767  # [M, G]
    w = dequantize(q, scales, zeros, group).abs().view(q.shape[0], k // group, group).sum(-1)  # [N, G]
    return (0.5 + 3 * 32767 * 2.0 ** -24) * step @ w.T


def compare(y, ref, scale, dtype, x_bound=None):
    """y against the float64 reference, with the tolerances explained above (x_bound: VNNI
    blocks' x rounding)."""
    assert y.shape == ref.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    extra = 0.0 if x_bound is None else x_bound
    if dtype == torch.float32:
        err = (y.double() - ref).abs()
        bound = F32_RTOL * scale + extra
    else:
        exact = ref
        ref = ref.to(torch.bfloat16).double()
        err = (y.double() - ref).abs()
        bound = BF16_ULP * ref.abs() + F32_RTOL * scale + extra
        # Neighbouring values only where a rounding boundary lies within the float32 error (and
        # the x rounding's) of the exact value; with float32 error alone that is rare.
        near = F32_RTOL * scale + extra
        boundary = (exact - near).to(torch.bfloat16) != (exact + near).to(torch.bfloat16)
        assert not ((err > 0) & ~boundary).any()
        if x_bound is None:
            assert (err > 0).double().mean().item() < 0.05
    excess = (err - bound).max().item()
    assert excess <= 0, f"max abs error {err.max().item():.3g} exceeds tolerance (worst excess {excess:.3g})"


def check(y, x, q, scales, zeros, group):
    compare(y, *reference(x, q, scales, zeros, group), x.dtype)


@functools.lru_cache(maxsize=16)
def _grid_case(m, k, n, group, with_zeros, dtype):
    """One problem of the main grid and its reference, shared by the code paths."""
    x, q, scales, zeros = make_problem(m * 7919 + k * 31 + n + group, m, k, n, group, with_zeros, dtype)
    return (x, q, scales, zeros), reference(x, q, scales, zeros, group)


# path varies fastest (the top decorator does), so the code paths share each cached problem
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("n", [192, 1000])  # whole 16-row blocks only, and a ragged last block
@pytest.mark.parametrize("k", [576, 1536, 64])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16])
def test_matches_float64_reference(m, k, n, group, with_zeros, dtype, path):
    (x, q, scales, zeros), (ref, scale) = _grid_case(m, k, n, group, with_zeros, dtype)
    compare(int8_group_matmul(x, q, scales, zeros, group, impl=path), ref, scale, dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k, group", [(48, 3), (64, 8), (96, 48), (128, 64), (16, 16), (40, 1), (7, 7)])
def test_any_group_size(k, group, path):
    """Group sizes the vector paths do not take fall back to one that does (scalar for any)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, q, scales, zeros = make_problem(k + group, 5, k, 37, group, True, dtype)
        check(int8_group_matmul(x, q, scales, zeros, group, impl=path), x, q, scales, zeros, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_x_out_param_and_threads(dtype):
    x, q, scales, zeros = make_problem(3, 9, 576, 203, 32, True, dtype)
    ref = int8_group_matmul(x, q, scales, zeros, 32)
    # x as a view into a wider activation (row stride > K), out into a wider buffer.
    wide = torch.randn(9, 576 + 40).to(dtype)
    wide[:, 8:8 + 576] = x
    xv = wide[:, 8:8 + 576]
    assert not xv.is_contiguous()
    buf = torch.full((9, 250), float("nan"), dtype=dtype)
    out = buf[:, :203]
    res = int8_group_matmul(xv, q, scales, zeros, 32, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, ref)
    assert torch.isnan(buf[:, 203:]).all()  # nothing written past the view
    # Each output is computed whole by one thread: results do not depend on threading.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = int8_group_matmul(x, q, scales, zeros, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, ref)
    # Every path agrees with the reference; the vector paths' results do not depend on M tiling.
    for path in PATHS:
        rows = torch.cat([int8_group_matmul(x[i:i + 1], q, scales, zeros, 32, impl=path) for i in range(9)])
        assert torch.equal(rows, int8_group_matmul(x, q, scales, zeros, 32, impl=path))


def test_edge_sizes():
    x, q, scales, zeros = make_problem(1, 4, 64, 10, 16, True, torch.float32)
    assert int8_group_matmul(x[:0], q, scales, zeros, 16).shape == (0, 10)
    assert int8_group_matmul(x, q[:0], scales[:0], zeros[:0], 16).shape == (4, 0)
    y = int8_group_matmul(x[:, :0], q[:, :0], scales[:, :0], zeros[:, :0], 16)  # K = 0: empty sums
    assert torch.equal(y, torch.zeros(4, 10))
    # Extremes of int8 and a single output.
    qx = torch.full((1, 64), -128, dtype=torch.int8)
    y = int8_group_matmul(torch.ones(1, 64), qx, torch.full((1, 4), 0.5), None, 16)
    assert y.item() == -128 * 0.5 * 64


def test_rejects_bad_arguments():
    x, q, scales, zeros = make_problem(2, 3, 64, 8, 16, True, torch.float32)
    cases = [
        ((x.half(), q, scales, zeros, 16), "x must be float32 or bfloat16"),
        ((x[0], q, scales, zeros, 16), r"x must be a 2-D tensor"),
        ((x, q.to(torch.uint8), scales, zeros, 16), "q must be an int8 tensor"),
        ((x, q.float(), scales, zeros, 16), "q must be an int8 tensor"),
        ((x, q[:, :48], scales, zeros, 16), "does not fit x"),
        ((x, q, scales, zeros, 24), "group_size=24 must be a positive int dividing K=64"),
        ((x, q, scales, zeros, 0), "group_size=0"),
        ((x, q, scales, zeros, 16.0), "group_size=16.0"),
        ((x, q, scales.double(), zeros, 16), r"scales must be float32 \[8, 4\]"),
        ((x, q, scales[:, :2], zeros, 16), r"scales must be float32 \[8, 4\]"),
        ((x, q, scales, zeros.bfloat16(), 16), r"zeros must be None or float32 \[8, 4\]"),
        ((x, q, scales, zeros[:4], 16), r"zeros must be None or float32 \[8, 4\]"),
        ((x.t().contiguous().t(), q, scales, zeros, 16), "x must have contiguous rows"),
        ((x, q.t().contiguous().t(), scales, zeros, 16), "q must be contiguous"),
        ((x, q, scales.t().contiguous().t(), zeros, 16), "scales must be contiguous"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            int8_group_matmul(*args)
    with pytest.raises(ValueError, match="out must be a CPU tensor"):
        int8_group_matmul(x, q, scales, zeros, 16, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a CPU tensor"):
        int8_group_matmul(x, q, scales, zeros, 16, out=torch.empty(3, 9))
    with pytest.raises(ValueError, match="impl="):
        int8_group_matmul(x, q, scales, zeros, 16, impl="neon")
    missing = {"avx2", "avx512"} - set(PATHS)
    for path in missing:
        with pytest.raises(ValueError, match="not supported by this CPU"):
            int8_group_matmul(x, q, scales, zeros, 16, impl=path)


# ---- int4: 4-bit codes packed two per byte ------------------------------------------------------
def make_problem4(seed: int, m: int, k: int, n: int, group: int, with_zeros: bool, dtype: torch.dtype):
    """Codes 0..15 (as uint8 [N, K]) and their packed form, Q4_1-like scales and offsets."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zeros = -8 * scales + torch.randn(n, k // group, generator=g) * 0.01 if with_zeros else None
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, codes, pack_int4_rows(codes), scales, zeros


@functools.lru_cache(maxsize=16)
def _grid_case4(m, k, n, group, with_zeros, dtype):
    x, codes, packed, scales, zeros = make_problem4(m * 7919 + k * 31 + n + group + 1, m, k, n, group, with_zeros,
                                                    dtype)
    return (x, packed, scales, zeros), reference(x, codes, scales, zeros, group)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("n", [192, 1000])
@pytest.mark.parametrize("k", [576, 1536, 64])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16])
def test_int4_matches_float64_reference(m, k, n, group, with_zeros, dtype, path):
    (x, packed, scales, zeros), (ref, scale) = _grid_case4(m, k, n, group, with_zeros, dtype)
    compare(int4_group_matmul(x, packed, scales, zeros, group, impl=path), ref, scale, dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k, group", [(48, 3), (64, 8), (96, 48), (128, 64), (16, 16), (40, 1), (14, 7), (2, 2),
                                      (96, 32), (160, 32)])
def test_int4_any_group_size(k, group, path):
    """Group sizes the vector paths do not take (they need a multiple of 16, AVX-512 of 32) fall
    back to one that does; odd groups are fine as long as K is even."""
    for dtype in (torch.float32, torch.bfloat16):
        x, codes, packed, scales, zeros = make_problem4(k + group, 5, k, 37, group, True, dtype)
        check(int4_group_matmul(x, packed, scales, zeros, group, impl=path), x, codes, scales, zeros, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_strided_x_out_param_threads_and_batch_invariance(dtype):
    x, codes, packed, scales, zeros = make_problem4(3, 9, 576, 203, 32, True, dtype)
    ref = int4_group_matmul(x, packed, scales, zeros, 32)
    wide = torch.randn(9, 576 + 40).to(dtype)
    wide[:, 8:8 + 576] = x
    xv = wide[:, 8:8 + 576]
    buf = torch.full((9, 250), float("nan"), dtype=dtype)
    out = buf[:, :203]
    res = int4_group_matmul(xv, packed, scales, zeros, 32, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, ref)
    assert torch.isnan(buf[:, 203:]).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = int4_group_matmul(x, packed, scales, zeros, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, ref)
    # A row's result does not depend on the other rows of the batch (M = 1 and M > 1 tiles add
    # in the same order), nor on N's tiling (a weight row alone gives the same outputs).
    for path in PATHS:
        full = int4_group_matmul(x, packed, scales, zeros, 32, impl=path)
        rows = torch.cat([int4_group_matmul(x[i:i + 1], packed, scales, zeros, 32, impl=path) for i in range(9)])
        assert torch.equal(rows, full)
        cols = torch.cat([int4_group_matmul(x, packed[j:j + 1], scales[j:j + 1], zeros[j:j + 1], 32, impl=path)
                          for j in range(0, 203, 29)], dim=1)
        assert torch.equal(cols, full[:, ::29])


def test_int4_edge_sizes_and_extremes():
    x, codes, packed, scales, zeros = make_problem4(1, 4, 64, 10, 16, True, torch.float32)
    assert int4_group_matmul(x[:0], packed, scales, zeros, 16).shape == (0, 10)
    assert int4_group_matmul(x, packed[:0], scales[:0], zeros[:0], 16).shape == (4, 0)
    y = int4_group_matmul(x[:, :0], packed[:, :0], scales[:, :0], zeros[:, :0], 16)
    assert torch.equal(y, torch.zeros(4, 10))
    for path in PATHS:
        # Every code 15 (every byte 0xff), then 0 with an offset only, in one output each.
        p = torch.full((2, 32), 0xFF, dtype=torch.uint8)
        p[1] = 0
        s = torch.full((2, 2), 0.5)
        z = torch.tensor([[0.0, 0.0], [1.0, -2.0]])
        y = int4_group_matmul(torch.ones(1, 64), p, s, z, 32, impl=path)
        assert y.tolist() == [[15 * 0.5 * 64, 32 * 1.0 - 32 * 2.0]]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_many_rows_bit_identical_to_row_by_row(fmt):
    """From 12 x rows the AVX-512 path dequantizes each weight row once into a panel and
    multiplies every x tile by it (instead of widening the codes again per 4 x rows): a row's
    result must stay bit for bit what it is alone, on every path, for both formats, with and
    without offsets, group 16 and 32, float32 and bfloat16 x, and a ragged last tile of x rows
    and of weight rows."""
    for group in (16, 32):
        for with_zeros in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                m, k, n = 43, 576, 203
                if fmt == "int4":
                    x, _, q, scales, zeros = make_problem4(m + group, m, k, n, group, with_zeros, dtype)
                    matmul = int4_group_matmul
                else:
                    x, q, scales, zeros = make_problem(m + group, m, k, n, group, with_zeros, dtype)
                    matmul = int8_group_matmul
                for path in PATHS:
                    full = matmul(x, q, scales, zeros, group, impl=path)
                    rows = torch.cat([matmul(x[i:i + 1], q, scales, zeros, group, impl=path) for i in range(m)])
                    assert torch.equal(rows, full), (group, with_zeros, dtype, path)
                    # and a batch of 12 (the smallest that takes the panel) from the middle
                    assert torch.equal(matmul(x[20:32], q, scales, zeros, group, impl=path), full[20:32])


def test_pack_int4_rows_layout_and_round_trip():
    # Byte j holds code 2j in its low nibble and code 2j + 1 in its high nibble.
    q = torch.tensor([[1, 2, 3, 4, 15, 0], [0, 15, 7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x87, 0xA9]]
    assert torch.equal(unpack_int4_rows(packed), q)
    g = torch.Generator().manual_seed(5)
    for shape in [(7, 64), (1, 2), (3, 0), (2, 3, 10)]:
        codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=g)
        packed = pack_int4_rows(codes)
        assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.is_contiguous()
        assert torch.equal(unpack_int4_rows(packed), codes)
        assert torch.equal(pack_int4_rows(codes.to(torch.int64)), packed)  # any integer dtype
    # Every byte value unpacks and repacks to itself.
    all_bytes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    assert torch.equal(pack_int4_rows(unpack_int4_rows(all_bytes)), all_bytes)
    # The kernel reads that layout: a weight with one nonzero code, at each position of a group.
    for k in (0, 1, 14, 15, 16, 17, 30, 31):
        codes = torch.zeros(1, 32, dtype=torch.uint8)
        codes[0, k] = 3
        x = torch.arange(1.0, 33.0).view(1, 32)
        for path in PATHS:
            y = int4_group_matmul(x, pack_int4_rows(codes), torch.ones(1, 1), None, 32, impl=path)
            assert y.item() == 3 * (k + 1), (k, path)


def test_pack_int4_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="q must be an integer tensor"):
        pack_int4_rows(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="q must be an integer tensor"):
        pack_int4_rows(torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="q must be an integer tensor"):
        pack_int4_rows([[1, 2]])
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4_rows(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit codes 0..15"):
        pack_int4_rows(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit codes 0..15"):
        pack_int4_rows(torch.full((2, 4), -1, dtype=torch.int8))
    with pytest.raises(ValueError, match="packed must be a uint8 tensor"):
        unpack_int4_rows(torch.zeros(2, 4, dtype=torch.int8))


def test_int4_rejects_bad_arguments():
    x, codes, packed, scales, zeros = make_problem4(2, 3, 64, 8, 16, True, torch.float32)
    cases = [
        ((x.half(), packed, scales, zeros, 16), "x must be float32 or bfloat16"),
        ((x[0], packed, scales, zeros, 16), r"x must be a 2-D tensor"),
        ((x, packed.to(torch.int8), scales, zeros, 16), "packed must be a uint8 tensor"),
        ((x, codes, scales, zeros, 16), r"packed \(8, 64\) does not fit x \(3, 64\): want packed \[N, 32\]"),
        ((x, packed[:, :24], scales, zeros, 16), "does not fit x"),
        ((x, packed[0], scales, zeros, 16), "packed must be a uint8 tensor"),
        ((x[:, :63], packed, scales, zeros, 16), "K=63 columns: packed 4-bit rows need an even K"),
        ((x, packed, scales, zeros, 24), "group_size=24 must be a positive int dividing K=64"),
        ((x, packed, scales, zeros, 0), "group_size=0"),
        ((x, packed, scales, zeros, True), "group_size=True"),
        ((x, packed, scales.double(), zeros, 16), r"scales must be float32 \[8, 4\]"),
        ((x, packed, scales[:, :2], zeros, 16), r"scales must be float32 \[8, 4\]"),
        ((x, packed, scales, zeros.bfloat16(), 16), r"zeros must be None or float32 \[8, 4\]"),
        ((x, packed, scales, zeros[:4], 16), r"zeros must be None or float32 \[8, 4\]"),
        ((x.t().contiguous().t(), packed, scales, zeros, 16), "x must have contiguous rows"),
        ((x, packed.t().contiguous().t(), scales, zeros, 16), "packed must be contiguous"),
        ((x, packed, scales.t().contiguous().t(), zeros, 16), "scales must be contiguous"),
        ((x, packed, scales, zeros.t().contiguous().t(), 16), "zeros must be contiguous"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            int4_group_matmul(*args)
    with pytest.raises(ValueError, match="out must be a CPU tensor"):
        int4_group_matmul(x, packed, scales, zeros, 16, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="impl="):
        int4_group_matmul(x, packed, scales, zeros, 16, impl="neon")
    for path in {"avx2", "avx512"} - set(PATHS):
        with pytest.raises(ValueError, match="not supported by this CPU"):
            int4_group_matmul(x, packed, scales, zeros, 16, impl=path)


def test_cold_build_in_background_and_concurrent_builds(tmp_path):
    """Empty cache: the first available() starts the build and returns False at once; two
    processes building at the same time both succeed, with no lock, and leave one library."""
    import sys

    barrier = tmp_path / "ready"
    barrier.mkdir()
    code = (
        "import os, sys, time\n"
        "from kvshare.model.kernels import qmatmul\n"
        "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
        "while len(os.listdir(sys.argv[1])) < 2: time.sleep(0.01)  # both imported: start together\n"
        "t = time.perf_counter(); first = qmatmul.QMATMUL.available(); dt = time.perf_counter() - t\n"
        "assert first is False and dt < 1.0, (first, dt)\n"
        "assert 'still building' in qmatmul.QMATMUL.unavailable_reason()\n"
        "assert qmatmul.QMATMUL.wait_until_built(), qmatmul.QMATMUL.unavailable_reason()\n"
        "assert qmatmul.QMATMUL.available() and qmatmul.QMATMUL.from_cache() is False\n"
        "import torch\n"
        "x = torch.randn(2, 32); q = torch.ones(3, 32, dtype=torch.int8); s = torch.ones(3, 1)\n"
        "assert torch.allclose(qmatmul.int8_group_matmul(x, q, s, None, 32), x.sum(1, keepdim=True).expand(2, 3))\n"
        "print('OK')\n"
    )
    env = dict(os.environ, KVSHARE_CACHE_DIR=str(tmp_path / "kernels"))
    env.pop(build.DISABLE_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(barrier)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and "OK" in out, err[-2000:]
    files = sorted(f.name for f in (tmp_path / "kernels").iterdir())
    assert len(files) == 1 and files[0].startswith("kvshare_qmatmul_") and files[0].endswith(".so"), files


# SIMDe (portable C implementations of x86 intrinsics) runs the vector paths this CPU lacks,
# slowly but exactly as written: a stand-in <immintrin.h>, plus the 5 intrinsics SIMDe 0.7 lacks.
_SIMDE_IMMINTRIN = r"""
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <stdint.h>
#ifndef _mm512_cvtepi8_epi32
static inline simde__m512i _mm512_cvtepi8_epi32(simde__m128i a) {
  int8_t b[16]; int32_t r[16];
  simde_mm_storeu_si128((simde__m128i*)b, a);
  for (int i = 0; i < 16; ++i) r[i] = b[i];
  return simde_mm512_loadu_si512(r);
}
#endif
#ifndef _mm512_cvtepu8_epi32
static inline simde__m512i _mm512_cvtepu8_epi32(simde__m128i a) {
  uint8_t b[16]; int32_t r[16];
  simde_mm_storeu_si128((simde__m128i*)b, a);
  for (int i = 0; i < 16; ++i) r[i] = b[i];
  return simde_mm512_loadu_si512(r);
}
#endif
#ifndef _mm512_cvtepi32_ps
static inline simde__m512 _mm512_cvtepi32_ps(simde__m512i a) {
  int32_t b[16]; float r[16];
  simde_mm512_storeu_si512(b, a);
  for (int i = 0; i < 16; ++i) r[i] = (float)b[i];
  return simde_mm512_loadu_ps(r);
}
#endif
#ifndef _mm512_cvtepi32_epi16
static inline simde__m256i _mm512_cvtepi32_epi16(simde__m512i a) {  /* truncating, as vpmovdw */
  int32_t b[16]; int16_t r[16];
  simde_mm512_storeu_si512(b, a);
  for (int i = 0; i < 16; ++i) r[i] = (int16_t)b[i];
  return simde_mm256_loadu_si256((simde__m256i*)r);
}
#endif
#ifndef _mm512_reduce_add_ps
static inline float _mm512_reduce_add_ps(simde__m512 a) {  /* GCC's tree order */
  float b[16];
  simde_mm512_storeu_ps(b, a);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) b[i] += b[i + w];
  return b[0];
}
#endif
"""


@pytest.mark.slow  # compiles both formats' kernels under emulation (~35 s); run with -m slow
def test_vector_paths_this_cpu_lacks_under_simde(tmp_path):
    """The AVX-512 (and AVX2) code of both formats, compiled against SIMDe instead of the real
    intrinsics, with the CPU checks forced on: checks the paths a CPU without those features never
    runs."""
    if {"avx512", "avx2"} <= set(PATHS):
        pytest.skip("this CPU runs every vector path natively")
    cxx = build._compiler_cmd()
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "immintrin.h").write_text(_SIMDE_IMMINTRIN)
    probe = subprocess.run([*cxx, "-fsyntax-only", "-x", "c++", "-I", str(inc), "-"], input="#include <immintrin.h>\n",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip("SIMDe headers not installed (apt install libsimde-dev)")
    so = tmp_path / "qmm_simde.so"
    res = subprocess.run([*cxx, "-O2", "-fopenmp", "-shared", "-fPIC", "-DQMM_ASSUME_CPU", "-DSIMDE_NO_NATIVE",
                          "-I", str(inc), os.path.join(build.CSRC_DIR, "qmatmul.cpp"), "-o", str(so)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    qmatmul._setup_qmatmul(lib)
    assert lib.kvs_qmm_cpu_paths() == 7

    def run(x, q, scales, zeros, group, impl, fn=lib.kvs_int8_group_matmul):
        y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
        err = ctypes.create_string_buffer(256)
        rc = fn(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, q.data_ptr(),
                scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
                y.data_ptr(), y.stride(0), x.shape[0], q.shape[0], x.shape[1], group,
                impl, 2, err, len(err), 0, 0.0)
        assert rc == 0, err.value
        return y

    for m in (1, 3, 4, 7, 16):
        for k, n in ((576, 192), (64, 1000), (1536, 7)):
            for group in (16, 32):
                for with_zeros in (False, True):
                    for dtype in (torch.float32, torch.bfloat16):
                        x, q, scales, zeros = make_problem(m + k + n + group, m, k, n, group, with_zeros, dtype)
                        for impl in (2, 3):  # avx512, avx2
                            check(run(x, q, scales, zeros, group, impl), x, q, scales, zeros, group)
    # int4: AVX-512 takes group 32 and 64 (16 falls back to AVX2), AVX2 every multiple of 16. M = 1
    # and M > 1 tiles must add in the same order (batch invariance), on every path.
    for m in (1, 3, 4, 7, 16):
        for k, n in ((576, 192), (64, 1000), (1536, 7)):
            for group in (16, 32, 64):
                for with_zeros in (False, True):
                    for dtype in (torch.float32, torch.bfloat16):
                        x, codes, packed, scales, zeros = make_problem4(m + k + n + group, m, k, n, group, with_zeros,
                                                                        dtype)
                        for impl in (2, 3):
                            y = run(x, packed, scales, zeros, group, impl, lib.kvs_int4_group_matmul)
                            check(y, x, codes, scales, zeros, group)
                            if m in (3, 7):
                                rows = torch.cat([run(x[i:i + 1], packed, scales, zeros, group, impl,
                                                      lib.kvs_int4_group_matmul) for i in range(m)])
                                assert torch.equal(rows, y)
    # The prefill scratch fill (kvs_group_dequantize) on its AVX-512 path, both formats and both
    # output dtypes: q * scale + zero, within one float32 rounding, then rounded to the output dtype.
    for int4 in (False, True):
        for group in (32, 64):
            if int4:
                _, codes, packed, scales, zeros = make_problem4(group, 1, 576, 96, group, True, torch.float32)
            else:
                _, codes, scales, zeros = make_problem(group, 1, 576, 96, group, True, torch.float32)
                packed = codes
            s, z = scales.repeat_interleave(group, 1).double(), zeros.repeat_interleave(group, 1).double()
            ref = codes.double() * s + z
            for dtype in (torch.float32, torch.bfloat16):
                out = torch.full((96, 576), float("nan"), dtype=dtype)
                lib.kvs_group_dequantize(packed.data_ptr(), int(int4), scales.data_ptr(), zeros.data_ptr(),
                                         out.data_ptr(), int(dtype == torch.bfloat16), 96, 576, group, 2, 0, 0.0)
                ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-8
                assert ((out.double() - ref).abs() <= ulp * ((codes.double() * s).abs() + z.abs())).all()


# ---- VNNI blocks: the avx512-vnni path ----------------------------------------------------------
needs_vnni = pytest.mark.skipif(VNNI not in qmatmul.qmatmul_paths(), reason="this CPU has no AVX-512 VNNI")


def _blocks(fmt, seed, m, k, n, group, with_zeros, dtype):
    """A problem (x, codes [N, K], scales, zeros) and its weight in VNNI blocks."""
    if fmt == "int4":
        x, codes, packed, scales, zeros = make_problem4(seed, m, k, n, group, with_zeros, dtype)
        return (x, codes, scales, zeros), qmatmul.to_vnni_blocks(packed, scales, zeros, group, True)
    x, q, scales, zeros = make_problem(seed, m, k, n, group, with_zeros, dtype)
    return (x, q, scales, zeros), qmatmul.to_vnni_blocks(q, scales, zeros, group, False)


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("k, group", [(576, 32), (1536, 32), (64, 16), (64, 64), (48, 8), (768, 256)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 20, 43])  # tiles of up to 8 rows (9: 5 + 4; 20: 7 + 7 + 6), the GEMM beyond 32
def test_vnni_blocks_match_float64_reference(m, k, group, with_zeros, dtype, fmt):
    if fmt == "int4" and k % 8:
        pytest.skip("VNNI blocks of 4-bit codes need K % 8 == 0")
    (x, q, scales, zeros), blocks = _blocks(fmt, m * 31 + k + group, m, k, 208, group, with_zeros, dtype)
    ref, scale = reference(x, q, scales, zeros, group)
    compare(blocks.matmul(x), ref, scale, dtype, x_rounding_bound(x, q, scales, zeros, group))


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_vnni_blocks_are_int16_x_with_exact_group_sums(fmt):
    """What qmatmul.cpp says the path computes: X = round(x * (32767 / max|x|)) per row and group
    in float32 (half to even), exact int32 sums of X * code per group, then scale * d and
    zero * d * sum(X) per group in float32. Emulated in float64 from the same X and d, it agrees
    to 1e-6 of each output's sum of |group terms|: the epilogue's ~3 float32 roundings per group
    (2^-24 each, ~sqrt(54) * 6e-8 = 4e-7 for 18 groups of random sign; 1.3e-7 measured), where one
    X a step off, or X = round(x / d) instead, shows at 3e-6 to 4e-6. A non-finite x makes its
    row's outputs NaN; an all-zero row gives 0."""
    m, k, n, group = 6, 576, 64, 32
    for with_zeros in (False, True):
        (x, codes, scales, zeros), blocks = _blocks(fmt, 11, m, k, n, group, with_zeros, torch.float32)
        y = blocks.matmul(x)
        xg = x.view(m, k // group, group)
        amax = xg.abs().amax(-1, keepdim=True)
        big_x = torch.round(xg * (torch.tensor(32767.0) / amax))  # float32 ops, as the kernel's
        d = (amax / 32767.0).double().squeeze(-1)  # [M, G]
        sums = torch.einsum("mgk,ngk->mng", big_x.double(), codes.view(n, k // group, group).double())
        terms = sums * scales.double()[None] * d[:, None, :]  # [M, N, G]
        if with_zeros:
            terms = terms + zeros.double()[None] * (d * big_x.double().sum(-1))[:, None, :]
        assert ((y.double() - terms.sum(-1)).abs() <= 1e-6 * terms.abs().sum(-1)).all()
        x_bad = x.clone()
        x_bad[1, 40] = float("nan")
        x_bad[2, 100] = float("inf")
        x_bad[3] = 0.0
        y_bad = blocks.matmul(x_bad)
        assert torch.isnan(y_bad[1:3]).all() and torch.equal(y_bad[3], torch.zeros(n))
        assert torch.equal(y_bad[[0, 4, 5]], y[[0, 4, 5]])


@needs_vnni
def test_vnni_blocks_round_x_alike_from_float32_and_bfloat16():
    """float32 x is rounded to int16 by a vector loop (groups a multiple of 16), bfloat16 x by the
    scalar one: on the same values both give the same X, so the same float32 result."""
    (x, *_), blocks = _blocks("int4", 9, 5, 576, 64, 32, True, torch.bfloat16)
    x[1, :32] *= 1e-36  # a group too small to scale: 0 on both
    assert torch.equal(blocks.matmul(x), blocks.matmul(x.float()).to(torch.bfloat16))


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_vnni_blocks_row_result_independent_of_batch_and_threads(fmt):
    """Up to 32 x rows go in tiles of at most 8 (each unpacking the codes again), more through the
    GEMM: a row's result is bit for bit what it is alone, in any batch, with any thread count, for
    both formats."""
    for with_zeros in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            (x, *_), blocks = _blocks(fmt, 5, 43, 576, 320, 32, with_zeros, dtype)
            full = blocks.matmul(x)
            rows = torch.cat([blocks.matmul(x[i:i + 1]) for i in range(43)])
            assert torch.equal(rows, full), (with_zeros, dtype)
            assert torch.equal(blocks.matmul(x[20:32]), full[20:32])
            assert torch.equal(blocks.matmul(x[3:8]), full[3:8])
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                assert torch.equal(blocks.matmul(x), full)
            finally:
                torch.set_num_threads(threads)


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_vnni_blocks_layout_rows_and_dequantize(fmt):
    """The blocks hold the same weight: rows() reads back the codes, scales and zeros of any row,
    dequantize() gives what group_dequantize gives for the weight in rows, and a code at each
    position of a group of each of 16 rows is read from its place."""
    (x, codes, scales, zeros), blocks = _blocks(fmt, 3, 2, 576, 48, 32, True, torch.float32)
    stored = pack_int4_rows(codes) if fmt == "int4" else codes
    idx = torch.tensor([0, 5, 15, 16, 33, 47])
    q_rows, s_rows, z_rows = blocks.rows(idx)
    assert torch.equal(q_rows, stored[idx]) and torch.equal(s_rows, scales[idx]) and torch.equal(z_rows, zeros[idx])
    for dtype in (torch.float32, torch.bfloat16):
        want = qmatmul.group_dequantize(stored, scales, zeros, 32, torch.empty(48, 576, dtype=dtype),
                                            fmt == "int4")
        assert torch.equal(blocks.dequantize(torch.empty(48, 576, dtype=dtype)), want)
    x = torch.arange(1.0, 33.0).view(1, 32)
    for k in range(32):
        one = torch.zeros(16, 32, dtype=torch.uint8 if fmt == "int4" else torch.int8)
        one[torch.arange(16), (k + torch.arange(16)) % 32] = 3  # row r: code 3 at (k + r) % 32
        stored = pack_int4_rows(one) if fmt == "int4" else one
        y = qmatmul.to_vnni_blocks(stored, torch.ones(16, 1), None, 32, fmt == "int4").matmul(x)
        want = 3 * ((k + torch.arange(16)) % 32 + 1).float()
        # within half an int16 step of x's group (32 / 32767) times the code 3; a code read from
        # a neighbouring position would be off by 3
        assert ((y[0] - want).abs() <= 0.5 * 32 / 32767 * 3 * 1.001).all(), (k, y)


@needs_vnni
def test_vnni_blocks_reject_what_they_cannot_run():
    x, q, scales, zeros = make_problem(1, 2, 64, 32, 16, True, torch.float32)
    with pytest.raises(ValueError, match="N % 16"):
        qmatmul.to_vnni_blocks(q[:20], scales[:20], zeros[:20], 16, False)
    with pytest.raises(ValueError, match="reads weights in VNNI blocks only"):
        int8_group_matmul(x, q, scales, zeros, 16, impl=VNNI)
    blocks = qmatmul.to_vnni_blocks(q, scales, zeros, 16, False)
    with pytest.raises(ValueError, match="does not fit"):
        blocks.matmul(torch.randn(2, 48))
    assert qmatmul.vnni_blocks_fit(32, 64, 16) and not qmatmul.vnni_blocks_fit(20, 64, 16)
    assert not qmatmul.vnni_blocks_fit(32, 64, 4) and not qmatmul.vnni_blocks_fit(32, 1024, 512)


def _fma32(a, b, c):
    """float32 fma(a, b, c) (one rounding) emulated in float64, elementwise: a * b is exact in
    float64 (both operands have at most 25 significant bits); the float64 sum's rounding error is
    recovered (TwoSum) and decides the float32 rounding where the float64 sum lies exactly halfway
    between two float32 values (where rounding twice could differ from rounding once)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.float()
    up, down = torch.nextafter(r, torch.tensor(float("inf"))), torch.nextafter(r, torch.tensor(float("-inf")))
    half = (s - r.double()).abs() * 2 == torch.where(s >= r.double(), up.double() - r.double(),
                                                     r.double() - down.double())
    fix = half & (err != 0)
    # Halfway but the exact sum is beyond: round towards it.
    towards = torch.where((s - r.double() + err) > 0, up, down)
    return torch.where(fix, towards, r)


def _vnni_reference(x, codes, scales, zeros, group):
    """The avx512-vnni path's documented arithmetic, exactly (qmatmul.cpp, "AVX-512 VNNI path"):
    per row and group X = round(x * (32767 / max|x|)) (float32 ops, half to even), d = max|x| /
    32767, xz = d * float(sum X); exact integer group sums I = sum X * code; then in group order
    from acc = 0: acc = fma(float(I), scale * d, acc) and, with zeros, acc = fma(zero, xz, acc),
    all float32. [M, N] float32. (Groups of random x, none all zero.)"""
    m, k = x.shape
    n, groups = codes.shape[0], k // group
    xg = x.float().view(m, groups, group)
    amax = xg.abs().amax(-1, keepdim=True)
    big_x = torch.round(xg * (torch.tensor(32767.0) / amax))
    d = (amax / 32767.0).squeeze(-1)  # [M, G] float32
    xz = d * big_x.sum(-1)  # float32 (the sums are exact in float32: |sum| < 2^24)
    sums = torch.einsum("mgk,ngk->mng", big_x.double(), codes.view(n, groups, group).double())  # exact
    acc = torch.zeros(m, n)
    for gi in range(groups):
        sd = scales[None, :, gi] * d[:, gi, None]  # float32 product
        acc = _fma32(sums[:, :, gi].float(), sd, acc)  # float(I): rounded to float32, as vcvtdq2ps
        if zeros is not None:
            acc = _fma32(zeros[None, :, gi].expand(m, n), xz[:, gi, None].expand(m, n), acc)
    return acc


def _ragged_blocks(fmt, seed, m, k, n, group, with_zeros, dtype):
    """_blocks for any N: the weight padded to whole 16-row blocks (as a caller with a ragged N
    would), the kernel told the true N. Codes, scales and zeros of the n real rows."""
    n16 = -(-n // 16) * 16
    (x, q, scales, zeros), blocks = _blocks(fmt, seed, m, k, n16, group, with_zeros, dtype)
    return (x, q[:n], scales[:n], None if zeros is None else zeros[:n]), dataclasses.replace(blocks, n=n)


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("n", [16, 40, 200, 576])
def test_vnni_blocks_many_rows_bitwise_row_alone_and_documented(fmt, with_zeros, group, n):
    """Prompt-sized calls (more than 32 rows; 16 for two-plane codes) take another tiling than decode-sized ones (qmatmul.cpp,
    "Many rows"), but every row's result is bit for bit what the row gives alone (M = 1, the
    decode path), whatever M, and bit for bit the documented arithmetic (_vnni_reference: the
    float32 epilogue in group order, its ops in order; reordering them, or the groups, changes
    bits and fails here)."""
    k = 576
    (x, q, scales, zeros), blocks = _ragged_blocks(fmt, n * 7 + group + with_zeros, 1024, k, n, group, with_zeros,
                                                   torch.float32)
    alone = torch.cat([blocks.matmul(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(alone, _vnni_reference(x, q, scales, zeros, group))
    for m in (1, 5, 8, 9, 17, 64, 300, 1024):
        assert torch.equal(blocks.matmul(x[:m]), alone[:m]), m
    # The same rows in another batch (offset, another M) and on one thread; bfloat16 x and y.
    assert torch.equal(blocks.matmul(x[250:551]), alone[250:551])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(blocks.matmul(x[:300]), alone[:300])
    finally:
        torch.set_num_threads(threads)
    xb = x[:100].bfloat16()
    alone_b = torch.cat([blocks.matmul(xb[i:i + 1]) for i in range(100)])
    assert torch.equal(blocks.matmul(xb), alone_b)
    assert torch.equal(alone_b, _vnni_reference(xb, q, scales, zeros, group).bfloat16())


def _timing(cold_bytes: float = 96e6) -> None:
    """Print ms per call (median of 7 timed batches) at decode shapes, group 32 with zeros (as
    Q4_1), float32 x: int8_group_matmul, int4_group_matmul and F.linear with a dense float32
    weight. "hot": the same weight every call (in L2 / L3 where it fits); "cold": calls rotate
    over copies of the weight totalling > 96 MB, so each call streams it from DRAM, as decoding a
    model larger than L3 does. No assertions."""
    import statistics

    group = 32
    shapes = [(3072, 576), (960, 576), (576, 576), (576, 1536), (49152, 576)]

    def bench(fns):
        fns[0]()
        t = time.perf_counter()
        fns[0]()
        reps = max(1, int(0.02 / max(time.perf_counter() - t, 1e-7)))
        reps = -(-reps // len(fns)) * len(fns)
        times = []
        for _ in range(7):
            t = time.perf_counter()
            for i in range(reps):
                fns[i % len(fns)]()
            times.append((time.perf_counter() - t) / reps * 1e3)
        return statistics.median(times)

    print(f"threads={torch.get_num_threads()} paths={PATHS}; ms per call, median of 7")
    print(f"{'N x K':>11} {'M':>3} | {'int8 hot':>9} {'int4 hot':>9} {'dense hot':>9} | {'int8 cold':>9} "
          f"{'int4 cold':>9} {'dense cold':>10}")
    for n, k in shapes:
        def copies(nbytes):  # enough weights of nbytes each to overflow L3
            return -(-int(cold_bytes) // nbytes)

        probs = [make_problem4(c, 16, k, n, group, True, torch.float32)[1:] for c in range(copies(n * k // 2))]
        q8 = [(p[0].to(torch.int8) - 8).contiguous() for p in probs[:copies(n * k)]]
        dense = [dequantize(p[0], p[2], p[3], group).float() for p in probs[:copies(n * k * 4)]]
        probs = [p[1:] for p in probs]  # packed, scales, zeros
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            row = []
            for sel in (slice(0, 1), slice(None)):
                i8 = [functools.partial(int8_group_matmul, x, q, p[1], p[2], group)
                      for q, p in zip(q8[sel], probs[sel])]
                i4 = [functools.partial(int4_group_matmul, x, *p, group) for p in probs[sel]]
                dn = [functools.partial(torch.nn.functional.linear, x, w) for w in dense[sel]]
                row += [bench(i8), bench(i4), bench(dn)]
            print(f"{n:>5} x {k:<4} {m:>3} | {row[0]:9.3f} {row[1]:9.3f} {row[2]:9.3f} | {row[3]:9.3f} {row[4]:9.3f} "
                  f"{row[5]:10.3f}", flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:  # python tests/test_qmatmul.py [threads]
        torch.set_num_threads(int(sys.argv[1]))
    _timing()
