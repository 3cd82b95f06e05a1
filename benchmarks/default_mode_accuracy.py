"""Which numerics can be the default mode: greedy decoding of the bundled model against the exact
path (float32, dequantized) for several activation / GEMM precisions, in one run.

For each variant: how many of 16 prompts (5-480 tokens) decode the same 32 greedy tokens as the
exact path, batched and one at a time, and the worst chosen-token logprob gap up to the first
differing token (tests/test_default_mode.py's measure). The W8A8 variant replaces the prefill
GEMM by int8 rows (per-row absmax) x int8 weights (per output channel) through torch._int_mm; it
exists only here, to show why it is not an option.

    python benchmarks/default_mode_accuracy.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers import EXACT, english_token_prompts, greedy_agreement  # noqa: E402

from kvshare import LLM, SamplingParams  # noqa: E402
from kvshare.model import kernels, qlinear  # noqa: E402

LENGTHS = [5, 12, 20, 33, 47, 64, 80, 100, 128, 160, 200, 260, 300, 350, 400, 480]
VARIANTS = {
    "bfloat16 activations": dict(dtype="bfloat16"),
    "bfloat16 activations, dequantized": dict(dtype="bfloat16", quantization=None),
    "float32 activations, float32 prefill GEMMs": dict(dtype="float32", prefill_dtype="float32"),
    "float32, bfloat16 KV cache, float32 GEMMs": dict(dtype="float32", prefill_dtype="float32",
                                                      kv_cache_dtype="bfloat16"),
    "float32, bfloat16 prefill GEMMs, float32 KV cache": dict(dtype="float32", prefill_dtype="bfloat16",
                                                              kv_cache_dtype="float32"),
    "default (float32, prefill_dtype and kv_cache_dtype auto)": dict(),
    "float32, W8A8 prefill GEMMs": dict(dtype="float32", w8a8=True),
}


def w8a8_matmul(scratch, x: torch.Tensor, lin, out: torch.Tensor | None = None) -> torch.Tensor:
    y = _w8a8(scratch, x, lin)
    return y if out is None else out.copy_(y)


def _w8a8(scratch, x: torch.Tensor, lin) -> torch.Tensor:
    n, k = lin.out_features, lin.in_features
    w = lin.dense(scratch.get(n, k, torch.float32))
    sw = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    w8 = torch.round(w / sw).to(torch.int8)
    sx = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(x / sx).to(torch.int8)
    if x.shape[0] <= 16:  # _int_mm wants more than 16 rows
        return (xq.float() @ w8.float().T) * sx * sw.T
    return torch._int_mm(xq, w8.t()).float() * sx * sw.T


def exact_reference():
    """The 16 prompts, the sampling parameters, and the exact path's outputs for them."""
    kernels.build_all()
    exact = LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(exact.get_tokenizer().encode, LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    return prompts, params, exact.generate(prompts, params, use_tqdm=False)


def main() -> int:
    prompts, params, ref = exact_reference()
    real_matmul = qlinear.DequantScratch.matmul
    print(f"{'variant':<45} {'batched':>8} {'alone':>6} {'worst logprob gap':>18}")
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        qlinear.DequantScratch.matmul = w8a8_matmul if kw.pop("w8a8", False) else real_matmul
        try:
            llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, **kw)
            together, worst_t = greedy_agreement(llm.generate(prompts, params, use_tqdm=False), ref)
            alone, worst_a = greedy_agreement([llm.generate([p], params, use_tqdm=False)[0] for p in prompts], ref)
        finally:
            qlinear.DequantScratch.matmul = real_matmul
        print(f"{name:<45} {together:>5}/16 {alone:>3}/16 {max(worst_t, worst_a):>18.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
