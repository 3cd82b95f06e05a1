"""Kernel level, batch-1 decode: weights in VNNI blocks with float32 scales ("full") against the
scales as the GGUF file has them ("compact": the K-quants' code per group x float16 base per
super-block; "half": one float16 per group), the same codes, the same output bits.

Per format and shape, --count distinct matrices (more than the caches hold) are streamed in turn,
the two layouts alternating round by round; prints the median time per matrix, the bytes each
layout reads, and full / file-form time. Run on a quiet machine.

    python benchmarks/compact_scales_ab.py                       # Q4_K Q6_K Q4_0 Q8_0, M = 1
    python benchmarks/compact_scales_ab.py --types Q4_K --rows 1,2,8,12,40
"""
from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from kvshare.model.gguf_quants import GGUFBlocks
from kvshare.model.kernels import qmatmul

# Where a K-quant block keeps its float16 d (and dmin): the rest of a random block is any bytes.
_HALF_FIELDS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
                QT.IQ4_XS: (0,)}


def random_rows(qtype: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in _HALF_FIELDS:
        return gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        d = (rng.uniform(1e-4, 1e-3, (n, k // block))).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def layouts(qtype: QT, n: int, k: int, rng) -> dict[str, qmatmul.VnniBlocks]:
    lazy = GGUFBlocks.of_tensor(random_rows(qtype, n, k, rng), qtype, (n, k))
    int4 = qtype in (QT.Q4_0, QT.Q4_1, QT.Q4_K)
    runs = [(p.row_addresses(), int(p.qtype)) for p in lazy.parts]
    form = "compact" if int(qtype) in qmatmul.COMPACT_GGML_TYPES else "half"
    q, s, z = qmatmul.repack_gguf_rows(runs, n, k, lazy.group, lazy.has_zero, int4, True)
    full = qmatmul.VnniBlocks(q, s, z, n, k, lazy.group, int4)
    q, s, z = qmatmul.repack_gguf_rows(runs, n, k, lazy.group, lazy.has_zero, int4, True, form)
    zero_mul = qmatmul.Q4_0_ZERO_MUL if qtype == QT.Q4_0 else 0.0
    return {"full": full, "file": qmatmul.VnniBlocks(q, s, z, n, k, lazy.group, int4, form, zero_mul)}


def nbytes(b: qmatmul.VnniBlocks) -> int:
    return sum(t.numel() * t.element_size() for t in (b.q, b.scales, b.zeros) if t is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q4_0,Q8_0")
    ap.add_argument("--shapes", default="8192x2048,2048x8192", help="N x K of each matrix")
    ap.add_argument("--rows", default="1", help="M values (decode rows)")
    ap.add_argument("--count", type=int, default=30, help="distinct matrices streamed per call round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not qmatmul.QMATMUL.wait_until_built() or not qmatmul.vnni_blocks_fit(16, 256, 32):
        raise SystemExit("needs the C++ kernels and an AVX-512 VNNI CPU")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("| format | N x K | M | full ms | file-form ms | bytes file / full | time full / file |")
    print("|---|---|---|---|---|---|---|")
    for name in args.types.split(","):
        qtype = QT[name]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            mats = [layouts(qtype, n, k, rng) for _ in range(args.count)]
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k)
                assert torch.equal(mats[0]["full"].matmul(x), mats[0]["file"].matmul(x)), "the layouts' bits differ"
                times: dict[str, list[float]] = {"full": [], "file": []}
                for r in range(args.rounds):
                    for lay in ("full", "file") if r % 2 == 0 else ("file", "full"):
                        t0 = time.perf_counter()
                        for mat in mats:
                            mat[lay].matmul(x)
                        times[lay].append((time.perf_counter() - t0) / len(mats))
                f, c = statistics.median(times["full"]), statistics.median(times["file"])
                ratio = nbytes(mats[0]["file"]) / nbytes(mats[0]["full"])
                print(f"| {name} | {shape} | {m} | {f * 1e3:.3f} | {c * 1e3:.3f} | {ratio:.3f} | {f / c:.2f}x |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
