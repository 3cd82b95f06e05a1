"""The life of a KV block, told without a model (issue 11, item 6).

The scheduler, the KV cache manager and the bounded-KV policies are driven through the engine's
own step (kvshare.engine.core.EngineCore, with the fake runner of tests/fake_engine.py) over fake
sequences: token ids are plain integers, no tokenizer, no weights, no forward pass. Each test
states one rule of the bookkeeping in its name and checks it on public observables only: which
sequences a step schedules and with how many tokens, block ids per sequence, reference counts, the
free count, prefix-cache stats, evictions, and the copies / rotations / preemptions a step hands
the runner.

Every call that depends on the shape of the engine core / manager / scheduler API lives in the
helpers right below (`step`, `fork`, `table_of`, `released_by`), so a change of that API is an
edit there, not in the tests.
"""
from __future__ import annotations

from typing import Callable

import pytest

import fake_engine
from kvshare.config import EngineConfig
from kvshare.engine.core import EngineCore
from kvshare.engine.request import Sequence, SeqStatus
from kvshare.engine.step_plan import StepPlan
from kvshare.kvcache.block_pool import BlockPoolError
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import one_group
from kvshare.kvcache.kv_policy import FullAttention, SinkWindow, SlidingWindow
from kvshare.sampling_params import SamplingParams

BS = 4  # tokens per block: small, so a handful of tokens spans several blocks


# ---- building blocks: fake sequences and a small model-free engine ---------------------------

def tokens(n: int, base: int) -> list[int]:
    """n fake token ids; distinct bases give prompts that share no block."""
    return list(range(base, base + n))


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 8, salt: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=list(prompt),
                    num_prompt_tokens=len(prompt),
                    params=SamplingParams(max_tokens=max_tokens, cache_salt=salt))


def make_core(num_blocks: int, budget: int = 64, max_seqs: int = 8, policy=None,
              prefix_caching: bool = True, events: EventLog | None = None):
    # EngineConfig loads nothing by itself (model=None only names the default model); the
    # scheduler reads just the token budget and the seat count from it.
    config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          dtype="float32", enable_prefix_caching=prefix_caching)
    manager = KVCacheCoordinator(num_blocks, BS, one_group(policy or FullAttention(BS)), prefix_caching, events=events)
    return fake_engine.model_free_core(config, manager), manager


# ---- the only places that know the engine core / manager / scheduler API's shape -------------

def step(core: EngineCore, during: Callable[[StepPlan], None] | None = None) -> StepPlan:
    """One engine step (EngineCore.step): plan; run (the fake runner samples 1000 + the
    sequence's length); every chunk's positions count as computed and the blocks they completed
    are published; each chunk that reached the end of its known tokens appends its sampled token,
    and a sequence that reached its max_tokens finishes. Returns the plan. `during(plan)` looks
    inside the step, after planning and before the run: what planning alone did."""
    return fake_engine.run_step(core, during)


def scheduled(out: StepPlan) -> dict[str, tuple[int, int]]:
    """seq id -> (first position computed, number of tokens), in the order the step lists them."""
    return {c.seq_id: (c.start, c.num_tokens) for c in out.chunks}


def fork(core: EngineCore, parent: Sequence, child_id: str) -> Sequence:
    """A sibling sharing everything the parent has computed (n > 1, beam search)."""
    child = Sequence(seq_id=child_id, request_id=parent.request_id, index=1, token_ids=list(parent.token_ids),
                     num_prompt_tokens=parent.num_prompt_tokens, params=parent.params)
    core.scheduler.add_forked(parent, child)
    return child


def table_of(manager: KVCacheCoordinator, seq_id: str) -> list[int | None] | None:
    """Block ids of a sequence's table (None entries: released by a window), or None when the
    sequence holds no table at all."""
    if seq_id not in manager.tables:
        return None
    return manager.block_ids(seq_id)


def released_by(events: EventLog, seq_id: str) -> list[int]:
    """Blocks this sequence let go of, in the order it let go of them."""
    return [e["block"] for e in events.recent if e["ev"] == "decref" and e["seq"] == seq_id]


# ---- small readers of the pool --------------------------------------------------------------

def ref(manager: KVCacheCoordinator, block_id: int) -> int:
    return manager.pool.blocks[block_id].ref_count


