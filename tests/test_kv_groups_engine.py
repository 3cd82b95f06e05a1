"""Hybrid KV cache groups through the engine (issue 13 part 3), on a tiny random-weight Qwen2 with
mixed `layer_types` (4 sliding-window layers, 2 global: groups of 2 layers, so each block holds
two layers' KV and layer i reads storage slot j of its group). HF transformers is the numeric
reference and an engine with grouping off (`kv_cache_groups=False`) the bookkeeping reference:
same tokens, same logprobs, fewer blocks. Everything runs under audit."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import EXACT, tiny_model
from kvshare import SamplingParams
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.kvcache.replay import replay

WINDOW, BLOCK = 16, 4
LOCAL_BOUND = -(-WINDOW // BLOCK) + 1
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_hybrid")
    model = tiny_model("qwen2", path, num_hidden_layers=6, num_key_value_heads=2, use_sliding_window=True,
                       sliding_window=WINDOW, layer_types=TYPES, max_position_embeddings=512)
    return model, str(path)


def make_engine(path: str, grouped: bool = True, **kw) -> LLMEngine:
    opts = dict(kv_cache_memory="2MiB", block_size=BLOCK, max_num_batched_tokens=8, audit=True)
    opts.update(kw)
    return LLMEngine(EngineConfig.from_kwargs(**EXACT, model=path, kv_cache_groups=grouped, **opts))


def run(engine: LLMEngine, requests: dict, each_step=None) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if each_step is not None:
            each_step(engine)
    return finals


def tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def local_groups(engine: LLMEngine) -> list[int]:
    return [g for g, grp in enumerate(engine.kv_groups) if grp.window is not None]


def check_window_bound(engine: LLMEngine) -> None:
    """After every step, from the pool: each running sequence's blocks per local group are at most
    ceil(W / B) + 1, and the blocks naming it as an owner are exactly its tables' blocks."""
    mgr = engine.manager
    for seq in engine.scheduler.running:
        owned = {b.block_id for b in mgr.pool.blocks if seq.seq_id in b.owners}
        tables = [{b for b in mgr.block_ids(seq.seq_id, g) if b is not None} for g in range(mgr.num_groups)]
        assert owned == set().union(*tables)
        for g in local_groups(engine):
            assert len(tables[g]) <= LOCAL_BOUND, f"{seq.seq_id} group {g}: {len(tables[g])} blocks at " \
                                                  f"{seq.num_computed_tokens} computed"


def test_groups_are_planned_and_sized_per_group(hybrid):
    _, path = hybrid
    grouped, flat = make_engine(path), make_engine(path, grouped=False)
    assert [g.layers for g in grouped.kv_groups] == [(2, 5), (0, 1), (3, 4)]
    assert len(flat.kv_groups) == 1 and flat.manager.num_groups == 1
    # A block holds 2 layers' KV instead of 6: three times the blocks from the same budget.
    assert grouped.layout.bytes_per_token * 3 == flat.layout.bytes_per_token
    assert grouped.layout.num_blocks // 3 == flat.layout.num_blocks  # same budget, a third of the bytes per block
    assert grouped.kv_cache.data.shape[0] == 2


def test_a_sequence_of_8_windows_matches_hf_and_ungrouped_holding_its_window(hybrid, tmp_path):
    model, path = hybrid
    log = str(tmp_path / "events.jsonl")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 320, (30,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8 * WINDOW - 30, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    grouped = make_engine(path, kv_event_log=log)
    most = {}

    def bound_and_peak(engine):
        check_window_bound(engine)
        for gi in local_groups(engine):
            for seq in engine.scheduler.running:
                most[gi] = max(most.get(gi, 0), engine.manager.num_held_blocks(seq.seq_id, gi))

    out = run(grouped, {"a": (prompt, params)}, bound_and_peak)["a"]
    assert all(m == LOCAL_BOUND for m in most.values()) and len(most) == 2
    full = prompt + out.outputs[0].token_ids
    assert len(full) == 8 * WINDOW
    ref = hf_logprobs(model, full)
    toks, lps = tokens_and_logprobs(out)
    assert toks == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(len(toks))]
    assert max(abs(lp - ref[len(prompt) - 1 + i, t].item()) for i, (t, lp) in enumerate(zip(toks, lps))) < 1e-3
    flat_out = run(make_engine(path, grouped=False), {"a": (prompt, params)})["a"]
    flat_toks, flat_lps = tokens_and_logprobs(flat_out)
    assert flat_toks == toks and max(abs(a - b) for a, b in zip(lps, flat_lps)) < 1e-5
    assert max(abs(a.logprob - b.logprob) for pa, pb in zip(out.prompt_logprobs[1:], flat_out.prompt_logprobs[1:])
               for a, b in [(next(iter(pa.values())), next(iter(pb.values())))]) < 1e-5
    grouped.manager.assert_idle_whole()
    grouped.events.flush()
    assert replay(log).clean  # the offline checker follows one access per group


