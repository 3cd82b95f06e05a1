"""Offline throughput: kvshare vs HF transformers `generate` (static batches), like for like.

64 prompts of 64-512 tokens of real English text, 32-128 output tokens each, ignore_eos, greedy,
fixed seed, on the bundled SmolLM2-135M-Instruct. Prints output tok/s, total tok/s and the ratio
per dtype, KV slot utilization, single-request decode latency, and a decode-step time breakdown.

    python benchmarks/offline_throughput.py                     # float32 and bfloat16
    python benchmarks/offline_throughput.py --dtypes bfloat16 --hf-batch-sizes 16
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time

import torch

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import mixed_lengths, token_prompts
from kvshare.model.loader import bundled_model_path


def mixed_pairs(num: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths of the mixed workload, shared by the other offline benchmarks."""
    return mixed_lengths(num, (64, 512), (32, 128), seed=seed)


def build_workload(tokenizer, num: int, seed: int):
    pairs = mixed_pairs(num, seed)
    prompts = token_prompts(tokenizer.encode, [p for p, _ in pairs])
    return prompts, [o for _, o in pairs]


# ---------------------------------------------------------------------------------------------
# kvshare
def run_kvshare(llm: LLM, prompts, outs, measure_util: bool = True):
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, sp)
    util = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if measure_util and engine.scheduler.waiting:
            # The batch is full (someone is queued): how much of the allocated KV holds tokens?
            held = sum(s.num_computed_tokens for s in engine.scheduler.running)
            slots = engine.manager.num_used_blocks() * engine.layout.block_size
            if slots:
                util.append(held / slots)
    elapsed = time.perf_counter() - t0
    return elapsed, (statistics.mean(util) if util else float("nan"))