def published(manager: KVCacheCoordinator, block_id: int) -> bool:
    return manager.pool.blocks[block_id].block_hash is not None


def run_until(core: EngineCore, seq: Sequence, computed: int, max_steps: int = 200) -> dict[int, StepPlan]:
    """Step until `seq` has `computed` positions computed; returns each step's output keyed by
    the first position it computed for `seq`."""
    outs = {}
    for _ in range(max_steps):
        if seq.num_computed_tokens >= computed:
            return outs
        out = step(core)
        plan = scheduled(out)
        assert seq.seq_id in plan, f"{seq.seq_id} was not scheduled: {plan}"
        outs[plan[seq.seq_id][0]] = out
    raise AssertionError(f"{seq.seq_id} did not reach {computed} computed positions")


# ---- admission and the token budget ----------------------------------------------------------

def test_admission_is_fcfs_and_a_short_pool_stops_the_queue_at_its_head():
    core, mgr = make_core(num_blocks=8)
    a = make_seq("A", tokens(17, 100))  # 5 blocks
    b = make_seq("B", tokens(16, 200))  # 4 blocks
    c = make_seq("C", tokens(4, 300))  # 1 block
    for s in (a, b, c):
        core.scheduler.add(s)

    out = step(core)
    assert scheduled(out) == {"A": (0, 17)}
    assert len(table_of(mgr, "A")) == 5
    # B needs 4 blocks and 3 are free, so B waits; C would fit in what is left but must not
    # overtake B (admission is first come, first served).
    assert mgr.num_free_blocks() == 3
    assert [s.seq_id for s in core.scheduler.waiting] == ["B", "C"]
    assert table_of(mgr, "B") is None and table_of(mgr, "C") is None

    core.scheduler.finish(a, "abort")
    out = step(core)
    # With A's blocks back, B and C are admitted in queue order.
    assert list(scheduled(out).items()) == [("B", (0, 16)), ("C", (0, 4))]
    assert mgr.num_free_blocks() == 8 - 4 - 1


def test_chunked_prefill_stays_within_the_token_budget_and_decodes_go_first():
    core, mgr = make_core(num_blocks=16, budget=8)
    a = make_seq("A", tokens(20, 100))
    b = make_seq("B", tokens(12, 200))
    core.scheduler.add(a)
    core.scheduler.add(b)

    plans = []
    for _ in range(4):
        out = step(core)
        assert out.num_tokens <= 8
        plans.append(scheduled(out))
    assert plans == [
        {"A": (0, 8)},  # the whole budget goes to A's prompt: B waits
        {"A": (8, 8)},
        {"A": (16, 4), "B": (0, 4)},  # A's last chunk leaves 4 tokens of budget for B's first
        {"A": (20, 1), "B": (4, 7)},  # A now decodes: its one token comes first, B gets the rest
    ]
    # Blocks follow computed positions: A holds 21 positions (6 blocks), B 11 (3 blocks).
    assert len(table_of(mgr, "A")) == 6 and len(table_of(mgr, "B")) == 3


# ---- prefix cache ------------------------------------------------------------------------------

def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_prompt_token_to_compute():
    core, mgr = make_core(num_blocks=16)
    p = tokens(12, 100)  # exactly 3 full blocks
    a = make_seq("A", p)
    core.scheduler.add(a)
    step(core)
    ta = table_of(mgr, "A")
    assert all(published(mgr, blk) for blk in ta)

    # B is A's prompt: its last token must be computed (its logits give B's first token), so
    # only 2 of the 3 cached blocks are reused. C extends the prompt by one token: all 3 are.
    b = make_seq("B", p)
    c = make_seq("C", p + [99])
    core.scheduler.add(b)
    core.scheduler.add(c)
    plan = scheduled(step(core))
    assert plan["B"] == (8, 4) and plan["C"] == (12, 1)
    tb, tc = table_of(mgr, "B"), table_of(mgr, "C")
    assert tb[:2] == ta[:2] and tb[2] not in ta
    assert tc[:3] == ta[:3]
    assert [ref(mgr, blk) for blk in ta[:3]] == [3, 3, 2]  # A, B, C / A, B, C / A, C
    assert b.num_cached_tokens == 8 and c.num_cached_tokens == 12
    assert (mgr.stats.queries, mgr.stats.hits) == (12 + 12 + 13, 0 + 8 + 12)


