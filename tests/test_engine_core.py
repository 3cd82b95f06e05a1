"""The engine's step without a model (kvshare.engine.core.EngineCore): a fake runner returns
token ids, the step is the engine's own. Each test names one rule of the step and checks it on
what the runner was handed, the tokens appended, the engine's counters and status, and the KV
core's tables; the audit (model-free too) watches the mixed workloads."""
from __future__ import annotations

import pytest

import fake_engine
from kvshare.config import EngineConfig
from kvshare.engine.request import Sequence, SeqStatus
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import plan_kv_groups
from kvshare.sampling_params import SamplingParams

BS = 4


def tokens(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    params=SamplingParams(max_tokens=max_tokens, cache_salt=salt))


def make_core(num_blocks: int = 32, budget: int = 64, max_seqs: int = 8, prefix_caching: bool = True,
              audit: bool = False):
    config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs, dtype="float32",
                          enable_prefix_caching=prefix_caching)
    core = fake_engine.model_free_core(config, KVCacheCoordinator(num_blocks, BS, plan_kv_groups([None], BS), prefix_caching))
    core.set_audit(audit)
    return core


def planned(core) -> dict[str, tuple[int, int]]:
    """The last plan the runner ran: seq id -> (first position, number of tokens)."""
    return {c.seq_id: (c.start, c.num_tokens) for c in core.runner.plans[-1].chunks}


def run_to_end(core, max_steps: int = 500) -> int:
    for steps in range(max_steps):
        if not core.scheduler.has_work():
            return steps
        fake_engine.step(core)
    raise AssertionError("did not finish")


def test_a_step_runs_the_plan_appends_the_sampled_token_and_publishes_full_blocks():
    core = make_core()
    seq = make_seq("A", tokens(10, 0), max_tokens=3)
    core.scheduler.add(seq)
    plan = core.step()
    assert core.runner.plans == [plan] and planned(core) == {"A": (0, 10)}
    assert seq.token_ids == tokens(10, 0) + [1010] and seq.num_computed_tokens == 10
    assert len(core.cached_block_hashes()) == 2  # positions 0..7: two full blocks, block 2 half full
    assert (core.stats.prompt_tokens_computed, core.stats.decode_tokens_computed) == (10, 0)
    assert core.step_count == 1 and core.status().running == 1


def test_a_step_with_nothing_to_run_counts_but_runs_nothing():
    core = make_core()
    plan = core.step()
    assert plan.is_empty() and core.runner.plans == [] and core.step_count == 1


def test_chunked_prefill_samples_only_at_the_prompts_end():
    core = make_core(budget=4)
    seq = make_seq("A", tokens(10, 0), max_tokens=2)
    core.scheduler.add(seq)
    chunks = []
    while not seq.is_finished:
        fake_engine.step(core)
        chunks.append(planned(core)["A"])
    assert chunks == [(0, 4), (4, 4), (8, 2), (10, 1)]
    assert [len(p.logit_rows()[2]) for p in core.runner.plans] == [0, 0, 1, 1]
    assert seq.output_token_ids == [1010, 1011] and seq.finish_reason == "length"
    assert (core.stats.prompt_tokens_computed, core.stats.decode_tokens_computed) == (10, 1)
    assert core.is_idle()


def test_admission_waits_for_a_seat_and_status_counts_running_and_waiting():
    core = make_core(max_seqs=2)
    seqs = [make_seq(f"S{i}", tokens(3, 100 * (i + 1)), max_tokens=2 + i) for i in range(3)]
    for s in seqs:
        core.scheduler.add(s)
    fake_engine.step(core)
    assert set(planned(core)) == {"S0", "S1"}
    status = core.status()
    assert (status.running, status.waiting, status.step) == (2, 1, 1)
    assert status.blocks_in_use == 2 and status.blocks_total == 32
    done = fake_engine.step(core)
    assert done == [seqs[0]]  # S0 reached its 2 tokens: its seat goes to S2 next step
    fake_engine.step(core)
    assert planned(core) == {"S1": (4, 1), "S2": (0, 3)}
    run_to_end(core)
    assert all(s.status is SeqStatus.FINISHED for s in seqs) and core.is_idle()


