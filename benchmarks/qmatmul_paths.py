"""The packed matmul on weights kept in rows (the float32 AVX-512 path, the default before VNNI
blocks) against the same weights in VNNI blocks (the avx512-vnni path: x rounded to int16 per
group, exact int32 group sums; kvshare/model/csrc/qmatmul.cpp), on the bundled model's own
weights: one layer's four matrices and the tied vocab projection, by row count, in one process,
the two interleaved. Prints ms per call (median of 15) and the ratio rows / blocks (> 1: the
VNNI blocks are faster).

    python benchmarks/qmatmul_paths.py [--rows 1,4,16,64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.gguf_quants import to_group_affine
from kvshare.model.kernels import qmatmul
from kvshare.model.loader import bundled_model_path
TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
           "token_embd.weight"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64")
    args = ap.parse_args(argv)
    qmatmul.QMATMUL.wait_until_built()
    if "avx512-vnni" not in qmatmul.qmatmul_paths():
        print("this CPU has no AVX-512 VNNI", file=sys.stderr)
        return 2
    f = open_gguf_file(bundled_model_path())
    print(f"threads {torch.get_num_threads()}")
    print(f"{'tensor':<26} {'type':>5} {'N x K':>12} {'rows':>5} {'rows ms':>11} {'blocks ms':>8} {'ratio':>6}")
    for name in TENSORS:
        t = f.tensor(name)
        w = to_group_affine(t.data, t.tensor_type, t.rows_shape)
        int4 = w.bits == 4 and w.group % 32 == 0
        q = qmatmul.pack_int4_rows(w.q) if int4 else w.q.to(torch.int8).contiguous()
        scale, zero = w.scale.float().contiguous(), None if w.zero is None else w.zero.float().contiguous()
        blocks = qmatmul.to_vnni_blocks(q, scale, zero, w.group, int4)
        fn = qmatmul.int4_group_matmul if int4 else qmatmul.int8_group_matmul
        n, k = w.shape
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            calls = {"rows": lambda: fn(x, q, scale, zero, w.group), "blocks": lambda: blocks.matmul(x)}
            times = {key: [] for key in calls}
            for _ in range(15):
                for key, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - t0)
            a, v = (statistics.median(times[key]) * 1e3 for key in ("rows", "blocks"))
            print(f"{name:<26} {t.type_name:>5} {n:>5} x {k:<5} {rows:>5} {a:>11.3f} {v:>8.3f} {a / v:>5.2f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
