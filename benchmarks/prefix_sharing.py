"""Prefix sharing: caching on vs off on a shared-preamble workload, and n=8 forks vs 8 requests.

32 requests, each a ~400-token preamble (the same for all) plus a unique ~30-token tail,
64 output tokens, ignore_eos, all arriving at once, bundled model. Caching on and off run in
the same process; the ratios are the result.

    python benchmarks/prefix_sharing.py
    python benchmarks/prefix_sharing.py --dtype bfloat16 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT


def shared_prefix_workload(tokenizer, num: int, preamble_len: int, tail_len: int):
    ids = tokenizer.encode(ENGLISH_TEXT)
    preamble = ids[:preamble_len]
    tails = [ids[preamble_len + 7 * i: preamble_len + 7 * i + tail_len] for i in range(num)]
    return [preamble + t for t in tails]


def run(llm: LLM, prompts, max_tokens: int):
    eng = llm.engine
    eng.manager.pool.reset_prefix_cache()
    before = eng.stats.prompt_tokens_computed
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    total = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "total_tok_s": total / elapsed,
        "prefill_tokens": eng.stats.prompt_tokens_computed - before,
        "mean_ttft": statistics.mean(o.metrics.time_to_first_token for o in outs),
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def peak_blocks(llm: LLM, prompts, params) -> int:
    eng = llm.engine
    eng.manager.pool.reset_prefix_cache()
    eng.stats.peak_blocks_in_use = 0
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return eng.stats.peak_blocks_in_use


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--preamble", type=int, default=400)
    ap.add_argument("--tail", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)

    opts = dict(dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=64)
    on = LLM(enable_prefix_caching=True, **opts)
    off = LLM(enable_prefix_caching=False, **opts)
    prompts = shared_prefix_workload(on.get_tokenizer(), args.num_requests, args.preamble, args.tail)
    run(on, prompts[:2], 4)  # warm-up
    run(off, prompts[:2], 4)
    res = {"on": [], "off": []}
    for _ in range(args.repeats):
        res["off"].append(run(off, prompts, args.max_tokens))
        res["on"].append(run(on, prompts, args.max_tokens))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "total_tok_s", "prefill_tokens", "mean_ttft",
                                                               "cached_tokens")} for k, v in res.items()}
    same = all(a["tokens"] == b["tokens"] for a, b in zip(res["on"], res["off"]))
    print(f"workload: {len(prompts)} requests x ({args.preamble} shared + {args.tail} own) prompt tokens, "
          f"{args.max_tokens} output tokens, {args.dtype}, {args.repeats} repeat(s), medians")
    for k in ("off", "on"):
        m = med[k]
        print(f"caching {k:3s}: {m['seconds']:6.2f} s  total {m['total_tok_s']:7.1f} tok/s  prefill tokens computed "
              f"{int(m['prefill_tokens']):6d}  mean TTFT {m['mean_ttft']:.3f} s  cached tokens {int(m['cached_tokens'])}")
    print(f"prefill tokens computed drop: {1 - med['on']['prefill_tokens'] / med['off']['prefill_tokens']:.1%}")
    print(f"total throughput ratio on/off: {med['on']['total_tok_s'] / med['off']['total_tok_s']:.2f}x")
    print(f"mean TTFT ratio off/on: {med['off']['mean_ttft'] / med['on']['mean_ttft']:.2f}x")
    print(f"greedy outputs identical with caching on and off: {same}")

    long_prompt = (on.get_tokenizer().encode(ENGLISH_TEXT) * 2)[:1000]
    params8 = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
    forked = peak_blocks(off, [long_prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True,
                                                            n=8))
    separate = peak_blocks(off, [long_prompt] * 8, params8)
    print(f"n=8 from a {len(long_prompt)}-token prompt (prefix caching off): peak blocks {forked} as one n=8 request "
          f"vs {separate} as 8 separate requests ({separate / forked:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
