"""What bounds the serving benchmark's short-output mixed workload: prefill compute, at the same
rate in kvshare and HF transformers (issue 5, docs/benchmarks.md).

One torch thread (as in benchmarks/serve_vs_hf.py), float32, the bundled model, prompts of the
serve benchmark's mixed size (~320 tokens of English text):
  1. HF transformers: one prompt's forward pass (what `transformers serve` does per request
     before its first token), tokens per second;
  2. kvshare: 24 such prompts prefilled together (max_tokens=1), the way the server's 2,048-token
     steps batch them, tokens per second, and the torch profiler's split of that run by operator;
  3. the GEMM ceiling: the model's own linear layers alone on 2,048 rows, tokens per second.

    python benchmarks/prefill_bound.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--num-prompts", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from kvshare import LLM, SamplingParams
    from kvshare.bench.workloads import token_prompts

    llm = LLM(dtype="float32", quantization=None, kv_cache_memory="512MiB", enable_prefix_caching=False,
              num_threads=1)  # the dequantized float32 path this profile was recorded on
    prompts = token_prompts(llm.engine.tokenizer.encode, [args.prompt_len] * args.num_prompts, offset_step=7)
    params = SamplingParams(max_tokens=1, temperature=0)

    def kvshare_run() -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return args.num_prompts * args.prompt_len / (time.perf_counter() - t)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import serve_vs_hf as svh  # the HF directory the serving benchmark exports
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(svh.export_hf_dir(os.path.join(svh.ROOT, "bench_out", "smol-hf")),
                                              dtype=torch.float32).eval()

    def hf_run() -> float:
        ids = torch.tensor([prompts[0]])
        t = time.perf_counter()
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)
        return args.prompt_len / (time.perf_counter() - t)

    # The linear layers alone, as kvshare runs them (fused qkv and gate/up), on 2,048 rows.
    layers = llm.engine.model.layers
    x = torch.randn(2048, layers[0].qkv.in_features)

    def gemm_run() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for layer in layers:
                layer.qkv(x)
                layer.o(x)
                gate_up = layer.gate_up(x)
                layer.down(gate_up[:, :layer.down.in_features])
        return 2048 / (time.perf_counter() - t)

    for f in (kvshare_run, hf_run, gemm_run):
        f()  # warm-up
    res = {"hf one prompt": [], "kvshare 24 prompts": [], "linear layers only": []}
    for _ in range(args.repeats):
        res["hf one prompt"].append(hf_run())
        res["kvshare 24 prompts"].append(kvshare_run())
        res["linear layers only"].append(gemm_run())
    print(f"prefill tok/s, one thread, float32, {args.prompt_len}-token prompts, median of {args.repeats}:")
    for k, v in res.items():
        print(f"  {k:<20} {statistics.median(v):7.1f}   (runs: {', '.join(f'{x:.1f}' for x in v)})")

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kvshare_run()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nkvshare prefill of {args.num_prompts} prompts, self CPU time by operator (top 8 of {total / 1e6:.2f} s):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"  {e.key:<40} {100 * e.self_cpu_time_total / total:5.1f}%")


if __name__ == "__main__":
    main()
