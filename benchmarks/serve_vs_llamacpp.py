"""kvshare's default server vs llama.cpp's llama-server on the same GGUF, same load generator.

For every (workload, concurrency) configuration each server is started fresh (no prefix cache
warmed by an earlier configuration), gets two warm-up requests, then one `kvshare bench serve`
level; it is stopped before the other server starts, so only one server uses the two cores at
a time. Both get the same prompts (one tag per configuration), 2 threads, ignore_eos so both
generate the requested lengths. llama-server comes from benchmarks/build_llama_cpp.sh (built
from the llama.cpp source vendored in llama-cpp-python==0.3.36), with one slot per concurrent
request and a context of 1,024 tokens per slot.

    python benchmarks/serve_vs_llamacpp.py
    python benchmarks/serve_vs_llamacpp.py --levels 16 --workloads shared
    python benchmarks/serve_vs_llamacpp.py --model bench_out/real_shapes/llama-3.2-1b-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_vs_hf import ROOT, Server  # noqa: E402

from kvshare.bench.report import format_table  # noqa: E402
from kvshare.bench.serve import SweepOptions, parse_length_range, parse_levels, run_sweep  # noqa: E402
from kvshare.model.loader import bundled_model_path  # noqa: E402
from kvshare.testing.ports import free_port  # noqa: E402

LLAMA_SERVER = os.path.join(ROOT, "bench_out", "llama_cpp", "bin", "llama-server")


def start(name: str, args, log_dir: str, env: dict) -> Server:
    port = free_port()
    if name == "kvshare":
        model = ["--model", args.model] if args.model else []
        cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(port), "--no-access-log", *model,
               *args.kvshare_args.split()]
        return Server(name, cmd, port, "/ready", log_dir, env)
    cmd = [LLAMA_SERVER, "-m", args.model or bundled_model_path(), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.slots),
           "-c", str(args.slots * args.ctx_per_slot), *args.llama_args.split()]
    return Server(name, cmd, port, "/health", log_dir, env)


def one_config(name: str, workload: str, level: float, tag: str, args, log_dir: str, env: dict) -> dict:
    srv = start(name, args, log_dir, env)
    try:
        srv.wait_ready()
        asyncio.run(run_sweep(SweepOptions(base_url=srv.url, workload="mixed", levels=(2,), num_requests=2,
                                           max_tokens=8, warmup=0, label=f"{name}-warmup", ignore_eos=True),
                              log=lambda m: None))
        opts = SweepOptions(base_url=srv.url, workload=workload, levels=(level,), warmup=0,
                            max_tokens=args.max_tokens, per_level_factor=args.requests_per_level,
                            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                            label=name, tag=tag, ignore_eos=True)
        return asyncio.run(run_sweep(opts, log=lambda m: print(m, flush=True)))
    finally:
        srv.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=parse_levels, default="1,16")
    ap.add_argument("--workloads", default="shared,mixed")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-level", type=float, default=1.5)
    ap.add_argument("--prompt-tokens", type=parse_length_range, default="64,512",
                    help="mixed workload: prompt length range MIN,MAX")
    ap.add_argument("--output-tokens", type=parse_length_range, default="32,128",
                    help="mixed workload: output length range MIN,MAX")
    ap.add_argument("--model", default=None, help="a GGUF file both servers load (default: the bundled model)")
    ap.add_argument("--kvshare-args", default="", help="engine options for kvshare serve (default: none)")
    ap.add_argument("--llama-args", default="", help="extra llama-server options")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16, help="llama-server parallel slots")
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--out-json", default=os.path.join(ROOT, "bench_out", "serve_vs_llamacpp.json"))
    args = ap.parse_args(argv)
    if args.model:
        args.model = os.path.abspath(args.model)
    if not os.path.exists(LLAMA_SERVER):
        print(f"{LLAMA_SERVER} missing: run benchmarks/build_llama_cpp.sh", file=sys.stderr)
        return 2
    log_dir = os.path.dirname(os.path.abspath(args.out_json))
    os.makedirs(log_dir, exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, KVSHARE_NUM_THREADS=threads)
    rows = []
    for wl in args.workloads.split(","):
        for level in args.levels:
            tag = os.urandom(3).hex()
            res = {name: one_config(name, wl, level, tag, args, log_dir, env) for name in ("kvshare", "llama.cpp")}
            for sw in res.values():
                print(format_table(sw) + "\n")
            k, lc = res["kvshare"]["levels"][0], res["llama.cpp"]["levels"][0]
            row = {"workload": wl, "level": level,
                   "kvshare_total_tok_s": k["total_tok_s"], "llama_total_tok_s": lc["total_tok_s"],
                   "total_ratio": k["total_tok_s"] / lc["total_tok_s"] if lc["total_tok_s"] else None,
                   "kvshare_ttft_p50_s": k["ttft_p50_s"], "llama_ttft_p50_s": lc["ttft_p50_s"],
                   "kvshare_tpot_p50_s": k.get("tpot_p50_s"), "llama_tpot_p50_s": lc.get("tpot_p50_s"),
                   "failed": (k.get("failed"), lc.get("failed")), "sweeps": res}
            rows.append(row)
    print(f"{'workload':<8} {'conc':>4} {'kvshare tok/s':>14} {'llama tok/s':>12} {'ratio':>6} "
          f"{'TTFT p50 kv/llama s':>20} {'TPOT p50 kv/llama ms':>21}")
    for r in rows:
        tp = (f"{(r['kvshare_tpot_p50_s'] or 0) * 1e3:.1f}/{(r['llama_tpot_p50_s'] or 0) * 1e3:.1f}")
        print(f"{r['workload']:<8} {r['level']:>4g} {r['kvshare_total_tok_s']:>14.1f} {r['llama_total_tok_s']:>12.1f} "
              f"{r['total_ratio']:>5.2f}x {r['kvshare_ttft_p50_s']:>9.2f}/{r['llama_ttft_p50_s']:<9.2f} {tp:>21}")
    with open(args.out_json, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/serve_vs_llamacpp.py", *(argv or sys.argv[1:])]),
                   "rows": rows}, f, indent=2)
    print(f"results {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