def kvshare_decode_latency(llm: LLM, prompt, n: int = 128) -> float:
    """ms per output token for a single request, excluding the first token."""
    engine = llm.engine
    rid = engine.add_request(f"lat-{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                             SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - t0) / (n - 1) * 1000


def decode_breakdown(llm: LLM, prompts, steps: int = 20) -> dict:
    """Where a decode step's time goes, at the batch size of the workload (one row per request)."""
    from kvshare.model import qlinear

    engine = llm.engine
    timers = {"matmul (layers)": 0.0, "attention": 0.0, "lm_head": 0.0, "sampling": 0.0}
    inside_logits = [False]
    linear_classes = (qlinear.DenseLinear, qlinear.GroupInt8Linear)  # GroupInt4Linear inherits its __call__
    real_calls = {cls: cls.__call__ for cls in linear_classes}
    backend = engine.model.backend
    real_attn = backend.forward
    real_logits = engine.model.compute_logits
    real_sampler = engine.sampler

    def timed_call(cls):
        real = real_calls[cls]

        def call(self, x, *rows):
            t = time.perf_counter()
            r = real(self, x, *rows)
            if not inside_logits[0]:
                timers["matmul (layers)"] += time.perf_counter() - t
            return r
        return call

    def timed_attn(*a, **k):
        t = time.perf_counter()
        r = real_attn(*a, **k)
        timers["attention"] += time.perf_counter() - t
        return r

    def timed_logits(*a, **k):
        t = time.perf_counter()
        inside_logits[0] = True
        r = real_logits(*a, **k)
        inside_logits[0] = False
        timers["lm_head"] += time.perf_counter() - t
        return r

    def timed_sampler(*a, **k):
        t = time.perf_counter()
        r = real_sampler(*a, **k)
        timers["sampling"] += time.perf_counter() - t
        return r

    for i, p in enumerate(prompts):
        engine.add_request(f"bd-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True))
    # Prefill everything first, untimed.
    while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    backend.forward, engine.model.compute_logits, engine.sampler = timed_attn, timed_logits, timed_sampler
    for cls in linear_classes:
        cls.__call__ = timed_call(cls)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        backend.forward, engine.model.compute_logits, engine.sampler = real_attn, real_logits, real_sampler
        for cls, real in real_calls.items():
            cls.__call__ = real
    batch = len(engine.scheduler.running)
    engine.abort_request(list(engine.requests))
    while engine.has_unfinished_requests():
        engine.step()
    out = {k: v / steps * 1000 for k, v in timers.items()}
    out["other (python, norms, rope, scheduling)"] = total / steps * 1000 - sum(timers.values()) / steps * 1000
    out["step_total"] = total / steps * 1000
    out["batch"] = batch
    return out


# ---------------------------------------------------------------------------------------------
# HF transformers baseline
def load_hf(dtype: torch.dtype):
    import os

    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    model.eval()
    return model


def run_hf(model, prompts, outs, batch_size: int) -> float:
    """Static batches in arrival order, left-padded, each batch decoding to its longest output."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        bp, bo = prompts[i:i + batch_size], outs[i:i + batch_size]
        width = max(len(p) for p in bp)
        ids = torch.zeros(len(bp), width, dtype=torch.long)
        mask = torch.zeros(len(bp), width, dtype=torch.long)
        for r, p in enumerate(bp):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(bo), min_new_tokens=max(bo),
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def hf_decode_latency(model, prompt, n: int = 64) -> float:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (n - 1) * 1000


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="kvshare modes: float32 / bfloat16 = weights dequantized (quantization=None), "
                         "default = LLM()'s defaults (kept-quantized GGUF weights, dtype auto); a mode may "
                         "add LLM options after a colon, e.g. default:kv_cache_dtype=float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-sizes", default="1,8,16,32",
                    help="HF static batch sizes tried; the best one is the baseline")
    ap.add_argument("--hf-batch1-prompts", type=int, default=8,
                    help="batch 1 runs this many prompts (a rate is a rate; the full set takes minutes)")
    ap.add_argument("--repeats", type=int, default=1, help="kvshare repeats (median reported)")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    results = {"workload": {}, "runs": []}
    for dtype_name in args.dtypes.split(","):
        base, _, extra = dtype_name.partition(":")
        mode = {} if base == "default" else {"dtype": base, "quantization": None}
        for opt in filter(None, extra.split(":")):
            key, eq, value = opt.partition("=")
            if not eq:
                raise SystemExit(f"--dtypes {dtype_name!r}: {opt!r} is not key=value")
            try:
                mode[key] = ast.literal_eval(value)  # numbers, True / False, None
            except (ValueError, SyntaxError):
                mode[key] = value  # a plain string such as bfloat16
        llm = LLM(**{"kv_cache_memory": args.kv_cache_memory, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "max_num_seqs": args.max_num_seqs, **mode})  # a mode's own options win
        prompts, outs = build_workload(llm.get_tokenizer(), args.num_prompts, args.seed)
        n_prompt, n_out = sum(map(len, prompts)), sum(outs)
        results["workload"] = {"prompts": len(prompts), "prompt_tokens": n_prompt, "output_tokens": n_out}
        print(f"\n=== {dtype_name}: {len(prompts)} prompts, {n_prompt} prompt tokens, {n_out} output tokens ===",
              flush=True)
        # Warm-up: first calls pay for kernel selection and allocations.
        run_kvshare(llm, prompts[:4], [8] * 4, measure_util=False)
        times, utils = [], []
        for _ in range(args.repeats):
            llm.engine.manager.pool.reset_prefix_cache()  # each repeat computes everything
            t, u = run_kvshare(llm, prompts, outs)
            times.append(t)
            utils.append(u)
        t_kv = statistics.median(times)
        kv = {"engine": "kvshare", "dtype": dtype_name, "seconds": t_kv, "output_tok_s": n_out / t_kv,
              "total_tok_s": (n_prompt + n_out) / t_kv, "kv_slot_utilization": statistics.median(utils),
              "all_seconds": times}
        print(f"kvshare  {dtype_name}: {t_kv:7.1f} s  output {kv['output_tok_s']:7.1f} tok/s  total "
              f"{kv['total_tok_s']:7.1f} tok/s  KV slot utilization {kv['kv_slot_utilization']:.3f}", flush=True)
        kv["decode_ms_per_token"] = kvshare_decode_latency(llm, prompts[0])
        print(f"kvshare  {dtype_name}: single-request decode {kv['decode_ms_per_token']:.1f} ms/token", flush=True)
        bd = decode_breakdown(llm, prompts[: args.max_num_seqs])
        kv["decode_step_breakdown_ms"] = bd
        print("kvshare  decode step breakdown (ms/step, batch {}): ".format(bd["batch"]) +
              ", ".join(f"{k} {v:.1f}" for k, v in bd.items() if k != "batch"), flush=True)
        results["runs"].append(kv)
        dtype = llm.engine.model.dtype
        kv["resolved"] = f"{llm.config.dtype}, quantization={llm.config.quantization}"
        del llm

        if args.skip_hf:
            continue
        model = load_hf(dtype)
        best = None
        for bsz in [int(b) for b in args.hf_batch_sizes.split(",")]:
            sub_p, sub_o = (prompts[: args.hf_batch1_prompts], outs[: args.hf_batch1_prompts]) if bsz == 1 else (prompts, outs)
            # Untimed warm-up batch.
            run_hf(model, sub_p[:bsz][:2], [4] * min(2, bsz), bsz)
            t = run_hf(model, sub_p, sub_o, bsz)
            sp, so = sum(map(len, sub_p)), sum(sub_o)
            r = {"engine": "hf", "dtype": dtype_name, "batch_size": bsz, "prompts": len(sub_p), "seconds": t,
                 "output_tok_s": so / t, "total_tok_s": (sp + so) / t}
            print(f"HF batch {bsz:2d} {dtype_name}: {t:7.1f} s  output {r['output_tok_s']:7.1f} tok/s  total "
                  f"{r['total_tok_s']:7.1f} tok/s  ({len(sub_p)} prompts)", flush=True)
            results["runs"].append(r)
            if best is None or r["total_tok_s"] > best["total_tok_s"]:
                best = r
        hf_lat = hf_decode_latency(model, prompts[0])
        print(f"HF       {dtype_name}: single-request decode {hf_lat:.1f} ms/token", flush=True)
        ratio_total = kv["total_tok_s"] / best["total_tok_s"]
        ratio_out = kv["output_tok_s"] / best["output_tok_s"]
        print(f"RATIO {dtype_name}: kvshare / HF best (batch {best['batch_size']}): total {ratio_total:.2f}x, "
              f"output {ratio_out:.2f}x; decode latency {kv['decode_ms_per_token']:.1f} vs {hf_lat:.1f} ms/token",
              flush=True)
        results["runs"].append({"ratio": dtype_name, "total": ratio_total, "output": ratio_out,
                                "hf_best_batch": best["batch_size"], "hf_decode_ms_per_token": hf_lat})
        del model
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
