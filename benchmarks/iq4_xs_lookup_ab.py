"""Kernel level: IQ4_XS weights in VNNI blocks as 4-bit indices into the IQ4_NL table, looked up
in the kernel ("file": qmatmul.cpp NL4, what GroupIQ4NLLinear keeps), against the same weights
with each index widened to its table value as an int8 code ("int8": the int8-group kernel, what
IQ4_XS took before), both with the file's compact scales: the same output bits, half the code
bytes. --types Q6_K: Q6_K's codes as a 4-bit and a 2-bit plane ("file": qmatmul.cpp I6,
GroupQ6PlanesLinear) against its int8 codes: the same bits, 0.75 of the code bytes. --types Q5_K
(Q5_0, Q5_1): the 5-bit codes as a 4-bit and a 1-bit plane ("file": qmatmul.cpp I5 / I5S,
GroupQ5PlanesLinear) against their int8 codes: the same bits, 0.625 of the code bytes.

Per shape, --count distinct random matrices (more than the caches hold) are streamed in turn,
the two layouts alternating round by round (so that load from other work falls on both alike);
prints the median time per matrix, the bytes each layout holds, and int8 / file-bits time.

    python benchmarks/iq4_xs_lookup_ab.py                      # IQ4_XS, M = 1 and 16, 2 threads
    python benchmarks/iq4_xs_lookup_ab.py --types IQ4_XS,Q6_K,Q5_K,Q5_0
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


# Per type: weights and bytes per block, where its float16s (d, and dmin or m) sit, group size,
# the scale form the file's blocks keep in VNNI blocks, whether it has zeros.
_TYPES = {"IQ4_XS": (256, 136, (0,), 32, "compact", False), "Q6_K": (256, 210, (208,), 16, "compact", False),
          "Q5_K": (256, 176, (0, 2), 32, "compact", True), "Q5_0": (32, 22, (0,), 32, "half", False),
          "Q5_1": (32, 24, (0, 2), 32, "half", True)}


def random_rows(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, bytes per row] of random blocks (codes and scales) with small float16s."""
    block, size, at, *_ = _TYPES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for a in at:
        d = rng.uniform(1e-4, 1e-3, (n, k // block)).astype(np.float16)
        raw[:, :, a:a + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def layouts(qtype: str, n: int, k: int, rng) -> dict[str, qmatmul.VnniBlocks]:
    raw = random_rows(qtype, n, k, rng)
    addrs = torch.from_numpy(raw.ctypes.data + np.arange(n, dtype=np.int64) * raw.strides[0])
    runs = [(addrs, int(QT[qtype]))]
    *_, g, form, zeros = _TYPES[qtype]
    q, s, z = qmatmul.repack_gguf_rows(runs, n, k, g, zeros, False, True, form)
    out = {"int8": qmatmul.VnniBlocks(q, s, z, n, k, g, False, form)}
    if qtype == "IQ4_XS":
        q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, g, False, True, True, form)
        out["file"] = qmatmul.VnniBlocks(q, s, None, n, k, g, True, form, iq4nl=True)
    elif qtype == "Q6_K":
        q, s, _ = qmatmul.repack_gguf_rows(runs, n, k, g, False, False, True, form, planes6=True)
        out["file"] = qmatmul.VnniBlocks(q, s, None, n, k, g, False, form, planes6=True)
    else:
        q, s, z = qmatmul.repack_gguf_rows(runs, n, k, g, zeros, False, True, form, planes5=True)
        out["file"] = qmatmul.VnniBlocks(q, s, z, n, k, g, False, form, planes5=True, planes5_signed=qtype == "Q5_0")
    return out


def nbytes(b: qmatmul.VnniBlocks) -> int:
    return sum(t.numel() * t.element_size() for t in (b.q, b.scales, b.zeros) if t is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ4_XS", help="IQ4_XS, Q6_K, Q5_K, Q5_0, Q5_1")
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
    print("| type | N x K | M | int8 ms | file-bits ms | bytes file-bits / int8 | time int8 / file-bits |")
    print("|---|---|---|---|---|---|---|")
    for qtype, shape in ((t, s) for t in args.types.split(",") for s in args.shapes.split(",")):
        n, k = (int(v) for v in shape.split("x"))
        mats = [layouts(qtype, n, k, rng) for _ in range(args.count)]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            assert torch.equal(mats[0]["int8"].matmul(x), mats[0]["file"].matmul(x)), "the layouts' bits differ"
            times: dict[str, list[float]] = {"int8": [], "file": []}
            for r in range(args.rounds):
                for lay in ("int8", "file") if r % 2 == 0 else ("file", "int8"):
                    t0 = time.perf_counter()
                    for mat in mats:
                        mat[lay].matmul(x)
                    times[lay].append((time.perf_counter() - t0) / len(mats))
            a, b = statistics.median(times["int8"]), statistics.median(times["file"])
            ratio = nbytes(mats[0]["file"]) / nbytes(mats[0]["int8"])
            print(f"| {qtype} | {shape} | {m} | {a * 1e3:.3f} | {b * 1e3:.3f} | {ratio:.3f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
