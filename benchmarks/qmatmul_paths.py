"""The packed matmul on weights kept in rows (the float32 AVX-512 path, the default before VNNI
blocks) against the same weights in VNNI blocks (the avx512-vnni path: x rounded to int16 per
group, exact int32 group sums; kvshare/model/csrc/qmatmul.cpp), on the bundled model's own
weights: one layer's four matrices and the tied vocab projection, by row count, in one process,
the two interleaved. Prints ms per call (median of 15) and the ratio rows / blocks (> 1: the
VNNI blocks are faster).

    python benchmarks/qmatmul_paths.py [--rows 1,4,16,64]

--prefill: prompt-sized calls instead (token rows hand every prompt row to the packed kernel):
the avx512-vnni path against the dense path it replaced (qlinear's `_dense`: the weight
dequantized into a bfloat16 scratch, then a bf16 GEMM) and, with --baseline, against the
avx512-vnni path of another qmatmul.cpp (e.g. main's: compiled here with the kernels' flags),
on random weights of the bundled model's shapes (int4 g32 with zeros, int8 g32 without) and of
Llama-3.2-1B / Llama-3-8B (int4 g32 with zeros), interleaved, median of --repeats, threads as
torch has them (--threads).

    python benchmarks/qmatmul_paths.py --prefill --baseline /work/main/kvshare/model/csrc/qmatmul.cpp \
        [--rows 128,256,512,1024,2048] [--shapes bundled,1b,8b] [--repeats 7]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.gguf_quants import to_group_affine
from kvshare.model.kernels import build, qmatmul
from kvshare.model.loader import bundled_model_path
from kvshare.model.qlinear import DequantScratch, make_linear
TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
           "token_embd.weight"]


# --prefill shapes (N x K, formats): the bundled model's four matrices, Llama-3.2-1B's and
# Llama-3-8B's (qkv, o, gate_up, down).
PREFILL_SHAPES = {
    "bundled": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
    "8b": [("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}


def _baseline_library(path: str, tmp: str) -> ctypes.CDLL:
    """A qmatmul library from another source (compiled into tmp with the kernels' flags) or .so."""
    if path.endswith(".cpp"):
        out = os.path.join(tmp, "baseline_qmatmul.so")
        subprocess.run([*build._compiler_cmd(), *build.CXXFLAGS, path, "-o", out], check=True)
        path = out
    lib = ctypes.CDLL(path)
    for fn in (lib.kvs_int4_group_matmul, lib.kvs_int8_group_matmul):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int64,
                       ctypes.c_int, ctypes.c_float]  # (a library from before zero_mul ignores the last)
    return lib


def _baseline_matmul(lib: ctypes.CDLL, blocks: qmatmul.VnniBlocks, x: torch.Tensor) -> torch.Tensor:
    """blocks.matmul(x) through the baseline library (float32 x)."""
    m, k = x.shape
    y = torch.empty(m, blocks.n)
    err = ctypes.create_string_buffer(256)
    fn = lib.kvs_int4_group_matmul if blocks.int4 else lib.kvs_int8_group_matmul
    rc = fn(x.data_ptr(), x.stride(0), 0, blocks.q.data_ptr(), blocks.scales.data_ptr(),
            blocks.zeros.data_ptr() if blocks.zeros is not None else None, y.data_ptr(), y.stride(0), m, blocks.n, k,
            blocks.group, 4, torch.get_num_threads(), err, len(err), blocks.layout, blocks.zero_mul)
    if rc:
        raise RuntimeError(err.value.decode())
    return y


def prefill(args) -> int:
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}; ms per call, median of {args.repeats} (interleaved); "
          f"vnni/dense > 1: the VNNI path is faster")
    head = f"{'shape':<16} {'format':<10} {'N x K':>13} {'rows':>5}"
    print(head + (f" {'base':>9}" if args.baseline else "") + f" {'vnni':>9} {'dense':>9}"
          + (f" {'base/vnni':>9}" if args.baseline else "") + f" {'dense/vnni':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        base = _baseline_library(args.baseline, tmp) if args.baseline else None
        gen = torch.Generator().manual_seed(0)
        for model in args.shapes.split(","):
            for name, n, k in PREFILL_SHAPES[model]:
                formats = [("int4+z", 4, True), ("int8", 8, False)] if model == "bundled" else [("int4+z", 4, True)]
                for fmt, bits, zeros in formats:
                    g = 32
                    lo, hi = (0, 16) if bits == 4 else (-128, 128)
                    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int16)
                    scale = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
                    zero = -8 * scale if zeros else None
                    lin = make_linear(GroupAffine(q.to(torch.uint8 if bits == 4 else torch.int8), scale, zero, g, bits),
                                      torch.float32, DequantScratch(torch.bfloat16))
                    assert lin.blocks is not None
                    for m in rows:
                        x = torch.randn(m, k, generator=gen)
                        calls = {"vnni": lambda: lin.blocks.matmul(x), "dense": lambda: lin._dense(x)}
                        if base is not None:
                            calls = {"base": lambda: _baseline_matmul(base, lin.blocks, x), **calls}
                            assert torch.equal(calls["base"](), calls["vnni"]()), "not the baseline's bits"
                        times = {key: [] for key in calls}
                        for _ in range(args.repeats):
                            for key, call in calls.items():
                                t0 = time.perf_counter()
                                call()
                                times[key].append(time.perf_counter() - t0)
                        ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
                        line = f"{model + ' ' + name:<16} {fmt:<10} {n:>6} x {k:<5} {m:>5}"
                        line += f" {ms['base']:9.3f}" if base is not None else ""
                        line += f" {ms['vnni']:9.3f} {ms['dense']:9.3f}"
                        line += f" {ms['base'] / ms['vnni']:8.2f}x" if base is not None else ""
                        print(line + f" {ms['dense'] / ms['vnni']:9.2f}x", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="row counts (default 1,4,16,64; --prefill 128,...,2048)")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--baseline", default=None, help="--prefill: another qmatmul.cpp (or a built .so) to compare")
    ap.add_argument("--shapes", default="bundled,1b,8b", help="--prefill: of " + ",".join(PREFILL_SHAPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    qmatmul.QMATMUL.wait_until_built()
    if "avx512-vnni" not in qmatmul.qmatmul_paths():
        print("this CPU has no AVX-512 VNNI", file=sys.stderr)
        return 2
    if args.prefill:
        args.rows = args.rows or "128,256,512,1024,2048"
        return prefill(args)
    args.rows = args.rows or "1,4,16,64"
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
