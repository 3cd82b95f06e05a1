"""Continuous batching must not change anyone's result: together == alone."""
from __future__ import annotations

import pytest

from helpers import EXACT, english_token_prompts, hf_reference
from kvshare import LLM, SamplingParams

# Around every block boundary the block sizes below meet (16, 32, 64, 128, 256) and up to the longest
# prompt that fits; mid-range lengths between those add run time, not cases.
LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 48, 64, 100, 127, 255, 257, 401, 599, 600]
MAX_TOKENS = 6
# The block-size and chunk-budget variants take the prompts up to 257 tokens: they cross every
# boundary of those sizes many times over, and the three longest prompts are 60% of the prefill.
SHORT = sum(n <= 257 for n in LENGTHS)


def _prompts():
    _, tok = hf_reference()
    return [{"prompt_token_ids": p} for p in english_token_prompts(lambda s: tok(s).input_ids, LENGTHS)]


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _tokens_and_lps(outs):
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return res


@pytest.fixture(scope="module")
def alone():
    """Each prompt run by itself, in a fresh engine state (prefix caching off: nothing shared)."""
    llm = LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=1024)
    return [_tokens_and_lps(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in _prompts()]


def _assert_same(alone, together):
    assert len(alone) == len(together)
    for (ta, la), (tb, lb) in zip(alone, together):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-4


@pytest.mark.parametrize(
    "options, num_prompts",
    [
        (dict(), len(LENGTHS)),
        (dict(block_size=1), SHORT),
        # Chunks of 48 over blocks of 32: every other chunk ends mid-block.
        (dict(block_size=32, max_num_batched_tokens=48), SHORT),
        (dict(max_num_batched_tokens=32), SHORT),
    ],
    ids=["default", "block1", "block32_budget48", "budget32"],
)
def test_together_equals_alone(alone, options, num_prompts):
    opts = dict(kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=1024)
    opts.update(options)
    llm = LLM(**EXACT, **opts)
    outs = llm.generate(_prompts()[:num_prompts], PARAMS, use_tqdm=False)
    _assert_same(alone[:num_prompts], _tokens_and_lps(outs))
    assert llm.engine.manager.num_used_blocks() == 0


def test_together_equals_alone_under_preemption(alone):
    # 46080 bytes per token in float32: 50 blocks of 16 = 800 slots, room for one 600-token
    # prompt and a few short ones, so the scheduler must preempt and recompute.
    llm = LLM(**EXACT, kv_cache_memory=46080 * 16 * 50, enable_prefix_caching=False, max_num_batched_tokens=256)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _assert_same(alone, _tokens_and_lps(outs))
    assert llm.engine.manager.num_used_blocks() == 0


def test_seeded_sampling_is_batch_independent():
    llm = LLM(**EXACT, kv_cache_memory="64MiB")
    prompts = _prompts()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone_out = llm.generate([prompts[10]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True) for _ in prompts[:8]]
    busy = llm.generate(prompts[:8] + [prompts[10]] + prompts[12:14], others + [seeded] + others[:2], use_tqdm=False)
    assert busy[8].outputs[0].token_ids == alone_out
    # A different seed gives a different continuation (the test can tell seeds apart).
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompts[10]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone_out
