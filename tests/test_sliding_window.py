"""Sliding-window attention (issue 6, item 2): logits match HF transformers past the window, with
prefix caching and chunks smaller and larger than the window; blocks no window reaches go back to
the pool, so a decoding sequence never holds more than ceil(window / block) + 1 blocks; all
under audit, and the recorded event log replays clean."""
from __future__ import annotations

import pytest
import torch

from helpers import EXACT, tiny_model
from kvshare import SamplingParams
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.kvcache.replay import replay
from kvshare.model.hf_loader import config_from_hf

WINDOW, BLOCK = 32, 16
STEPS = 200


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mistral_swa")
    model = tiny_model("mistral", path, num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=512)
    return model, str(path)


def hf_logprobs(model, tokens: list[int], window: int | None = WINDOW) -> torch.Tensor:
    """One HF forward over the whole sequence: [len, vocab] logprobs (window=None: full attention)."""
    saved = model.config.sliding_window
    model.config.sliding_window = window
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    finally:
        model.config.sliding_window = saved


def run(engine: LLMEngine, requests: dict, bound: int | None = None) -> tuple[dict, int]:
    """Step until done; after every step, no decoding sequence may hold more than `bound` blocks.
    Returns the final outputs and the most blocks any decoding sequence held."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finals, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens > seq.num_prompt_tokens:  # it has decoded at least once
                held = sum(1 for b in engine.manager.tables[seq.seq_id] if b is not None)
                most = max(most, held)
                assert bound is None or held <= bound, f"{seq.seq_id} holds {held} blocks at {seq.num_tokens} tokens"
    return finals, most


def assert_matches(out, prompt: list[int], ref: torch.Tensor, prompt_logprobs: bool) -> None:
    got = out.outputs[0]
    first = len(prompt) - 1
    for i, t in enumerate(got.token_ids):
        assert int(ref[first + i].argmax()) == t, f"greedy token {i} differs from HF"
    diffs = [abs(got.logprobs[i][t].logprob - ref[first + i, t].item()) for i, t in enumerate(got.token_ids)]
    assert max(diffs) < 1e-3
    if prompt_logprobs:
        diffs = [abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item())
                 for i in range(1, len(prompt))]
        assert max(diffs) < 1e-3


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_window_matches_hf_with_prefix_cache_and_bounded_blocks(mistral, chunk, tmp_path):
    model, path = mistral
    log = str(tmp_path / "events.jsonl")
    engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, model=path, kv_cache_memory="1MiB", block_size=BLOCK,
                                                max_num_batched_tokens=chunk, enable_prefix_caching=True,
                                                audit=True, kv_event_log=log))
    assert engine.layout.max_model_len == 512  # no longer capped at the window
    g = torch.Generator().manual_seed(chunk)
    prompt = torch.randint(0, 320, (45,), generator=g).tolist()
    bound = -(-WINDOW // BLOCK) + 1
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    finals, most = run(engine, {"a": (prompt, params)}, bound)
    a = finals["a"]
    full = prompt + a.outputs[0].token_ids
    ref = hf_logprobs(model, full)
    # The reference really is windowed: full attention over the same tokens disagrees.
    assert (hf_logprobs(model, full, window=None)[WINDOW + 8:] - ref[WINDOW + 8:]).abs().max() > 0.1
    assert_matches(a, prompt, ref, prompt_logprobs=True)
    assert most == bound

    # A second request sharing 100 tokens of the first: its hits outside the window are not
    # even revived, and what it computes after them still matches HF.
    prompt_b = full[:100] + torch.randint(0, 320, (5,), generator=g).tolist()
    finals, _ = run(engine, {"b": (prompt_b, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                             logprobs=0))}, bound)
    b = finals["b"]
    assert b.num_cached_tokens == 96
    out_b = prompt_b + b.outputs[0].token_ids
    assert_matches(b, prompt_b, hf_logprobs(model, out_b), prompt_logprobs=False)
    engine.manager.assert_idle_whole()
    engine.events.flush()
    assert replay(log).clean  # the offline replay follows windowed reads and releases too


def test_mixed_local_and_global_layers_match_hf(tmp_path):
    """Qwen2 with layer_types: layer 0 global, layer 1 windowed. Each layer takes its own mask;
    nothing can be released while a global layer still reads every key."""
    model = tiny_model("qwen2", tmp_path, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=1, max_position_embeddings=512)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, model=str(tmp_path), kv_cache_memory="1MiB", block_size=BLOCK,
                                                max_num_batched_tokens=16, audit=True))
    assert engine.model_config.layer_windows == [None, WINDOW]
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 320, (40,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    finals, most = run(engine, {"a": (prompt, params)})
    full = prompt + finals["a"].outputs[0].token_ids
    assert most >= 6  # blocks kept growing: a release would have held it at 3
    with torch.no_grad():
        ref = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
        model.config.layer_types = ["full_attention"] * 2
        unwindowed = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
    assert (unwindowed - ref).abs().max() > 0.1
    assert_matches(finals["a"], prompt, ref, prompt_logprobs=True)


def test_window_configs_read_as_transformers_reads_them():
    base = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                intermediate_size=128, vocab_size=320)

    def read(**kw):
        c = config_from_hf({**base, **kw}, "x")
        return c.sliding_window, c.layer_windows, c.attention_windows()

    assert read(use_sliding_window=False, sliding_window=16) == (None, None, [None] * 4)
    assert read(use_sliding_window=True, sliding_window=16, max_window_layers=0) == (16, None, [16] * 4)
    assert read(use_sliding_window=True, sliding_window=16, max_window_layers=2) == (
        16, [None, None, 16, 16], [None, None, 16, 16])
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert read(use_sliding_window=True, sliding_window=8, layer_types=types)[2] == [8, None, 8, None]
    mistral = config_from_hf({**base, "model_type": "mistral", "sliding_window": 24}, "x")
    assert mistral.attention_windows() == [24] * 4
