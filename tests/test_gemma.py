"""Gemma 2 and Gemma 3 (issue 13): tiny random-weight models match HF transformers (eager
attention, float32) in prompt logprobs and greedy decoding past the sliding window, with chunked
prefill and prefix caching; config.json files of either rope layout and GGUF files written as
llama.cpp's converter writes them read back to the same model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import EXACT, tiny_model
from kvshare import SamplingParams
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.model.hf_loader import config_from_hf
from kvshare.model.loader import load_model

WINDOW, BLOCK, CHUNK = 12, 8, 7
STEPS = 32
VOCAB = 320


def gemma_overrides(kind: str) -> dict:
    """Features turned up so that getting one wrong shows: caps small enough that tanh bends
    the scores and logits, linear RoPE scaling on Gemma 3's global layer, windows much shorter
    than the sequences."""
    over = dict(num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=256)
    if kind == "gemma2":
        over.update(attn_logit_softcapping=2.0, final_logit_softcapping=8.0)
    else:  # layers 0, 1 local, 2 global
        over.update(num_hidden_layers=3, sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    return over


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def generate(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def assert_matches(out, prompt: list[int], ref: torch.Tensor, prompt_logprobs: bool = True) -> None:
    got = out.outputs[0]
    first = len(prompt) - 1
    assert got.token_ids == [int(ref[first + i].argmax()) for i in range(len(got.token_ids))]
    diffs = [abs(got.logprobs[i][t].logprob - ref[first + i, t].item()) for i, t in enumerate(got.token_ids)]
    assert max(diffs) < 1e-3
    if prompt_logprobs:
        diffs = [abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
                 for i in range(1, len(prompt))]
        assert max(diffs) < 1e-3


def engine_for(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(**EXACT, model=path, kv_cache_memory="1MiB", block_size=BLOCK,
                                              max_num_batched_tokens=CHUNK, enable_prefix_caching=True, **kw))


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_matches_hf_past_the_window_with_chunks_and_prefix_cache(kind, tmp_path):
    model = tiny_model(kind, tmp_path, **gemma_overrides(kind))
    engine = engine_for(str(tmp_path))
    mc = engine.model_config
    assert mc.architecture == kind
    assert mc.attention_windows() == ([WINDOW, None] if kind == "gemma2" else [WINDOW, WINDOW, None])
    # Exact mode (dense weights): every step goes layer by layer; Gemma 2's soft-capping keeps it
    # there in any mode (the fused step on Gemma 3: tests/test_fused_decode.py).
    assert ("soft-capping" if kind == "gemma2" else "int8/int4-group") in engine.model.fused_decode.model_reason
    if kind == "gemma2":  # the C++ attention kernel cannot soft-cap
        assert not engine.model.backend.use_cpp_kernel

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (21,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    a = generate(engine, {"a": (prompt, params)})["a"]
    full = prompt + a.outputs[0].token_ids
    ref = hf_logprobs(model, full)
    assert_matches(a, prompt, ref)

    # The reference really exercises what this family adds: with an unbounded window, or
    # without either cap, HF itself gives other numbers.
    model.config.sliding_window = 10**6
    assert (hf_logprobs(model, full)[WINDOW + 4:] - ref[WINDOW + 4:]).abs().max() > 0.05
    model.config.sliding_window = WINDOW
    if kind == "gemma2":
        for layer in model.model.layers:  # read from the modules, not the config, at forward time
            layer.self_attn.attn_logit_softcapping = None
        assert (hf_logprobs(model, full) - ref).abs().max() > 0.05
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 2.0
        model.config.final_logit_softcapping = None
        assert (hf_logprobs(model, full) - ref).abs().max() > 0.05
        model.config.final_logit_softcapping = 8.0
        assert (hf_logprobs(model, full) - ref).abs().max() == 0  # restored

    # A second request reuses cached blocks of the first and still matches HF.
    prompt_b = full[:40] + torch.randint(0, VOCAB, (3,), generator=g).tolist()
    b = generate(engine, {"b": (prompt_b, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           logprobs=0))})["b"]
    assert b.num_cached_tokens == 40
    assert_matches(b, prompt_b, hf_logprobs(model, prompt_b + b.outputs[0].token_ids), prompt_logprobs=False)
    engine.manager.assert_idle_whole()


def test_config_json_read_as_transformers_reads_it():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=12, intermediate_size=128, vocab_size=320)
    # A transformers < 5 Gemma 3 config.json (as on the Hub): rope_theta, rope_local_base_freq,
    # rope_scaling for the global layers, sliding_window_pattern instead of layer_types.
    old = config_from_hf(dict(base, model_type="gemma3_text", head_dim=32, rope_theta=1e6, rope_local_base_freq=1e4,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
                              sliding_window_pattern=6, query_pre_attn_scalar=128), "d")
    assert old.architecture == "gemma3" and old.head_dim == 32
    assert old.layer_windows == ([512] * 5 + [None]) * 2
    assert (old.rope_theta, old.local_rope_theta, old.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert old.attn_scale == 128 ** -0.5
    assert old.tie_word_embeddings and old.final_logit_softcap is None and old.attn_logit_softcap is None
    assert (old.bos_token_id, old.eos_token_ids) == (2, [1])
    # transformers >= 5 writes one rope_parameters dict per layer type.
    new = config_from_hf(dict(base, model_type="gemma3_text", layer_types=["sliding_attention"] * 11 + ["full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}), "d")
    assert new.layer_windows == [4096] * 11 + [None] and new.head_dim == 256  # Gemma3TextConfig's defaults
    assert (new.rope_theta, new.local_rope_theta, new.rope_scaling) == (5e5, 2e4, None)
    # Gemma 2's defaults cap at 50 / 30; an explicit null turns a cap off.
    g2 = config_from_hf(dict(base, model_type="gemma2", final_logit_softcapping=None), "d")
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, None)
    assert g2.layer_windows == [4096, None] * 6 and g2.local_rope_theta is None
    from kvshare.model.load_error import ModelLoadError
    with pytest.raises(ModelLoadError, match="hidden_activation"):
        config_from_hf(dict(base, model_type="gemma2", hidden_activation="relu"), "d")


def write_gguf_like_llama_cpp(path, hf_model, kind: str, matrices=None) -> None:
    """What convert_hf_to_gguf's Gemma2Model / Gemma3Model write: gguf's own HF -> GGUF name map,
    every norm weight stored + 1, no lm_head (tied), no query_pre_attn_scalar or local RoPE base.
    matrices: a gguf.GGMLQuantizationType for the 2-D tensors (None: float32)."""
    import gguf

    cfg = hf_model.config
    arch = gguf.MODEL_ARCH.GEMMA2 if kind == "gemma2" else gguf.MODEL_ARCH.GEMMA3
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue
        arr = t.float().numpy().copy()
        if name.endswith("norm.weight"):
            arr = arr + 1.0
        gname = names.get_name(name, try_suffixes=(".weight",))
        if arr.ndim == 2 and matrices is not None:
            w.add_tensor(gname, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(gname, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_round_trip_agrees_with_the_hf_directory(kind, tmp_path):
    over = gemma_overrides(kind)
    # GGUF keeps no query_pre_attn_scalar: llama.cpp uses head_dim (all but the 27B models), so
    # the model here does too; Gemma 3 GGUFs have no layer pattern: llama.cpp's default 5:1.
    over["query_pre_attn_scalar"] = 16
    if kind == "gemma3":
        over.update(num_hidden_layers=6, sliding_window_pattern=6)
    hf_dir = tmp_path / "hf"
    model = tiny_model(kind, hf_dir, **over)
    gguf_path = tmp_path / f"{kind}.gguf"
    write_gguf_like_llama_cpp(gguf_path, model, kind)

    from_hf, from_gguf = load_model(str(hf_dir)), load_model(str(gguf_path))
    same_fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                   "sliding_window", "layer_windows", "attn_scale", "attn_logit_softcap", "final_logit_softcap",
                   "local_rope_theta")
    for f in same_fields:
        want = getattr(from_hf.config, f)
        # GGUF stores float32 (rms_norm_eps 1e-6 comes back as 9.99999997e-07)
        assert getattr(from_gguf.config, f) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), f
    assert sorted(from_gguf.weights) == sorted(from_hf.weights)
    for name, t in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], t, rtol=0, atol=1e-6, msg=name)

    engine = engine_for(str(gguf_path))
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = generate(engine, {"a": (prompt, params)})["a"]
    assert_matches(out, prompt, hf_logprobs(model, prompt + out.outputs[0].token_ids))
