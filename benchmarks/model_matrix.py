"""kvshare against llama.cpp on GGUF files of real model shapes, cell by cell (shape x format).

Per cell, side by side in one run (each engine in a fresh process, one after the other):
- decode ms/token at batch 1 (128 greedy tokens after a 400-token prompt; kvshare through
  benchmarks/cpu_decode.py's worker, llama.cpp through `llama-bench -p 0 -n 128 -d 400`), and the
  GB/s it implies: the weight bytes one token reads (every matrix of the file once; the token
  embedding only when it is also the output projection) / the time;
- prompt tok/s at 512 tokens (`llama-bench -p 512 -n 0`);
- kvshare's resident weight bytes against the file's tensor bytes, its RSS after load, and its
  ready time (LLM() to the first token of a one-token prompt);
- this machine's memory bandwidth, measured here (a streaming sum over 1 GiB, 2 threads), and
  decode's ratio to "bytes per token / bandwidth".

The files are random-weight GGUFs of real shapes made by benchmarks/real_shape_gguf.py (float16
written with `gguf`, quantized by llama.cpp's llama-quantize) into the git-ignored
bench_out/real_shapes/. llama.cpp is built by benchmarks/build_llama_cpp.sh.

    python benchmarks/model_matrix.py --quick                 # llama-3.2-1b in three formats
    python benchmarks/model_matrix.py                         # every shape x every format (hours)
    python benchmarks/model_matrix.py --shapes llama-3.1-8b --formats Q4_K_M

Run on a quiet machine; results go to bench_out/model_matrix.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from real_shape_gguf import OUT_DIR, SHAPES, real_shape_gguf  # noqa: E402

LLAMA_BENCH = os.path.join(ROOT, "bench_out", "llama_cpp", "bin", "llama-bench")
FORMATS = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS"]
QUICK = [("llama-3.2-1b", "Q4_K_M"), ("llama-3.2-1b", "Q8_0"), ("llama-3.2-1b", "Q4_0")]


def memory_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """GB/s of a streaming read with 2 threads: the median of `repeats` sums over `gib` GiB."""
    import torch

    torch.set_num_threads(2)
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def file_facts(path: str) -> dict:
    """The file's tensor bytes, and the bytes a decode step reads (each matrix once; the token
    embedding only when tied, as the output projection)."""
    from kvshare.model.gguf_header import read_gguf_header

    h = read_gguf_header(path)
    names = {t.name for t in h.tensors}
    tensor_bytes = sum(t.nbytes for t in h.tensors)
    per_token = sum(t.nbytes for t in h.tensors
                    if t.name != "token_embd.weight" or "output.weight" not in names)
    return {"file_bytes": os.path.getsize(path), "tensor_bytes": tensor_bytes, "bytes_per_token": per_token,
            "types": sorted({t.type_name for t in h.tensors if len(t.shape) > 1})}


def run_kvshare(path: str, repeats: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_decode.py"), "--worker",
                        "kvshare-default", "--repeats", str(repeats), "--decode-tokens", "128", "--model", path],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama_bench(path: str, repeats: int) -> dict:
    if not os.path.exists(LLAMA_BENCH):
        return {"error": f"{LLAMA_BENCH} missing: run benchmarks/build_llama_cpp.sh"}
    out = {}
    for key, args in (("prompt_tok_s", ["-p", "512", "-n", "0"]), ("decode_tok_s", ["-p", "0", "-n", "128", "-d", "400"])):
        r = subprocess.run([LLAMA_BENCH, "-m", path, "-t", "2", "-r", str(repeats), "-o", "json", *args],
                           capture_output=True, text=True)
        if r.returncode:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
        out[key] = json.loads(r.stdout)[0]["avg_ts"]
    out["decode_ms"] = 1e3 / out["decode_tok_s"]
    return out


def measure_cell(shape: str, fmt: str, repeats: int, bandwidth: float, keep_f16: bool) -> dict:
    path = real_shape_gguf(shape, fmt, keep_f16=keep_f16)
    cell = {"shape": shape, "format": fmt, "path": path, **file_facts(path)}
    ks = run_kvshare(path, repeats)
    cell["kvshare"] = ks
    if "error" not in ks:
        ks["decode_ms"] = statistics.median(ks["tpot_ms"])
        ks["prompt_tok_s"] = statistics.median(ks["prefill_tok_s"])
    cell["llama.cpp"] = run_llama_bench(path, repeats)
    cell["bandwidth_floor_ms"] = cell["bytes_per_token"] / (bandwidth * 1e9) * 1e3
    return cell


def _row(c: dict) -> str:
    ks, ll = c["kvshare"], c["llama.cpp"]
    mib = 2**20
    if "error" in ks:
        return f"| {c['shape']} | {c['format']} | kvshare failed: {ks['error'][:80]} |"
    ll_ms = ll.get("decode_ms", float("nan"))
    ll_pp = ll.get("prompt_tok_s", float("nan"))
    gbs = lambda ms: c["bytes_per_token"] / (ms * 1e-3) / 1e9  # noqa: E731
    return (f"| {c['shape']} | {c['format']} | {ks['decode_ms']:.1f} / {ll_ms:.1f} ({ks['decode_ms'] / ll_ms:.2f}x) "
            f"| {gbs(ks['decode_ms']):.1f} / {gbs(ll_ms):.1f} | {ks['decode_ms'] / c['bandwidth_floor_ms']:.2f}x "
            f"| {ks['prompt_tok_s']:.0f} / {ll_pp:.0f} ({ks['prompt_tok_s'] / ll_pp:.2f}x) "
            f"| {ks['weight_bytes'] / mib:.0f} / {c['tensor_bytes'] / mib:.0f} ({ks['weight_bytes'] / c['tensor_bytes']:.2f}x) "
            f"| {ks['rss_after_load'] / mib:.0f} | {ks['ready_s']:.1f} |")


HEADER = ("| shape | format | decode ms/token kvshare / llama.cpp | GB/s kvshare / llama.cpp | kvshare / floor "
          "| prompt tok/s (512) kvshare / llama.cpp | resident MiB kvshare / file tensors | RSS MiB | ready s |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated (real_shape_gguf.py --list)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-files", action="store_true", help="keep each shape's float16 file at the end")
    ap.add_argument("--json-out", default=os.path.join(ROOT, "bench_out", "model_matrix.json"))
    args = ap.parse_args(argv)
    cells = QUICK if args.quick else [(s, f) for s in args.shapes.split(",") for f in args.formats.split(",")]
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth (streaming sum, 2 threads): {bandwidth:.1f} GB/s", flush=True)
    results = []
    print(HEADER, flush=True)
    for i, (shape, fmt) in enumerate(cells):
        more_of_shape = any(s == shape for s, _ in cells[i + 1:])
        try:
            cell = measure_cell(shape, fmt, args.repeats, bandwidth, keep_f16=more_of_shape or args.keep_files)
        except (SystemExit, subprocess.CalledProcessError, RuntimeError, OSError) as e:
            cell = {"shape": shape, "format": fmt, "kvshare": {"error": str(e)}, "llama.cpp": {}}
        results.append(cell)
        print(_row(cell), flush=True)
        with open(args.json_out, "w") as f:
            json.dump({"bandwidth_gb_s": bandwidth, "cells": results}, f, indent=1)
    print(f"\n(files in {OUT_DIR}; json {args.json_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
