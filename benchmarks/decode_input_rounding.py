"""How much rounding the decode rows' inputs to the packed matmuls can take: greedy decoding of
the bundled model against the exact path (float32, dequantized), as in
benchmarks/default_mode_accuracy.py, with x rounded before every packed (decode-row and vocab
projection) matmul of the default mode. A simulation: the rounded x goes through the float32
kernel (weights kept in rows, not VNNI blocks, whose kernel rounds x to int16 itself), and the
fused C++ decode step is turned off so that every matmul passes through Python.

Roundings: none (the default mode as it is); bfloat16; int16 per row and group of 32 columns
(step max|x| / 32767: what an int16 VNNI kernel multiplies; every weight of the bundled model
has groups of 32); int8 per row and group of 32 (step max|x| / 127, llama.cpp's Q8
activations).

    python benchmarks/decode_input_rounding.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from default_mode_accuracy import exact_reference  # noqa: E402
from helpers import greedy_agreement  # noqa: E402

from kvshare import LLM  # noqa: E402
from kvshare.model import fused_decode, qlinear  # noqa: E402
from kvshare.model.kernels import qmatmul  # noqa: E402

GROUP = 32


def per_group(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x rounded to integer steps of max|x| / levels per row and group of GROUP columns."""
    m, k = x.shape
    xg = x.float().reshape(m, k // GROUP, GROUP)
    step = xg.abs().amax(-1, keepdim=True).clamp_min(1e-30) / levels
    return (torch.round(xg / step) * step).reshape(m, k).to(x.dtype)


ROUNDINGS = {
    "none (the default mode)": None,
    "bfloat16": lambda x: x.to(torch.bfloat16).to(x.dtype),
    "int16 per group of 32": lambda x: per_group(x, 32767),
    "int8 per group of 32": lambda x: per_group(x, 127),
}


def main() -> int:
    prompts, params, ref = exact_reference()
    kernels = {cls: cls._kernel for cls in (qlinear.GroupInt8Linear, qlinear.GroupInt4Linear)}
    reason, blocks_fit = fused_decode.FusedDecode.reason, qmatmul.vnni_blocks_fit
    print(f"{'decode-row x rounded to':<28} {'batched':>8} {'alone':>6} {'worst logprob gap':>18}")
    try:
        fused_decode.FusedDecode.reason = lambda self, *a: "off: x is rounded in Python"
        qmatmul.vnni_blocks_fit = lambda *a: False
        for name, rnd in ROUNDINGS.items():
            for cls, real in kernels.items():
                cls._kernel = real if rnd is None else (lambda self, x, out=None, real=real, rnd=rnd:
                                                        real(self, rnd(x), out))
            llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False)
            together, worst_t = greedy_agreement(llm.generate(prompts, params, use_tqdm=False), ref)
            alone, worst_a = greedy_agreement([llm.generate([p], params, use_tqdm=False)[0] for p in prompts], ref)
            print(f"{name:<28} {together:>5}/16 {alone:>3}/16 {max(worst_t, worst_a):>18.4f}", flush=True)
            del llm
    finally:
        fused_decode.FusedDecode.reason, qmatmul.vnni_blocks_fit = reason, blocks_fit
        for cls, real in kernels.items():
            cls._kernel = real
    return 0


if __name__ == "__main__":
    sys.exit(main())
