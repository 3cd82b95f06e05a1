"""The C++ group-quantized int8 matmul (`cpu_kernels.int8_group_matmul`) against a float64
reference, on every code path this CPU runs (the scalar one included), plus argument checks.

Run this file as a script for a timing sanity check: `python tests/test_qmatmul.py`.
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import time

import pytest
import torch

from kvshare.model import cpu_kernels
from kvshare.model.cpu_kernels import QMATMUL, int8_group_matmul

if cpu_kernels.find_compiler() is None:
    pytest.skip("no C++ compiler ($CXX, c++ or g++) to build the qmatmul kernel", allow_module_level=True)
# A compiler exists, so the build must work: a failure here is a real error, not a skip.
assert QMATMUL.wait_until_built(), QMATMUL.unavailable_reason()

PATHS = cpu_kernels.qmatmul_paths()  # slowest first; "scalar" is always there

# float32: the kernel rounds each dequantized weight once (q * scale + zero, an fma) and sums
# K products in float32 (16 lane-wise partial sums of K / 16 terms each, then a 4-level tree;
# sequentially on the scalar path). The rounding error of such a sum is at most about
# (number of sequential additions + 2) * 2^-24 times sum_k |x_k| |w_k|: ~100 * 6e-8 = 6e-6 for
# K = 1536 on the vector paths, and, for random-sign terms, ~sqrt(K) * 6e-8 on the scalar one.
# So the bound is 1e-5 of that "scale" of each output (not of |y|, which cancellation can make
# arbitrarily small).
F32_RTOL = 1e-5
# bfloat16: the float32 result (error as above, tiny) is rounded to bf16 (8 significant bits).
# The reference is rounded to bf16 too; the two roundings can land on neighbouring bf16 values
# when the exact value sits near a rounding boundary, so they may differ by one bf16 ulp, which
# is at most 2^-7 of the value's magnitude; never more.
BF16_ULP = 2.0 ** -7


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


def compare(y, ref, scale, dtype):
    """y against the float64 reference, with the tolerances explained above."""
    assert y.shape == ref.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    if dtype == torch.float32:
        err = (y.double() - ref).abs()
        bound = F32_RTOL * scale
    else:
        ref = ref.to(torch.bfloat16).double()
        err = (y.double() - ref).abs()
        bound = BF16_ULP * ref.abs() + F32_RTOL * scale
        # Neighbouring values only where a rounding boundary lies within the float32 error.
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
@pytest.mark.parametrize("n", [192, 576, 1000])
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


def test_cold_build_in_background_and_concurrent_builds(tmp_path):
    """Empty cache: the first available() starts the build and returns False at once; two
    processes building at the same time both succeed, with no lock, and leave one library."""
    import sys

    barrier = tmp_path / "ready"
    barrier.mkdir()
    code = (
        "import os, sys, time\n"
        "from kvshare.model import cpu_kernels\n"
        "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
        "while len(os.listdir(sys.argv[1])) < 2: time.sleep(0.01)  # both imported: start together\n"
        "t = time.perf_counter(); first = cpu_kernels.QMATMUL.available(); dt = time.perf_counter() - t\n"
        "assert first is False and dt < 1.0, (first, dt)\n"
        "assert 'still building' in cpu_kernels.QMATMUL.unavailable_reason()\n"
        "assert cpu_kernels.QMATMUL.wait_until_built(), cpu_kernels.QMATMUL.unavailable_reason()\n"
        "assert cpu_kernels.QMATMUL.available() and cpu_kernels.QMATMUL.from_cache() is False\n"
        "import torch\n"
        "x = torch.randn(2, 32); q = torch.ones(3, 32, dtype=torch.int8); s = torch.ones(3, 1)\n"
        "assert torch.allclose(cpu_kernels.int8_group_matmul(x, q, s, None, 32), x.sum(1, keepdim=True).expand(2, 3))\n"
        "print('OK')\n"
    )
    env = dict(os.environ, KVSHARE_CACHE_DIR=str(tmp_path / "kernels"))
    env.pop(cpu_kernels.DISABLE_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(barrier)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and "OK" in out, err[-2000:]
    files = sorted(f.name for f in (tmp_path / "kernels").iterdir())
    assert len(files) == 1 and files[0].startswith("kvshare_qmatmul_") and files[0].endswith(".so"), files


# SIMDe (portable C implementations of x86 intrinsics) runs the vector paths this CPU lacks,
# slowly but exactly as written: a stand-in <immintrin.h>, plus the 3 intrinsics SIMDe 0.7 lacks.
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
#ifndef _mm512_cvtepi32_ps
static inline simde__m512 _mm512_cvtepi32_ps(simde__m512i a) {
  int32_t b[16]; float r[16];
  simde_mm512_storeu_si512(b, a);
  for (int i = 0; i < 16; ++i) r[i] = (float)b[i];
  return simde_mm512_loadu_ps(r);
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


def test_vector_paths_this_cpu_lacks_under_simde(tmp_path):
    """The AVX-512 (and AVX2) code, compiled against SIMDe instead of the real intrinsics, with
    the CPU checks forced on: checks the paths a CPU without those features never runs."""
    if {"avx512", "avx2"} <= set(PATHS):
        pytest.skip("this CPU runs every vector path natively")
    cxx = cpu_kernels._compiler_cmd()
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "immintrin.h").write_text(_SIMDE_IMMINTRIN)
    probe = subprocess.run([*cxx, "-fsyntax-only", "-x", "c++", "-I", str(inc), "-"], input="#include <immintrin.h>\n",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip("SIMDe headers not installed (apt install libsimde-dev)")
    so = tmp_path / "qmm_simde.so"
    res = subprocess.run([*cxx, "-O2", "-fopenmp", "-shared", "-fPIC", "-DQMM_ASSUME_CPU", "-DSIMDE_NO_NATIVE",
                          "-I", str(inc), os.path.join(cpu_kernels.CSRC_DIR, "qmatmul.cpp"), "-o", str(so)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    cpu_kernels._setup_qmatmul(lib)
    assert lib.kvs_qmm_cpu_paths() == 7

    def run(x, q, scales, zeros, group, impl):
        y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
        err = ctypes.create_string_buffer(256)
        rc = lib.kvs_int8_group_matmul(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, q.data_ptr(),
                                       scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
                                       y.data_ptr(), y.stride(0), x.shape[0], q.shape[0], x.shape[1], group,
                                       impl, 2, err, len(err))
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


def _timing() -> None:
    """Print ms per call: a decode-sized lm_head (N=49152, K=576, group 32, M=1, bf16 x) against
    torch.nn.functional.linear with a dense bf16 weight of the same shape. No assertions."""
    n, k, group = 49152, 576, 32
    x, q, scales, zeros = make_problem(0, 1, k, n, group, False, torch.bfloat16)
    w = dequantize(q, scales, None, group).to(torch.bfloat16)

    def bench(fn, reps=50):
        for _ in range(5):
            fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3

    print(f"threads={torch.get_num_threads()} paths={PATHS}")
    for path in PATHS[::-1]:
        print(f"int8_group_matmul[{path}]: {bench(lambda: int8_group_matmul(x, q, scales, None, group, impl=path), 10 if path == 'scalar' else 50):.3f} ms")
    zs = torch.zeros_like(scales)
    print(f"int8_group_matmul[auto, zeros]: {bench(lambda: int8_group_matmul(x, q, scales, zs, group)):.3f} ms")
    print(f"F.linear bf16 dense:      {bench(lambda: torch.nn.functional.linear(x, w)):.3f} ms")
    xf, wf = x.float(), w.float()
    print(f"F.linear fp32 dense:      {bench(lambda: torch.nn.functional.linear(xf, wf)):.3f} ms")
    for m in (4, 16):
        xm = torch.randn(m, k).to(torch.bfloat16)
        print(f"M={m}: int8_group_matmul {bench(lambda: int8_group_matmul(xm, q, scales, None, group)):.3f} ms, "
              f"F.linear bf16 {bench(lambda: torch.nn.functional.linear(xm, w)):.3f} ms")


if __name__ == "__main__":
    _timing()