def test_prefix_hit_needs_the_same_cache_salt():
    core, mgr = make_core(num_blocks=16)
    p = tokens(12, 100)
    core.scheduler.add(make_seq("A", p, salt="alice"))
    step(core)
    ta = table_of(mgr, "A")

    core.scheduler.add(make_seq("B", p, salt="bob"))
    core.scheduler.add(make_seq("C", p, salt="alice"))  # the control: same tenant, so it does hit
    core.scheduler.add(make_seq("D", p))  # no salt is a tenant of its own too
    plan = scheduled(step(core))
    assert plan["B"] == (0, 12) and plan["D"] == (0, 12)
    assert plan["C"] == (8, 4)
    assert not set(table_of(mgr, "B")) & set(ta)
    assert not set(table_of(mgr, "D")) & set(ta)
    assert table_of(mgr, "C")[:2] == ta[:2]
    assert mgr.stats.hits == 8


def test_a_block_is_published_only_after_the_step_that_computed_it_whole():
    core, mgr = make_core(num_blocks=16, budget=6)
    a = make_seq("A", tokens(12, 100))
    core.scheduler.add(a)

    def planned_not_yet_written(out: StepPlan) -> None:
        assert scheduled(out) == {"A": (0, 6)}
        t = table_of(mgr, "A")
        assert not any(published(mgr, blk) for blk in t)  # planned, not yet written

    step(core, during=planned_not_yet_written)
    t = table_of(mgr, "A")
    # Positions 0..5 are written: block 0 is whole, block 1 holds only 4..5.
    assert [published(mgr, blk) for blk in t] == [True, False]

    def planned_second_chunk(out: StepPlan) -> None:
        assert scheduled(out) == {"A": (6, 6)}
        t = table_of(mgr, "A")
        assert [published(mgr, blk) for blk in t] == [True, False, False]

    step(core, during=planned_second_chunk)
    t = table_of(mgr, "A")
    assert [published(mgr, blk) for blk in t] == [True, True, True]


def test_a_request_waits_a_step_for_a_prefix_being_computed_instead_of_recomputing_it():
    core, mgr = make_core(num_blocks=16)
    p = tokens(12, 100)
    a, b = make_seq("A", p), make_seq("B", p)
    core.scheduler.add(a)
    core.scheduler.add(b)

    out = step(core)
    # Room and budget for B are there, but A is computing B's first block right now.
    assert scheduled(out) == {"A": (0, 12)}
    assert mgr.num_free_blocks() >= 3 and [s.seq_id for s in core.scheduler.waiting] == ["B"]

    assert scheduled(step(core)) == {"A": (12, 1), "B": (8, 4)}
    assert table_of(mgr, "B")[:2] == table_of(mgr, "A")[:2]
    assert b.num_cached_tokens == 8


# ---- preemption ----------------------------------------------------------------------------------

def test_preemption_frees_the_most_recently_admitted_sequence_which_is_recomputed_later():
    # Without the prefix cache, so that "recomputed" means every position again.
    log = EventLog()
    core, mgr = make_core(num_blocks=6, prefix_caching=False, events=log)
    a, b, c = (make_seq(n, tokens(8, base)) for n, base in (("A", 100), ("B", 200), ("C", 300)))
    for s in (a, b, c):
        core.scheduler.add(s)
    step(core)  # all three hold 2 blocks: the pool is full
    assert mgr.num_free_blocks() == 0
    c_blocks = table_of(mgr, "C")

    # Each decode now needs a third block. C, admitted last, makes room for A and B.
    out = step(core)
    assert out.preempted == ["C"]
    assert scheduled(out) == {"A": (8, 1), "B": (8, 1)}
    assert table_of(mgr, "C") is None
    assert released_by(log, "C") == c_blocks[::-1]  # the one release path: tail first, like finish
    assert sorted([table_of(mgr, "A")[2], table_of(mgr, "B")[2]]) == sorted(c_blocks)
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert core.scheduler.waiting[0] is c and c.num_tokens == 9  # it keeps the token it had sampled

    # C waits while the pool is still short; once A is gone it comes back and recomputes all 9
    # of its tokens (prompt + the sampled one), then samples again.
    out = step(core)
    assert scheduled(out) == {"A": (9, 1), "B": (9, 1)} and list(core.scheduler.waiting) == [c]
    core.scheduler.finish(a, "abort")
    out = step(core)
    assert scheduled(out) == {"B": (10, 1), "C": (0, 9)}
    assert c.num_computed_tokens == 9 and c.num_tokens == 10
    assert core.scheduler.num_preemptions == 1


