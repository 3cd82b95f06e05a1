"""Where the serving benchmark's mixed workload spends its time in the default mode, in process:
24 requests of its sizes (prompts 64-512 tokens, outputs 32-128) through one engine with
max_num_seqs=16 (what 16 concurrent clients keep in flight), no prefix caching. Splits the wall
time into steps that compute prompt tokens and decode-only steps, and times the main kernels
(wrapped, so each count is wall time inside that call): the prompt rows' dense GEMMs
(F.linear), prompt attention (SDPA, kvshare's causal kernel), the packed matmuls outside the
fused decode step (decode rows of mixed steps, the vocab projection), and the vocab projection
alone (compute_logits).

    python benchmarks/mixed_step_split.py [--runs 2]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import mixed_lengths, token_prompts
from kvshare.model import attention, kernels, qlinear
from kvshare.model.kernels import paged_attention, qmatmul


def timed(owner, name: str, key: str, acc: dict) -> None:
    real = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    kernels.build_all()
    acc: dict[str, float] = collections.defaultdict(float)
    llm = LLM(max_num_seqs=16, enable_prefix_caching=False)
    eng = llm.engine
    timed(qlinear.F, "linear", "prompt-row GEMMs (F.linear)", acc)
    timed(attention.F, "scaled_dot_product_attention", "SDPA", acc)
    timed(paged_attention, "causal_prefill_attention", "causal prefill attention (kvshare C++)", acc)
    timed(qmatmul, "int4_group_matmul", "packed int4 matmul, rows (outside fused decode)", acc)
    timed(qmatmul, "int8_group_matmul", "packed int8 matmul, rows (outside fused decode)", acc)
    timed(qmatmul.VnniBlocks, "matmul", "packed matmul, VNNI blocks (outside fused decode; "
                                            "includes the vocab projection)", acc)
    timed(eng.model, "compute_logits", "vocab projection (compute_logits)", acc)
    steps: list[tuple[float, int]] = []
    execute = eng.runner.execute

    def run_step(plan):
        t0 = time.perf_counter()
        out = execute(plan)
        seqs = eng.scheduler.scheduled_seqs
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.start < seqs[c.seq_id].num_prompt_tokens)
        steps.append((time.perf_counter() - t0, prompt_tokens))
        return out
    eng.runner.execute = run_step
    pairs = mixed_lengths(24, (64, 512), (32, 128), seed=1)
    prompts = token_prompts(eng.tokenizer.encode, [p for p, _ in pairs])
    total_tokens = sum(p + o for p, o in pairs)
    for run in range(args.runs):
        acc.clear()
        steps.clear()
        for i, (p, (_, o)) in enumerate(zip(prompts, pairs)):
            eng.add_request(f"mixed-{run}-{i}", {"prompt_token_ids": p},
                            SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        wall = time.perf_counter() - t0
        prompt_steps = [(t, n) for t, n in steps if n]
        decode_steps = [t for t, n in steps if not n]
        print(f"run {run + 1}: {wall:.2f} s, {total_tokens / wall:.0f} tok/s; "
              f"{len(prompt_steps)} steps with prompt tokens: {sum(t for t, _ in prompt_steps):.2f} s "
              f"({sum(n for _, n in prompt_steps)} prompt tokens); "
              f"{len(decode_steps)} decode-only steps: {sum(decode_steps):.2f} s "
              f"({1e3 * sum(decode_steps) / max(1, len(decode_steps)):.1f} ms each)")
        for key, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"    {key:<44} {v:6.2f} s  {100 * v / wall:4.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