def test_prefix_hits_on_a_long_prompt_with_the_local_groups_early_blocks_gone(hybrid):
    model, path = hybrid
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 320, (100,), generator=g).tolist()
    engine = make_engine(path)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    run(engine, {"a": (shared + [7], params)})
    mgr, pool = engine.manager, engine.manager.pool
    # Evict every cached block of the local groups except the last window before position 100:
    # a pool under pressure hands the least recently freed blocks out first, and those are the
    # early window blocks the local groups released while "a" ran.
    keep = (100 - WINDOW + 1) // BLOCK
    evicted = 0
    for gi in local_groups(engine):
        m = mgr.groups[gi]
        for i, h in enumerate(m.cached_block("probe", shared, i) for i in range(25)):
            if h is not None and i < keep:
                pool.evict(h)
                evicted += 1
        mgr.free("probe")
    assert evicted == 2 * keep
    prompt_b = shared + torch.randint(0, 320, (6,), generator=g).tolist()
    seen = {}

    def look(e):
        if "b" in e.manager.seqs and not seen:
            seen.update({gi: e.manager.block_ids("b", gi) for gi in range(e.manager.num_groups)})
    out = run(engine, {"b": (prompt_b, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))},
              look)["b"]
    assert out.num_cached_tokens == 100
    for gi in local_groups(engine):
        assert seen[gi][:keep] == [None] * keep  # the evicted blocks were never needed
    full = prompt_b + out.outputs[0].token_ids
    ref = hf_logprobs(model, full)
    toks, lps = tokens_and_logprobs(out)
    first = len(prompt_b) - 1
    assert toks == [int(ref[first + i].argmax()) for i in range(len(toks))]
    assert max(abs(lp - ref[first + i, t].item()) for i, (t, lp) in enumerate(zip(toks, lps))) < 1e-3
    engine.manager.assert_idle_whole()


def test_together_equals_alone_with_mixed_requests(hybrid):
    _, path = hybrid
    rng = random.Random(7)
    common = [rng.randrange(320) for _ in range(24)]
    requests = {}
    for i, n in enumerate([3, 17, 40, 9, 33]):
        prompt = (common if i % 2 else []) + [rng.randrange(320) for _ in range(n)]
        requests[f"r{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True,
                                                    logprobs=0))
    together = run(make_engine(path, max_num_batched_tokens=24), requests, check_window_bound)
    one_at_a_time = make_engine(path, enable_prefix_caching=False, max_num_batched_tokens=24, audit=False)
    for rid, req in requests.items():
        alone = run(one_at_a_time, {rid: req})[rid]
        ta, la = tokens_and_logprobs(alone)
        tb, lb = tokens_and_logprobs(together[rid])
        assert ta == tb, rid
        assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-4, rid


def test_the_pool_is_whole_after_abort_and_preemption_storms(hybrid):
    _, path = hybrid
    # A small pool: 40 blocks of 4 tokens for 3 groups, so the requests below preempt each other.
    engine = make_engine(path, kv_cache_memory=40 * BLOCK * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=16)
    assert engine.layout.num_blocks == 40
    rng = random.Random(11)
    common = [rng.randrange(320) for _ in range(12)]
    for i in range(7):
        prompt = (common if i % 3 == 0 else []) + [rng.randrange(320) for _ in range(rng.randint(3, 20))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(10, 30), ignore_eos=True,
                                          n=2 if i == 4 else 1))
    aborted = 0
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        check_window_bound(engine)
        if step % 7 == 3:
            live = [r for r in engine.requests]
            if live and aborted < 3:
                engine.abort_request(rng.choice(live))
                aborted += 1
    assert not engine.has_unfinished_requests()
    assert aborted == 3 and engine.scheduler.num_preemptions > 0
    engine.manager.assert_idle_whole()
    assert engine.manager.num_free_blocks() == 40


def test_gemma3_five_local_to_one_global_holds_its_window_per_group(tmp_path):
    """Gemma 3's own pattern (5 local : 1 global, separate local RoPE base, q/k norms): a sequence
    of 8 windows keeps ceil(W/B)+1 blocks per local group at every step, equals grouping off, and
    matches HF."""
    window = 8
    model = tiny_model("gemma3", tmp_path, num_hidden_layers=6, num_key_value_heads=1, sliding_window=window,
                       max_position_embeddings=256)
    path = str(tmp_path)
    engine = make_engine(path)
    assert [g.window for g in engine.kv_groups].count(None) == 1 and len(engine.kv_groups) == 6
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8 * window - 20, ignore_eos=True, logprobs=0)
    bound = -(-window // BLOCK) + 1

    def check(eng):
        for seq in eng.scheduler.running:
            for gi in local_groups(eng):
                assert eng.manager.num_held_blocks(seq.seq_id, gi) <= bound

    out = run(engine, {"a": (prompt, params)}, check)["a"]
    toks, lps = tokens_and_logprobs(out)
    ref = hf_logprobs(model, prompt + toks)
    assert toks == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(len(toks))]
    assert max(abs(lp - ref[len(prompt) - 1 + i, t].item()) for i, (t, lp) in enumerate(zip(toks, lps))) < 1e-3
    flat_toks, flat_lps = tokens_and_logprobs(run(make_engine(path, grouped=False), {"a": (prompt, params)})["a"])
    assert flat_toks == toks and max(abs(a - b) for a, b in zip(lps, flat_lps)) < 1e-5
    engine.manager.assert_idle_whole()
