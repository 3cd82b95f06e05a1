"""Logit parity with HF transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from helpers import EXACT, ENGLISH_TEXT, bundled_path, hf_reference, tiny_model
from kvshare import LLM, SamplingParams

STEPS = 32


def hf_greedy(model, prompt_ids: list[int], steps: int):
    """HF greedy decode by hand (generate() would suppress EOS under min_new_tokens, which
    ignore_eos does not): tokens, each chosen token's raw logprob, and prompt logprobs."""
    tokens, step_lp = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        full = out.logits[0].float().log_softmax(-1)
        prompt_lp = [full[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
        lp, past = full[-1], out.past_key_values
        for _ in range(steps):
            t = int(lp.argmax())
            tokens.append(t)
            step_lp.append(lp[t].item())
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            lp, past = out.logits[0, -1].float().log_softmax(-1), out.past_key_values
    return tokens, step_lp, prompt_lp


def compare(llm: LLM, model, prompts: list[list[int]], steps: int = STEPS) -> None:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lp, ref_prompt_lp = hf_greedy(model, p, steps)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < 1e-3
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        ours_prompt = [out.prompt_logprobs[i + 1][p[i + 1]].logprob for i in range(len(p) - 1)]
        if ours_prompt:
            assert max(abs(a - b) for a, b in zip(ours_prompt, ref_prompt_lp)) < 1e-3


def test_bundled_model_matches_hf():
    model, tok = hf_reference()
    llm = LLM(**EXACT, kv_cache_memory="128MiB", max_num_batched_tokens=512)
    text_ids = tok(ENGLISH_TEXT).input_ids
    prompts = [text_ids[:7], text_ids[40:140], tok("The capital of France is").input_ids]
    compare(llm, model, prompts)


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", dict(num_key_value_heads=2)),  # GQA
        ("llama", dict(num_key_value_heads=1)),  # MQA
        ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),  # MHA, tied
        ("qwen2", dict(num_key_value_heads=2)),  # q/k/v bias
        ("llama", dict(num_key_value_heads=2, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    ],
)
def test_tiny_models_match_hf(kind, overrides, tmp_path):
    model = tiny_model(kind, tmp_path, **overrides)
    llm = LLM(**EXACT, model=str(tmp_path), kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (1, 17, 90)]
    compare(llm, model, prompts)


def test_bfloat16_tracks_float32():
    """bfloat16 weights, activations and KV: prompt logprobs stay close to float32's."""
    from kvshare.bench.workloads import ENGLISH_TEXT

    _, tok = hf_reference()
    p = tok(ENGLISH_TEXT).input_ids[:200]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    f32 = LLM(**EXACT, kv_cache_memory="32MiB").generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    b16 = LLM(kv_cache_memory="32MiB", dtype="bfloat16", quantization=None).generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    diffs = [abs(a[t].logprob - b[t].logprob)
             for a, b, t in zip(f32.prompt_logprobs[1:], b16.prompt_logprobs[1:], p[1:])]
    assert sum(diffs) / len(diffs) < 0.1
    agree = sum(x == y for x, y in zip(f32.outputs[0].token_ids, b16.outputs[0].token_ids))
    assert agree >= 8


def test_mistral_sliding_window_matches_hf(tmp_path):
    """Contexts well past the window: prompt logprobs (chunked prefill over the window) and
    greedy decoding (HF with its sliding-window cache) agree; max_model_len is the model's own."""
    model = tiny_model("mistral", tmp_path, num_key_value_heads=2, sliding_window=32)
    llm = LLM(**EXACT, model=str(tmp_path), kv_cache_memory="16MiB", max_num_batched_tokens=64)
    assert llm.engine.layout.max_model_len == 256
    g = torch.Generator().manual_seed(2)
    compare(llm, model, [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 90)])
