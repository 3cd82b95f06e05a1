"""Issue 32, parts 2 and 3: priority scheduling (vLLM's --scheduling-policy priority and a request's
`priority`, lower first) and deadlines (a request's `timeout`, finish_reason "timeout").

The scheduling rules are shown without a model (the engine's own step over the fake runner of
tests/fake_engine.py); deadlines on a small random-weight engine with the audit on and a fake clock
(no test sleeps), ending queued, mid-prefill, mid-decode and mid-beam requests; one end-to-end test
on the bundled model shows a preempted low-priority request finishing with its tokens alone."""
from __future__ import annotations

import pytest

import fake_engine
from helpers import EXACT, tiny_model
from kvshare import LLM, BeamSearchParams, SamplingParams
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.request import Sequence
from kvshare.errors import InvalidRequestError
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import one_group
from kvshare.kvcache.kv_policy import FullAttention

BS = 4


# ---- priority, model-free -------------------------------------------------------------------------

def make_core(num_blocks: int, policy: str, max_seqs: int = 8, budget: int = 64):
    config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs, dtype="float32",
                          scheduling_policy=policy)
    kv = KVCacheCoordinator(num_blocks, BS, one_group(FullAttention(BS)), True)
    return fake_engine.model_free_core(config, kv), kv


def make_seq(seq_id: str, base: int, arrival: float, priority: int = 0, prompt_len: int = 8,
             max_tokens: int = 8) -> Sequence:
    prompt = list(range(base, base + prompt_len))
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=prompt, num_prompt_tokens=prompt_len,
                    params=SamplingParams(max_tokens=max_tokens, priority=priority), arrival_time=arrival)


def run_to_end(core, limit: int = 200) -> list[str]:
    """Step until nothing is left; the sequence ids in the order they finished."""
    done: list[str] = []
    for _ in range(limit):
        if not core.scheduler.has_work():
            return done
        done += [s.seq_id for s in fake_engine.step(core)]
    raise AssertionError("the scheduler never drained")


def test_priority_admits_by_priority_then_arrival():
    core, kv = make_core(64, "priority", max_seqs=1)
    for sid, base, arrival, prio in [("late-low", 0, 0.0, 5), ("hi-1", 100, 1.0, 0), ("mid", 200, 2.0, 2),
                                     ("hi-2", 300, 3.0, 0)]:
        core.scheduler.add(make_seq(sid, base, arrival, prio))
    assert run_to_end(core) == ["hi-1", "hi-2", "mid", "late-low"]
    kv.assert_idle_whole()


def test_fcfs_among_equal_priorities_and_no_preemption_between_them():
    # Under the priority policy, equals keep arrival order, and a newcomer of the same priority
    # never preempts a running one however short the pool (that would only thrash).
    core, kv = make_core(8, "priority", max_seqs=8)
    for i in range(6):
        core.scheduler.add(make_seq(f"r{i}", 100 * i, float(i), priority=3, prompt_len=12, max_tokens=4))
    order, preempted = [], []
    for _ in range(200):
        if not core.scheduler.has_work():
            break
        plan = fake_engine.run_step(core)
        preempted += plan.preempted
        order += [c.seq_id for c in plan.chunks if c.start == 0]
    assert order == [f"r{i}" for i in range(6)]  # first scheduled in arrival order
    assert preempted == []
    kv.assert_idle_whole()


def _full_pool_then_urgent(policy: str):
    """Two running requests fill the pool (`old-low` priority 9, admitted first; `new-mid` priority
    1, admitted second); `urgent` (priority 0) arrives and does not fit. Returns the step's plan."""
    core, kv = make_core(6, policy, max_seqs=8)
    prio = (lambda p: p) if policy == "priority" else (lambda p: 0)
    core.scheduler.add(make_seq("old-low", 0, 0.0, prio(9), prompt_len=11, max_tokens=4))
    core.scheduler.add(make_seq("new-mid", 100, 1.0, prio(1), prompt_len=11, max_tokens=4))
    fake_engine.step(core)  # both admitted: 3 blocks each, the pool's 6
    assert kv.num_free_blocks() == 0 and len(core.scheduler.running) == 2
    core.scheduler.add(make_seq("urgent", 200, 2.0, prio(0), prompt_len=8, max_tokens=4))
    return core, kv, fake_engine.run_step(core)


def test_an_urgent_request_preempts_the_least_important_running_one():
    core, kv, plan = _full_pool_then_urgent("priority")
    # old-low is the oldest, so FCFS would keep it; by priority it is the one that goes.
    assert plan.preempted == ["old-low"]
    assert "urgent" in {c.seq_id for c in plan.chunks}
    status = core.status()
    assert status.running_by_priority == {0: 1, 1: 1} and status.waiting_by_priority == {9: 1}
    assert run_to_end(core)[-1] == "old-low"
    kv.assert_idle_whole()