def test_preemption_recomputes_the_victim_and_counts_its_prompt_again():
    core = make_core(num_blocks=4, prefix_caching=False)
    a, b = make_seq("A", tokens(8, 100), max_tokens=3), make_seq("B", tokens(8, 200), max_tokens=3)
    core.scheduler.add(a)
    core.scheduler.add(b)
    fake_engine.step(core)  # both hold 2 blocks: the pool is full
    plan = core.step()  # each decode needs a third block: B, admitted last, makes room for A
    assert plan.preempted == ["B"] and planned(core) == {"A": (8, 1)}
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    run_to_end(core)
    assert a.output_token_ids == [1008, 1009, 1010] and b.output_token_ids == [1008, 1009, 1010]
    assert core.status().preemptions == 1
    assert core.stats.prompt_tokens_computed == 8 + 8 + 8  # B's prompt twice (its sampled token: decode)
    assert core.is_idle()


def test_a_fork_shares_the_parents_blocks_and_its_first_write_copies():
    core = make_core(audit=True)
    parent = make_seq("A", tokens(10, 0), max_tokens=4)
    core.scheduler.add(parent)
    fake_engine.step(core)
    child = Sequence(seq_id="A#1", request_id="A", index=1, token_ids=list(parent.token_ids),
                     num_prompt_tokens=parent.num_prompt_tokens, params=parent.params)
    core.scheduler.add_forked(parent, child)
    assert core.kv.block_ids("A#1") == core.kv.block_ids("A")
    plan = core.step()
    assert len(plan.block_copies) == 1  # the shared, half-full last block, copied before the write
    assert planned(core) == {"A": (10, 1), "A#1": (10, 1)}
    assert core.kv.block_ids("A#1")[:2] == core.kv.block_ids("A")[:2]
    assert core.kv.block_ids("A#1")[2] != core.kv.block_ids("A")[2]
    run_to_end(core)
    assert parent.output_token_ids == child.output_token_ids == [1010, 1011, 1012, 1013]
    assert core.is_idle() and core.auditor.num_checks > 0


def test_an_abort_mid_prefill_frees_every_block_and_the_next_step_skips_it():
    core = make_core(budget=4, audit=True)
    a, b = make_seq("A", tokens(12, 0)), make_seq("B", tokens(3, 500), max_tokens=1)
    core.scheduler.add(a)
    fake_engine.step(core)
    core.kv.events.record("abort", seq="A")
    core.scheduler.finish(a, "abort")
    core.auditor.check_state()
    assert core.kv.num_used_blocks() == 0
    core.scheduler.add(b)
    fake_engine.step(core)
    assert planned(core) == {"B": (0, 3)} and a.output_token_ids == []
    assert core.is_idle()


@pytest.mark.parametrize("prompt_len, hit", [(12, 8), (13, 12)])
def test_a_prefix_hit_stops_short_of_the_whole_prompt(prompt_len, hit):
    """The last prompt token is always computed (its logits give the first token): a prompt of
    whole blocks hits one block less."""
    core = make_core(audit=True)
    first = make_seq("A", tokens(prompt_len, 0), max_tokens=1)
    core.scheduler.add(first)
    run_to_end(core)
    again = make_seq("B", tokens(prompt_len, 0), max_tokens=1)
    core.scheduler.add(again)
    fake_engine.step(core)
    assert planned(core) == {"B": (hit, prompt_len - hit)} and again.num_cached_tokens == hit
    assert core.stats.prompt_tokens_computed == prompt_len + prompt_len - hit
    status = core.status()
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (2 * prompt_len, hit)


def test_a_prefix_hit_needs_the_same_cache_salt():
    core = make_core(audit=True)
    core.scheduler.add(make_seq("A", tokens(9, 0), max_tokens=1, salt="t1"))
    run_to_end(core)
    core.scheduler.add(make_seq("B", tokens(9, 0), max_tokens=1, salt="t2"))
    fake_engine.step(core)
    assert planned(core) == {"B": (0, 9)}


def test_the_audit_attaches_only_while_idle_and_reset_prefix_cache_forgets_unheld_blocks():
    core = make_core()
    seq = make_seq("A", tokens(9, 0), max_tokens=2)
    core.scheduler.add(seq)
    with pytest.raises(RuntimeError):
        core.set_audit(True)  # waiting work
    fake_engine.step(core)
    core.reset_prefix_cache()  # A holds its two published blocks: they stay
    assert len(core.cached_block_hashes()) == 2
    run_to_end(core)
    core.reset_prefix_cache()
    assert core.cached_block_hashes() == set() and core.is_idle()
    core.set_audit(True)
    assert core.auditor is not None and core.events is not None
    core.set_audit(False)
    assert core.auditor is None and core.events is None