# ---- fork and copy-on-write ------------------------------------------------------------------------

def test_fork_shares_every_block_and_the_first_write_copies_the_shared_last_block():
    core, mgr = make_core(num_blocks=16)
    a = make_seq("A", tokens(10, 100))  # blocks 0, 1 full; block 2 holds positions 8..9
    core.scheduler.add(a)
    step(core)
    free_before = mgr.num_free_blocks()

    child = fork(core, a, "A.1")
    child.token_ids[-1] = 777  # each fork draws its own first token from the shared logits
    ta = table_of(mgr, "A")
    assert table_of(mgr, "A.1") == ta
    assert [ref(mgr, blk) for blk in ta] == [2, 2, 2]
    assert mgr.num_free_blocks() == free_before  # sharing costs no block
    assert mgr.stats.forks == 1

    # Both now write position 10 into the shared block 2: the first writer gets a private copy.
    out = step(core)
    assert scheduled(out) == {"A": (10, 1), "A.1": (10, 1)}
    ta, tc = table_of(mgr, "A"), table_of(mgr, "A.1")
    assert [i for i in range(3) if ta[i] != tc[i]] == [2]
    assert out.block_copies == [(tc[2], ta[2])]  # the runner copies the original into A's new block
    assert [ref(mgr, blk) for blk in ta] == [2, 2, 1] and ref(mgr, tc[2]) == 1
    assert mgr.stats.cow_copies == 1

    # Block 2 is private to each now: later writes into it copy nothing.
    out = step(core)
    assert scheduled(out) == {"A": (11, 1), "A.1": (11, 1)}
    assert out.block_copies == []
    assert [ref(mgr, blk) for blk in table_of(mgr, "A")[:2]] == [2, 2]


# ---- freeing, eviction, revival ---------------------------------------------------------------------

def test_a_copy_queued_for_a_sequence_freed_in_the_same_step_is_dropped_with_it():
    # Copy-on-write queues (shared, private) for the runner; if the writer is preempted or
    # aborted before the step runs, its private block goes back to the pool and may already be
    # another sequence's: the copy must not reach the runner.
    core, mgr = make_core(num_blocks=16)
    a = make_seq("A", tokens(10, 100))
    core.scheduler.add(a)
    step(core)
    fork(core, a, "A.1")
    assert mgr.allocate_slots("A", 10, 1)  # A writes into the shared block 2: copy queued
    assert len(mgr.pending_copies) == 1
    private = mgr.pending_copies[0][1]
    assert private in table_of(mgr, "A")
    mgr.free("A")
    assert mgr.pending_copies == []
    assert ref(mgr, private) == 0


def test_free_returns_blocks_tail_first_so_eviction_takes_a_chains_tail_first():
    log = EventLog()
    core, mgr = make_core(num_blocks=7, events=log)
    a = make_seq("A", tokens(12, 100))
    core.scheduler.add(a)
    step(core)
    ta = table_of(mgr, "A")
    core.scheduler.finish(a, "abort")
    assert released_by(log, "A") == ta[::-1]
    assert mgr.pool.num_cached_free() == 3 and mgr.num_free_blocks() == 7

    # B needs 5 blocks: the 4 never-used ones first, then one cached block, which must be the
    # tail of A's chain. C needs 1 more: the next from the tail. A's head survives, so a later
    # request with A's opening can still hit it.
    core.scheduler.add(make_seq("B", tokens(20, 200)))
    core.scheduler.add(make_seq("C", tokens(4, 300)))

    def admitted(out: StepPlan) -> None:  # before B's and C's writes publish the reused blocks
        tb, tc = table_of(mgr, "B"), table_of(mgr, "C")
        assert not set(tb[:4]) & set(ta)
        assert tb[4] == ta[2] and tc == [ta[1]]
        assert mgr.pool.num_evictions == 2
        assert published(mgr, ta[0]) and mgr.pool.is_free(ta[0])
        assert not published(mgr, ta[1]) and not published(mgr, ta[2])

    step(core, during=admitted)


