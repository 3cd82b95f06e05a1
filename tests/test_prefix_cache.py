"""Prefix caching, copy-on-write, forks, beam search, multi-turn reuse and tenant salts."""
from __future__ import annotations

import pytest
import torch

from helpers import EXACT, hf_reference
from kvshare import LLM, BeamSearchParams, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
BYTES_PER_TOKEN = 46080  # SmolLM2-135M in float32: 2 x 30 x 3 x 64 x 4


def _ids():
    _, tok = hf_reference()
    return tok(ENGLISH_TEXT).input_ids


def _result(out):
    c = out.outputs[0]
    return c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def _same(a, b):
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-4


def _gen(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def cached():
    return LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=True)


@pytest.fixture(scope="module")
def uncached():
    return LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def _fresh(cached):
    cached.engine.manager.pool.reset_prefix_cache()
    yield
    cached.engine.manager.assert_idle_whole()


@pytest.mark.parametrize("shared", [0, 15, 16, 17, 48])  # around the 16-token block boundaries
def test_caching_on_off_alone_agree(cached, uncached, shared):
    ids = _ids()
    base = ids[:48]
    other = base[:shared] + ids[300:300 + 48 - shared]
    unrelated = [ids[500:530], ids[600:700], ids[700:705]]
    _gen(cached, [base])  # publishes base's blocks
    on = _gen(cached, [other] + unrelated)
    off = _gen(uncached, [other] + unrelated)
    alone = _gen(uncached, [other])
    _same(_result(on[0]), _result(alone[0]))
    _same(_result(off[0]), _result(alone[0]))
    for a, b in zip(on[1:], off[1:]):
        _same(_result(a), _result(b))
    # Reuse is whole blocks, and stops before the last prompt token.
    assert on[0].num_cached_tokens == 16 * (min(shared, 47) // 16)


def test_identical_prompts_in_one_step(cached, uncached):
    p = _ids()[:37]
    alone = _result(_gen(uncached, [p])[0])
    for out in _gen(cached, [p] * 16):
        _same(_result(out), alone)


def test_concurrent_shared_preamble_is_computed_once(cached, uncached):
    """Requests arriving together with one preamble: the first computes it, the rest wait one
    step for its blocks instead of computing them again."""
    ids = _ids()
    prompts = [ids[:160] + ids[300 + 7 * i:320 + 7 * i] for i in range(8)]
    stats = cached.engine.stats
    before = stats.prompt_tokens_computed
    outs = _gen(cached, prompts)
    assert stats.prompt_tokens_computed - before == 180 + 7 * 20
    assert [o.num_cached_tokens for o in outs] == [0] + [160] * 7
    for a, b in zip(outs, _gen(uncached, prompts)):
        _same(_result(a), _result(b))


def test_second_run_reports_cached_tokens(cached):
    p = _ids()[100:148]
    first = _gen(cached, [p])[0]
    second = _gen(cached, [p])[0]
    assert first.num_cached_tokens == 0
    assert 32 <= second.num_cached_tokens <= 47
    assert second.metrics.num_cached_tokens == second.num_cached_tokens
    _same(_result(first), _result(second))


def test_eviction_pressure_on_small_pool(uncached):
    llm = LLM(**EXACT, kv_cache_memory=BYTES_PER_TOKEN * 16 * 32, max_num_batched_tokens=512)
    ids = _ids()
    p = ids[:48]
    big = ids[200:670]  # 470 + 10 output tokens = 30 blocks of 32
    params_big = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    first = _result(_gen(llm, [p])[0])
    _gen(llm, [big], params_big)
    assert llm.engine.manager.pool.num_evictions > 0
    again = _gen(llm, [p])[0]
    _same(_result(again), first)
    # A request whose own hits must survive its allocation: 2 cached blocks + 28 new ones.
    _gen(llm, [p])
    hit_then_grow = p[:32] + ids[700:1138]
    out = _gen(llm, [hit_then_grow], params_big)[0]
    assert out.num_cached_tokens == 32
    _same(_result(out), _result(_gen(uncached, [hit_then_grow], params_big)[0]))
    llm.engine.manager.assert_idle_whole()


def test_abort_one_of_two_sharing_requests(cached, uncached):
    ids = _ids()
    a = ids[:40] + ids[400:410]
    b = ids[:40] + ids[500:510]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    expected = _result(_gen(uncached, [b], params)[0])
    _gen(cached, [ids[:40]])  # so that a and b share cached blocks
    eng = cached.engine
    eng.add_request("abort-a", {"prompt_token_ids": a}, params)
    eng.add_request("abort-b", {"prompt_token_ids": b}, params)
    outs = {}
    for step in range(100):
        for o in eng.step():
            outs[o.request_id] = o
        if step == 3:
            assert eng.manager.num_shared_blocks() > 0
            eng.abort_request("abort-a")
            eng.abort_request("abort-a")  # a second abort is a no-op
        if not eng.has_unfinished_requests():
            break
    assert outs["abort-a"].outputs[0].finish_reason == "abort"
    _same(_result(outs["abort-b"]), expected)
    eng.manager.assert_idle_whole()
    assert all(blk.ref_count == 0 for blk in eng.manager.pool.blocks)


def test_n4_forks_share_the_prompt(uncached):
    p = _ids()[:37]
    single = _gen(uncached, [p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    pool = uncached.engine.manager.pool
    before = pool.num_allocations
    out = _gen(uncached, [p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=4))[0]
    allocated = pool.num_allocations - before
    assert [c.token_ids for c in out.outputs] == [single] * 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # 37 + 8 tokens fit in 3 blocks: the prompt's 3 blocks once, plus one private copy of the
    # shared partial tail for 3 of the 4 choices (the last writer keeps the original).
    assert allocated == 3 + 3
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=4, seed=11)
    first = [c.token_ids for c in _gen(uncached, [p], seeded)[0].outputs]
    rerun = [c.token_ids for c in _gen(uncached, [p], seeded)[0].outputs]
    assert first == rerun
    assert len({tuple(t) for t in first}) == 4
    uncached.engine.manager.assert_idle_whole()


def test_beam_search_matches_hf(cached):
    model, tok = hf_reference()
    qs = ["What is 2+2?", "Name a color.", "What is the capital of Italy?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in qs]
    texts += ["def fibonacci(n):"]
    prompts = [tok(t).input_ids for t in texts]
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=1.0, early_stopping=False)
    outs = cached.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert cached.engine.manager.stats.cow_copies > 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=12,
                                 do_sample=False, length_penalty=1.0, early_stopping=False, pad_token_id=0)
        assert o.sequences[0].tokens == ref[0].tolist()
        assert len(o.sequences) == 4
        assert [s.score for s in o.sequences] == sorted((s.score for s in o.sequences), reverse=True)


def test_multi_turn_reuse_edit_and_salt(cached, uncached):
    _, tok = hf_reference()
    turn1 = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    out1 = cached.chat(turn1, params, use_tqdm=False)[0]
    len1 = len(out1.prompt_token_ids)
    turn2 = turn1 + [{"role": "assistant", "content": out1.outputs[0].text},
                     {"role": "user", "content": "Now give it a happy ending."}]
    out2 = cached.chat(turn2, params, use_tqdm=False)[0]
    assert out2.num_cached_tokens >= 16 * ((len1 - 1) // 16)
    cold = uncached.chat(turn2, params, use_tqdm=False)[0]
    _same(_result(out2), _result(cold))
    # Token-level continuation (prompt + output + more) reuses the output's blocks too.
    cont = list(out1.prompt_token_ids) + list(out1.outputs[0].token_ids) + tok("\nAnd then?").input_ids
    out_cont = _gen(cached, [cont])[0]
    assert out_cont.num_cached_tokens >= 16 * ((len1 + len(out1.outputs[0].token_ids) - 1) // 16)
    # An edited history reuses only the blocks before the first edited token.
    edited = [{"role": "user", "content": "Tell me a short story about a lighthouse cat."}] + turn2[1:]
    edited_ids = tok.apply_chat_template(edited, add_generation_prompt=True, tokenize=False)
    edited_ids = tok(edited_ids).input_ids
    first_diff = next(i for i, (x, y) in enumerate(zip(edited_ids, out2.prompt_token_ids)) if x != y)
    out_edit = _gen(cached, [edited_ids])[0]
    assert out_edit.num_cached_tokens == 16 * (first_diff // 16)
    _same(_result(out_edit), _result(_gen(uncached, [edited_ids])[0]))
    # A different tenant salt reuses nothing, even for identical tokens.
    salted = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, cache_salt="tenant-b")
    out_salt = _gen(cached, [out2.prompt_token_ids], salted)[0]
    assert out_salt.num_cached_tokens == 0
    again_salt = _gen(cached, [out2.prompt_token_ids], salted)[0]
    assert again_salt.num_cached_tokens > 0  # the same tenant does share with itself


def test_prompt_logprobs_on_a_cache_hit(cached, uncached):
    p = _ids()[50:120]
    _gen(cached, [p])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    hot = _gen(cached, [p], params)[0]
    cold = _gen(uncached, [p], params)[0]
    assert len(hot.prompt_logprobs) == len(p) and hot.prompt_logprobs[0] is None
    for a, b in zip(hot.prompt_logprobs[1:], cold.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert max(abs(a[k].logprob - b[k].logprob) for k in a) < 1e-4


def test_stats_are_reported(cached):
    p = _ids()[:64]
    _gen(cached, [p])
    _gen(cached, [p])
    stats = cached.engine.manager.stats_dict()
    assert stats["prefix_cache_queries"] > 0 and stats["prefix_cache_hits"] >= 48
    assert 0 < stats["prefix_cache_hit_rate"] <= 1
    for key in ("blocks_shared", "cow_copies", "evictions", "allocations"):
        assert key in stats
