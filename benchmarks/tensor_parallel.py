"""Tensor parallel against one process, on the bundled SmolLM2-135M-Instruct, in one run.

Each configuration runs in its own fresh process (its load time is its own, no warm cache):
TP=1 and TP=2 (shared memory collectives, and the gloo fallback) in the default mode (weights
kept quantized) and in the exact mode (dequantized float32). Each reports:
- load: seconds from the LLM() call until it returns (TP=2: both ranks loaded and joined);
- ms per output token at batch 1: 128 greedy tokens after a 400-token prompt (median of --repeats);
- prompt tok/s on a 512-token prompt (median of --repeats);
- offline throughput: --num-prompts prompts of 64-512 tokens, 32-128 output tokens each (the
  offline_throughput.py mixed workload), all submitted at once, total tok/s.
The threads are the machine's, split between the ranks (2 cores here: one thread per rank).

    python benchmarks/tensor_parallel.py
    python benchmarks/tensor_parallel.py --configs tp1-default,tp2-default --repeats 5
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

EXACT = {"dtype": "float32", "quantization": None}
CONFIGS = {
    "tp1-default": {},
    "tp2-default": {"tensor_parallel_size": 2},
    "tp2-default-gloo": {"tensor_parallel_size": 2, "tensor_parallel_backend": "gloo"},
    "tp1-exact": EXACT,
    "tp2-exact": {"tensor_parallel_size": 2, **EXACT},
}


def worker(name: str, args) -> dict:
    from cpu_decode import _tokens
    from offline_throughput import build_workload, run_kvshare

    from kvshare import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(kv_cache_memory="256MiB", enable_prefix_caching=False, **CONFIGS[name])
    load_s = time.perf_counter() - t0
    decode_ids, prefill_ids = _tokens(None, 400, 512)
    prefill, tpot = [], []
    for _ in range(args.repeats):
        out = llm.generate([{"prompt_token_ids": prefill_ids}], SamplingParams(temperature=0, max_tokens=1),
                           use_tqdm=False)[0]
        prefill.append(len(prefill_ids) / out.metrics.time_to_first_token)
        out = llm.generate([{"prompt_token_ids": decode_ids}], SamplingParams(temperature=0, max_tokens=128,
                                                                              ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        tpot.append((m.finished_time - m.first_token_time) / 127 * 1e3)
    prompts, outs = build_workload(llm.get_tokenizer(), args.num_prompts, seed=0)
    elapsed, _ = run_kvshare(llm, prompts, outs, measure_util=False)
    total = sum(len(p) for p in prompts) + sum(outs)
    llm.engine.close()
    return {"config": name, "load_s": load_s, "tpot_ms": statistics.median(tpot),
            "prefill_tok_s": statistics.median(prefill), "offline_tok_s": total / elapsed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--out-json", default=os.path.join(ROOT, "bench_out", "tensor_parallel.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return 0
    results = {}
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r} (known: {', '.join(CONFIGS)})")
        r = subprocess.run([sys.executable, __file__, "--worker", name, "--repeats", str(args.repeats),
                            "--num-prompts", str(args.num_prompts)], capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(r.stderr[-3000:])
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{'config':<18}{'load s':>8}{'ms/token':>10}{'prompt tok/s':>14}{'offline tok/s':>15}")
    for name, r in results.items():
        print(f"{name:<18}{r['load_s']:>8.2f}{r['tpot_ms']:>10.2f}{r['prefill_tok_s']:>14.1f}{r['offline_tok_s']:>15.1f}")
    for mode in ("default", "exact"):
        one = results.get(f"tp1-{mode}")
        for name, r in results.items():
            if one is not None and name.startswith("tp2-") and mode in name:
                print(f"{name} / tp1-{mode}: ms/token {r['tpot_ms'] / one['tpot_ms']:.2f}x, prompt tok/s "
                      f"{r['prefill_tok_s'] / one['prefill_tok_s']:.2f}x, offline tok/s "
                      f"{r['offline_tok_s'] / one['offline_tok_s']:.2f}x")
    os.makedirs(os.path.dirname(args.out_json), exist_ok=True)
    with open(args.out_json, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
