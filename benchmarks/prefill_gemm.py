"""One layer's prefill GEMM on the bundled model's weights: float32 dense, bfloat16 dense (the
default's prefill_dtype on avx512_bf16 CPUs) and W8A8 (int8 rows x int8 channels through
torch._int_mm, with and without requantizing the weights per call), ms and max error relative to
the largest output against a float64 reference. Also the C++ dequantization into the scratch.

    python benchmarks/prefill_gemm.py
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.gguf_quants import to_group_affine
from kvshare.model.kernels import qmatmul
from kvshare.model.loader import bundled_model_path
from kvshare.model.qlinear import DequantScratch, GroupInt4Linear


def bench(fn, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    assert qmatmul.QMATMUL.wait_until_built(), qmatmul.QMATMUL.unavailable_reason()
    f = open_gguf_file(bundled_model_path())
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}")
    for name in ("blk.0.ffn_down.weight", "blk.0.ffn_up.weight"):
        t = f.tensor(name)
        lin = GroupInt4Linear(to_group_affine(t.data, t.tensor_type, t.rows_shape), torch.float32, DequantScratch())
        n, k = lin.out_features, lin.in_features
        wf = lin.dense()
        wb = torch.empty(n, k, dtype=torch.bfloat16)
        w8 = torch.empty(n, k, dtype=torch.int8)
        scratch32 = torch.empty(n, k)
        print(f"\n{name} ({n} x {k}, {t.type_name}): C++ dequantization into the scratch "
              f"{bench(lambda: lin.dense(scratch32), 30):.3f} ms float32, {bench(lambda: lin.dense(wb), 30):.3f} ms "
              f"bfloat16; PyTorch ops {bench(lambda: lin._affine(slice(None)), 10):.3f} ms")

        def requant() -> torch.Tensor:
            w = lin.dense(torch.empty(n, k))
            sw = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            torch.round(w / sw, out=w)
            w8.copy_(w)
            return sw

        sw0 = requant()
        for m in (512, 2048):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = x.double() @ wf.double().T

            def w8a8(sw=sw0):
                sx = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
                return torch._int_mm(torch.round(x / sx).to(torch.int8), w8.t()).float() * sx * sw.T

            variants = {
                "float32 dense": lambda: F.linear(x, lin.dense(scratch32)),
                "bfloat16 dense": lambda: F.linear(x.bfloat16(), lin.dense(wb)).float(),
                "W8A8, weights int8 precomputed": w8a8,
                "W8A8 + per-call requantization": lambda: w8a8(requant()),
            }
            for label, fn in variants.items():
                ms = bench(fn)
                err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
                print(f"  rows {m:5}  {label:<32} {ms:8.2f} ms  {2 * m * n * k / ms / 1e6:7.1f} GFLOP/s  "
                      f"max rel err {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
