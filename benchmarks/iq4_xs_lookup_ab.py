"""Kernel level: IQ4_XS weights in VNNI blocks as 4-bit indices into the IQ4_NL table, looked up
in the kernel ("nl4": qmatmul.cpp NL4, what GroupIQ4NLLinear keeps), against the same weights
with each index widened to its table value as an int8 code ("int8": the int8-group kernel, what
IQ4_XS took before), both with the file's compact scales: the same output bits, half the code
bytes.

Per shape, --count distinct random matrices (more than the caches hold) are streamed in turn,
the two layouts alternating round by round (so that load from other work falls on both alike);
prints the median time per matrix, the bytes each layout holds, and int8 / nl4 time.

    python benchmarks/iq4_xs_lookup_ab.py                      # M = 1 and 16, 2 threads
    python benchmarks/iq4_xs_lookup_ab.py --rows 1,4,16,64 --shapes 2048x2048
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from kvshare.model.kernels import qmatmul


def random_iq4_xs(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, bytes per row] of IQ4_XS blocks: random indices and scales, a small float16 d."""
    raw = rng.integers(0, 256, (n, k // 256, 136), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, (n, k // 256)).astype(np.float16)
    raw[:, :, 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def layouts(n: int, k: int, rng) -> dict[str, qmatmul.VnniBlocks]:
    raw = random_iq4_xs(n, k, rng)
    addrs = torch.from_numpy(raw.ctypes.data + np.arange(n, dtype=np.int64) * raw.strides[0])
    runs = [(addrs, int(QT.IQ4_XS))]
    out = {}
    for name, int4 in (("int8", False), ("nl4", True)):
        q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, 32, False, int4, True, "compact")
        out[name] = qmatmul.VnniBlocks(q, s, None, n, k, 32, int4, "compact", iq4nl=int4)
    return out


def nbytes(b: qmatmul.VnniBlocks) -> int:
    return sum(t.numel() * t.element_size() for t in (b.q, b.scales, b.zeros) if t is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x2048,2048x8192,2048x2048", help="N x K of each matrix")
    ap.add_argument("--rows", default="1,16", help="M values (decode rows)")
    ap.add_argument("--count", type=int, default=16, help="distinct matrices streamed per call round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not qmatmul.QMATMUL.wait_until_built() or not qmatmul.vnni_blocks_fit(16, 256, 32):
        raise SystemExit("needs the C++ kernels and an AVX-512 VNNI CPU")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("| N x K | M | int8 ms | nl4 ms | bytes nl4 / int8 | time int8 / nl4 |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        mats = [layouts(n, k, rng) for _ in range(args.count)]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            assert torch.equal(mats[0]["int8"].matmul(x), mats[0]["nl4"].matmul(x)), "the layouts' bits differ"
            times: dict[str, list[float]] = {"int8": [], "nl4": []}
            for r in range(args.rounds):
                for lay in ("int8", "nl4") if r % 2 == 0 else ("nl4", "int8"):
                    t0 = time.perf_counter()
                    for mat in mats:
                        mat[lay].matmul(x)
                    times[lay].append((time.perf_counter() - t0) / len(mats))
            a, b = statistics.median(times["int8"]), statistics.median(times["nl4"])
            ratio = nbytes(mats[0]["nl4"]) / nbytes(mats[0]["int8"])
            print(f"| {shape} | {m} | {a * 1e3:.3f} | {b * 1e3:.3f} | {ratio:.3f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