def test_fcfs_policy_keeps_its_old_rule():
    core, kv, plan = _full_pool_then_urgent("fcfs")
    # Running decodes first; the newcomer waits for room and preempts nobody.
    assert plan.preempted == [] and "urgent" not in {c.seq_id for c in plan.chunks}
    assert run_to_end(core) == ["old-low", "new-mid", "urgent"]
    kv.assert_idle_whole()


def test_pool_pressure_on_running_requests_preempts_the_least_important():
    # Two running requests that must grow past the pool: under fcfs the newest goes (the old
    # rule); under priority the one of larger priority value, though it is older.
    for policy, victim in [("fcfs", "young-hi"), ("priority", "old-low")]:
        core, kv = make_core(6, policy, max_seqs=8)
        core.scheduler.add(make_seq("old-low", 0, 0.0, 7 if policy == "priority" else 0, prompt_len=12,
                                    max_tokens=8))
        core.scheduler.add(make_seq("young-hi", 100, 1.0, 0, prompt_len=12, max_tokens=8))
        preempted: list[str] = []
        for _ in range(100):
            if not core.scheduler.has_work():
                break
            preempted += fake_engine.run_step(core).preempted
        assert preempted and preempted[0] == victim, (policy, preempted)
        kv.assert_idle_whole()


# ---- bad values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [(dict(priority=1.5), "priority"), (dict(priority=True), "priority"),
                                       (dict(priority="1"), "priority"), (dict(timeout=0), "timeout"),
                                       (dict(timeout=-2.0), "timeout"), (dict(timeout="5"), "timeout"),
                                       (dict(timeout=float("inf")), "timeout"), (dict(timeout=True), "timeout")])
def test_bad_priority_or_timeout_is_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == field and f"SamplingParams.{field}=" in str(e.value)
    with pytest.raises(InvalidRequestError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(beam_width=2, max_tokens=4, **kw)


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is invalid: must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")


# ---- deadlines on a small engine, audited, with a fake clock -------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_deadlines")
    tiny_model("llama", path, num_key_value_heads=2)
    return str(path)


def make_engine(model_dir, **overrides) -> tuple[LLMEngine, FakeClock]:
    opts = dict(model=model_dir, kv_cache_memory=24 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16,
                max_num_batched_tokens=64, audit=True)
    opts.update(overrides)
    engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, **opts))
    clock = engine.clock = FakeClock()
    return engine, clock


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def drain(engine, finals: dict, limit: int = 500) -> dict:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finals
        step_into(engine, finals)
    raise AssertionError("the engine never drained")


def step_into(engine, finals: dict) -> None:
    for out in engine.step():
        if out.finished:
            assert out.request_id not in finals, f"{out.request_id} finished twice"
            finals[out.request_id] = out


def test_fcfs_engine_refuses_a_priority_naming_the_flag(tiny_dir):
    engine, _ = make_engine(tiny_dir)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [1, 2, 3], greedy(2, priority=1))
    assert e.value.param == "priority" and "--scheduling-policy priority" in str(e.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [1, 2, 3], greedy(2, priority=0))  # 0 is every request's default
    assert drain(engine, {})["r"].outputs[0].finish_reason == "length"


def test_queued_prefill_and_decode_deadlines_end_once_with_timeout(tiny_dir):
    # One seat and a 16-token step budget: "running" holds the seat, "queued" waits; "prefill"
    # (after them) is mid-way through a 60-token prompt when its deadline passes.
    engine, clock = make_engine(tiny_dir, max_num_seqs=2, max_num_batched_tokens=16)
    finals: dict = {}
    engine.add_request("decode", list(range(1, 9)), greedy(200, timeout=5.0))
    engine.add_request("prefill", list(range(10, 70)), greedy(4, timeout=5.0))
    engine.add_request("queued", list(range(100, 110)), greedy(4, timeout=5.0))
    engine.add_request("free", list(range(120, 130)), greedy(3))  # no deadline: it finishes normally
    for _ in range(3):
        step_into(engine, finals)
    assert engine.requests["prefill"].seqs[0].in_prefill and engine.requests["prefill"].seqs[0].num_computed_tokens
    assert engine.requests["queued"].seqs[0].num_computed_tokens == 0
    decoded = len(engine.requests["decode"].seqs[0].output_token_ids)
    assert decoded >= 1
    clock.now += 4.9
    step_into(engine, finals)
    assert not finals  # not yet
    clock.now += 0.2
    step_into(engine, finals)
    assert {r: finals[r].outputs[0].finish_reason for r in finals} == dict.fromkeys(["decode", "prefill", "queued"],
                                                                                   "timeout")
    assert len(finals["decode"].outputs[0].token_ids) >= decoded  # the partial output comes back
    assert finals["prefill"].outputs[0].token_ids == [] and finals["queued"].outputs[0].token_ids == []
    drain(engine, finals)
    assert finals["free"].outputs[0].finish_reason == "length"
    engine.manager.assert_idle_whole()  # LEAK-OK: every timed-out block went back through the one release path
    assert engine.auditor.num_checks > 0


