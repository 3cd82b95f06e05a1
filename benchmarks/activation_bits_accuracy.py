"""What rounding the linear layers' inputs to 16 or 8 bits per group costs in accuracy, on the
bundled model (issue 29, item 6: why prompt steps keep int16 activations).

The default mode's VNNI kernels round each row's x to int16 per weight group (step max|x| / 32767)
and multiply with vpdpwssd: 32 products per instruction. Rounding x to int8 per group (step
max|x| / 127, as llama.cpp's Q8_0 / Q8_K activations) would let vpdpbusd do 64 per instruction,
twice the prompt-step peak. This measures the accuracy side on the exact path (float32, dense
weights): every F.linear input rounded per group of --group values ("fake quantization": the same
values the integer kernels would see), 16 prompts x 32 greedy tokens against the unrounded exact
path: how many prompts decode the same tokens, and the worst chosen-token logprob gap up to the
first differing token (tests/helpers.py greedy_agreement, as tests/test_default_mode.py reads it).

    python benchmarks/activation_bits_accuracy.py [--group 32] [--bits 16,8]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

LENGTHS = [5, 20, 47, 80, 128, 200, 300, 400, 10, 33, 64, 100, 150, 250, 350, 450]


def rounding_linear(levels: int, group: int):
    """F.linear with x rounded to `levels` steps of its group's max|x| (round half to even)."""
    dense = F.linear

    def linear(x, w, b=None):
        if x.shape[-1] % group == 0:
            xg = x.reshape(-1, x.shape[-1] // group, group)
            step = xg.abs().amax(-1, keepdim=True) / levels
            step = torch.where(step == 0, torch.ones_like(step), step)
            x = (torch.round(xg / step) * step).reshape(x.shape)
        return dense(x, w, b)

    return linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--bits", default="16,8")
    args = ap.parse_args()

    from helpers import EXACT, english_token_prompts, greedy_agreement

    from kvshare import LLM, SamplingParams

    llm = LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    ref = llm.generate(prompts, params, use_tqdm=False)
    dense = F.linear
    print(f"x rounded per group of {args.group}, 16 prompts x 32 greedy tokens vs the exact path")
    print("| x | prompts identical (of 16) | first 8 (the test's) | worst logprob gap |")
    print("|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        F.linear = rounding_linear(2 ** (bits - 1) - 1, args.group)
        try:
            got = llm.generate(prompts, params, use_tqdm=False)
        finally:
            F.linear = dense
        same, worst = greedy_agreement(got, ref)
        same8, _ = greedy_agreement(got[:8], ref[:8])
        print(f"| int{bits} | {same} | {same8} | {worst:.4f} |", flush=True)


if __name__ == "__main__":
    main()