def test_freed_blocks_keep_their_hash_and_a_later_hit_revives_them():
    core, mgr = make_core(num_blocks=8)
    p = tokens(12, 100)
    a = make_seq("A", p)
    core.scheduler.add(a)
    step(core)
    ta = table_of(mgr, "A")
    core.scheduler.finish(a, "stop")
    assert mgr.num_free_blocks() == 8 and all(ref(mgr, blk) == 0 and published(mgr, blk) for blk in ta)

    b = make_seq("B", p + [99])
    core.scheduler.add(b)
    assert scheduled(step(core)) == {"B": (12, 1)}
    tb = table_of(mgr, "B")
    assert tb[:3] == ta and tb[3] not in ta
    assert [ref(mgr, blk) for blk in ta] == [1, 1, 1]
    assert mgr.num_free_blocks() == 8 - 4
    assert mgr.pool.num_evictions == 0 and b.num_cached_tokens == 12


# ---- bounded KV: sliding windows ------------------------------------------------------------------------

WINDOW = 8  # tokens: a query at t sees keys t-7..t


def test_sliding_window_releases_blocks_no_later_query_sees_keeping_index_meaning():
    policy = SlidingWindow((WINDOW,), BS)
    core, mgr = make_core(num_blocks=16, policy=policy)
    a = make_seq("A", tokens(8, 100), max_tokens=32)
    core.scheduler.add(a)

    first_id: dict[int, int] = {}  # table index -> the block that first held it
    released_ever = []
    held_per_step = []

    def planned(out: StepPlan) -> None:  # the table as this step's queries will read it
        start = scheduled(out)["A"][0]
        t = table_of(mgr, "A")
        # Index i still means positions [4i, 4i+4): the table grows with the text.
        assert len(t) == -(-(start + scheduled(out)["A"][1]) // BS)
        # A block is gone exactly when its newest key is out of the window of this step's
        # first query (later queries see even less of the past).
        unseen = [i for i in range(len(t)) if start - (i * BS + BS - 1) >= WINDOW]
        assert [i for i, blk in enumerate(t) if blk is None] == unseen, (start, t)
        for i, blk in enumerate(t):
            if blk is not None:
                assert first_id.setdefault(i, blk) == blk  # a kept block never moves
            elif i in first_id and first_id[i] not in released_ever:
                released_ever.append(first_id[i])
        held = sum(blk is not None for blk in t)
        held_per_step.append(held)
        assert mgr.num_free_blocks() == 16 - held  # released blocks are back in the pool

    for _ in range(30):
        step(core, during=planned)
    max_held = max(held_per_step)
    assert a.num_computed_tokens == 8 + 29
    # At most the blocks reaching into the window plus the one being written: ceil(8/4) + 1.
    assert max_held == 3
    assert len(released_ever) == 7  # blocks 0..6: their last key, 4i+3 <= 28, is out of the window at 36
    # Released through the pool: unreferenced, free, and (prefix blocks) still hashed for reuse.
    assert all(ref(mgr, blk) == 0 and mgr.pool.is_free(blk) for blk in released_ever)
    assert published(mgr, released_ever[0])


def test_a_global_layer_keeps_every_block():
    # One layer without a window sees the whole past: nothing can be released.
    core, mgr = make_core(num_blocks=16, policy=SlidingWindow((WINDOW, None), BS))
    a = make_seq("A", tokens(8, 100), max_tokens=32)
    core.scheduler.add(a)
    run_until(core, a, 30)
    t = table_of(mgr, "A")
    assert None not in t and len(t) == -(-30 // BS)


def test_sliding_window_prefix_hits_nobody_reads_are_not_revived():
    core, mgr = make_core(num_blocks=16, policy=SlidingWindow((WINDOW,), BS))
    p = tokens(16, 100)
    a = make_seq("A", p)
    core.scheduler.add(a)
    step(core)
    ta = table_of(mgr, "A")
    core.scheduler.finish(a, "stop")

    # B continues from position 16: blocks 0 and 1 (positions 0..7) are outside its window.
    core.scheduler.add(make_seq("B", p + [99]))
    assert scheduled(step(core)) == {"B": (16, 1)}
    tb = table_of(mgr, "B")
    assert tb[:4] == [None, None, ta[2], ta[3]]
    assert ref(mgr, ta[0]) == 0 and ref(mgr, ta[1]) == 0  # left in the free queue, still cached
    assert mgr.pool.is_free(ta[0]) and published(mgr, ta[0])
    assert mgr.num_free_blocks() == 16 - 3


# ---- bounded KV: attention sinks ---------------------------------------------------------------------------

SINK_TOKENS = 2


def test_sinks_keep_block_0_release_the_middle_and_rerotate_the_kept_keys():
    policy = SinkWindow(sink_tokens=SINK_TOKENS, window_tokens=WINDOW, block_size=BS, max_positions=64,
                        num_layers=1)
    core, mgr = make_core(num_blocks=16, policy=policy)
    a = make_seq("A", tokens(8, 100), max_tokens=32)
    core.scheduler.add(a)
    outs = {}
    tables = {}

    def planned(out: StepPlan) -> None:  # the table as this step's queries will read it
        start = scheduled(out)["A"][0]
        outs[start], tables[start] = out, table_of(mgr, "A")

    for _ in range(30):
        step(core, during=planned)
    b0, b1 = tables[0]
    assert published(mgr, b0) and published(mgr, b1)  # computed before any masking

    # Block 0 holds the sinks: kept for good, never rotated (sinks stay at cache positions 0, 1).
    assert all(t[0] == b0 for t in tables.values())
    assert all(b0 not in ids for out in outs.values() for _, ids, _ in out.rotations)

    # Query 11 is the first whose window (4..11) leaves block 0's non-sink tail (2, 3) behind:
    # the kept keys move back 2 positions. Block 1 is published, so it is never changed in
    # place: the step copies it first and rotates the copy.
    out, t = outs[11], tables[11]
    assert t[1] != b1 and out.block_copies == [(b1, t[1])]
    assert out.rotations == [("A", [t[1], t[2]], -(BS - SINK_TOKENS))]
    assert ref(mgr, b1) == 0 and published(mgr, b1)  # the cached original is intact

    # Query 15's window (8..15) leaves block 1 behind: it is released, and the window moves one
    # whole block back. From here on every new block in the window means one more shift by -4.
    out, t = outs[15], tables[15]
    assert t[:2] == [b0, None]
    assert out.block_copies == [] and out.rotations == [("A", [t[2], t[3]], -BS)]
    rotated_at = sorted(s for s, o in outs.items() if o.rotations)
    assert rotated_at == [11, 15, 19, 23, 27, 31, 35]
    assert all(outs[s].rotations[0][2] == -BS for s in rotated_at[1:])

    last = max(tables)
    t = tables[last]
    middle = [i for i in range(1, len(t)) if i * BS + BS - 1 <= last - WINDOW]
    assert [i for i, blk in enumerate(t) if blk is None] == middle
    assert sum(blk is not None for blk in t) <= policy.decode_blocks
    # Only blocks whose queries all ran before any masking are ever published (blocks 0, 1).
    assert not any(published(mgr, blk) for blk in t[1:] if blk is not None)


# ---- the whole pool -----------------------------------------------------------------------------------------

def test_pool_is_whole_when_idle_after_a_mixed_workload():
    core, mgr = make_core(num_blocks=10, budget=16)
    common = tokens(8, 100)  # two shared blocks
    seqs = [make_seq(f"S{i}", common + tokens(2, 200 + 10 * i), max_tokens=8) for i in range(5)]
    for s in seqs:
        core.scheduler.add(s)
    forked = None
    checked_busy = False
    for _ in range(300):
        if not core.scheduler.has_work():
            break
        out = step(core)
        if not checked_busy and out.chunks:
            with pytest.raises(BlockPoolError):
                mgr.assert_idle_whole()  # it does see held blocks
            checked_busy = True
        if forked is None and seqs[0].status is SeqStatus.RUNNING and seqs[0].num_output_tokens == 1:
            forked = fork(core, seqs[0], "S0.1")
            forked.token_ids[-1] = 777
    assert not core.scheduler.has_work()
    assert forked is not None and forked.is_finished and all(s.is_finished for s in seqs)
    assert core.scheduler.num_preemptions > 0 and mgr.stats.hits > 0 and mgr.stats.cow_copies > 0
    mgr.assert_idle_whole()
    assert mgr.num_free_blocks() == 10