def test_beam_search_deadline_ends_with_timeout_and_leaks_no_block(tiny_dir):
    engine, clock = make_engine(tiny_dir)
    engine.add_request("beam", list(range(1, 12)), BeamSearchParams(beam_width=3, max_tokens=40, timeout=2.0))
    finals: dict = {}
    for _ in range(5):
        step_into(engine, finals)
    assert len([s for s in engine.requests["beam"].seqs if not s.is_finished]) > 1  # several live beams
    clock.now += 2.0
    step_into(engine, finals)
    out = finals["beam"]
    assert out.outputs and all(o.finish_reason == "timeout" for o in out.outputs)
    assert all(len(o.token_ids) >= 4 for o in out.outputs)
    drain(engine, finals)
    engine.manager.assert_idle_whole()  # LEAK-OK


def test_an_aborted_request_still_says_abort_and_a_deadline_after_the_end_is_moot(tiny_dir):
    engine, clock = make_engine(tiny_dir)
    engine.add_request("a", [1, 2, 3], greedy(50, timeout=1.0))
    engine.add_request("b", [4, 5, 6], greedy(2, timeout=1.0))
    finals: dict = {}
    step_into(engine, finals)
    engine.abort_request("a")
    drain(engine, finals)
    clock.now += 10
    engine.step()
    assert finals["a"].outputs[0].finish_reason == "abort" and finals["b"].outputs[0].finish_reason == "length"
    engine.manager.assert_idle_whole()  # LEAK-OK


# ---- end to end on the bundled model ----------------------------------------------------------------

SMOL_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # the bundled SmolLM2-135M, default mode: bfloat16 K and V


def test_preempted_low_priority_request_finishes_with_its_tokens_alone():
    # A pool of 6 blocks of 16: two running 40-token prompts (3 blocks each) fill it; an urgent
    # request arriving then preempts the low-priority one (though it is the oldest), which is
    # recomputed later and must finish with the very tokens it gets alone.
    # The default mode: bit-transparent, so a recomputed request's tokens are its tokens alone.
    engine = LLMEngine(EngineConfig.from_kwargs(scheduling_policy="priority", block_size=16,
                                                kv_cache_memory=6 * 16 * SMOL_BYTES_PER_TOKEN,
                                                max_num_batched_tokens=128))
    assert engine.layout.num_blocks == 6
    prompts = engine.tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 8))
    low_prompt, mid_prompt, urgent_prompt = prompts[:40], prompts[3:43], prompts[7:27]
    finals: dict = {}
    engine.add_request("low", low_prompt, greedy(8, priority=5))
    engine.add_request("mid", mid_prompt, greedy(8, priority=1))
    step_into(engine, finals)
    engine.add_request("urgent", urgent_prompt, greedy(8, priority=0))
    before = engine.status().preemptions
    step_into(engine, finals)
    assert engine.status().preemptions == before + 1
    assert engine.requests["low"].seqs[0].num_computed_tokens == 0  # the one preempted: the least important
    assert engine.requests["mid"].seqs[0].num_computed_tokens > 0
    drain(engine, finals)
    assert finals["low"].metrics.num_preemptions >= 1 and finals["mid"].metrics.num_preemptions == 0
    engine.manager.assert_idle_whole()
    engine.reset_prefix_cache()
    engine.add_request("low-alone", low_prompt, greedy(8, priority=5))
    alone = drain(engine, {})["low-alone"].outputs[0]
    assert finals["low"].outputs[0].token_ids == alone.token_ids
    assert finals["low"].outputs[0].text == alone.text


def test_llm_generate_takes_vllms_priority_list(tiny_dir):
    llm = LLM(**EXACT, model=tiny_dir, scheduling_policy="priority", max_num_seqs=1,
              kv_cache_memory=24 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16)
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], greedy(2), priority=[3, -1], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]  # in prompt order
    # One seat: the more important second prompt ran first.
    assert outs[1].metrics.first_scheduled_time < outs[0].metrics.first_scheduled_time
    with pytest.raises(InvalidRequestError, match="one integer per prompt"):
        llm.generate([[1, 2, 3], [4, 5, 6]], greedy(2), priority=[0])
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate([[1, 2, 3]], greedy(2), priority=[0.5])
