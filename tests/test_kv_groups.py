"""Hybrid KV cache groups (issue 13 part 3), model-free: the scheduler and the grouped manager
driven with fake sequences, every block event fed to the isolation checker as it happens and
every step's reads and writes (one access per group) logged before the step is "run".

Rules checked: layers are grouped by attention type into groups of equal size; a window group
releases the blocks its window has passed during prefill and decode (at most ceil(W / B) + 1
blocks after each step), a global group keeps all; a prefix hit needs the global chain and only
the last window of each window group (evicted early window blocks are no obstacle, a missing
block inside the window is); forks share every group's blocks and the first write copies in
each group; growth is all groups or none; abort and preemption storms leave the pool whole."""
from __future__ import annotations

import random

import pytest

import fake_engine
from kvshare.config import EngineConfig
from kvshare.engine.request import Sequence, SeqStatus
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.isolation import IsolationChecker
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import blocks_per_seq, plan_kv_groups
from kvshare.sampling_params import SamplingParams

BS = 4
W = 8  # window of the local layers: 2 blocks, so a decoding local group holds at most 3
LOCAL_BOUND = -(-W // BS) + 1
WINDOWS = [W, None, W, W]  # 3 local : 1 global -> groups of 1 layer: 1 global, 3 local


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 8, salt: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, token_ids=list(prompt),
                    num_prompt_tokens=len(prompt), params=SamplingParams(max_tokens=max_tokens, cache_salt=salt))


class Harness:
    """A grouped manager + scheduler (a model-free EngineCore) whose every event goes through the
    isolation checker."""

    def __init__(self, num_blocks: int, budget: int = 8, max_seqs: int = 8, windows=WINDOWS) -> None:
        config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs, dtype="float32")
        self.groups = plan_kv_groups(windows, BS)
        self.log = EventLog()
        self.checker = IsolationChecker(BS)
        self.log.listener = self.checker.feed
        self.mgr = KVCacheCoordinator(num_blocks, BS, self.groups, events=self.log)
        self.mgr.pool.events = self.log
        self.core = fake_engine.model_free_core(config, self.mgr)
        self.sched = self.core.scheduler

    def step(self) -> list[Sequence]:
        """The engine's step: plan, log the step's I/O, "run" it, append fake tokens, finish at
        max_tokens."""
        done = fake_engine.step(self.core)
        self.checker.checkpoint()
        return done

    def held(self, seq_id: str, group: int) -> int:
        return self.mgr.num_held_blocks(seq_id, group)

    def local_groups(self) -> list[int]:
        return [g for g, grp in enumerate(self.groups) if grp.window is not None]


def tokens(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def test_layers_group_by_attention_type_into_equal_groups_global_first():
    gemma = [512] * 5 + [None]
    groups = plan_kv_groups(gemma * 3, 16)  # Gemma 3 270M: 18 layers, 15 local, 3 global
    assert [g.size for g in groups] == [3] * 6  # gcd(15, 3): every block holds 3 layers
    assert groups[0].window is None and groups[0].layers == (5, 11, 17)
    assert [g.window for g in groups[1:]] == [512] * 5
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))
    assert [(g.layers, g.window) for g in plan_kv_groups([None] * 4, 16)] == [((0, 1, 2, 3), None)]  # one type
    assert [(g.layers, g.window) for g in plan_kv_groups([16] * 4, 16)] == [((0, 1, 2, 3), 16)]
    assert [g.layers for g in plan_kv_groups([None, 16], 4)] == [(0,), (1,)]
    # A sequence's blocks: the global group all of them, each local group its window + 1.
    assert blocks_per_seq(groups, 16, 32768) == 2048 + 5 * (512 // 16 + 1)


def test_window_groups_hold_their_window_after_every_step_of_prefill_and_decode():
    h = Harness(num_blocks=64, budget=6)
    seq = make_seq("A", tokens(20, 0), max_tokens=8 * W)  # 84 tokens: 10 windows
    h.sched.add(seq)
    most_local = 0
    while not seq.is_finished:
        h.step()
        if seq.is_finished:
            break
        n = seq.num_computed_tokens
        assert h.held("A", 0) == -(-n // BS), "the global group keeps every block"
        for g in h.local_groups():
            held = h.held("A", g)
            # After the step: blocks holding any of the last W positions, nothing older.
            assert held <= LOCAL_BOUND, f"group {g} holds {held} blocks at {n} computed tokens"
            first_needed = max(0, n - W + 1) // BS
            table = h.mgr.block_ids("A", g)
            assert all(b is None for b in table[:first_needed]) and all(b is not None for b in table[first_needed:])
            most_local = max(most_local, held)
    assert most_local == LOCAL_BOUND
    h.mgr.assert_idle_whole()


def test_a_long_prefill_chunk_releases_its_early_window_blocks_right_after_its_step():
    h = Harness(num_blocks=64, budget=64)
    seq = make_seq("A", tokens(40, 0), max_tokens=4)
    h.sched.add(seq)
    out = fake_engine.run_step(h.core)
    # During the one-chunk prefill every group needs all 10 blocks (the chunk's queries read them).
    assert [len(c.kv) for c in out.chunks] == [4] and [len(a.read_blocks) for a in out.chunks[0].kv] == [10] * 4
    for g in h.local_groups():
        assert h.held("A", g) <= LOCAL_BOUND
    assert h.mgr.num_used_blocks() == 10 + 3 * (40 // BS - (40 - W + 1) // BS)


def run_to_end(h: Harness, *seqs: Sequence, max_steps: int = 500) -> None:
    for s in seqs:
        h.sched.add(s)
    for _ in range(max_steps):
        if not h.sched.has_work():
            return
        h.step()
    raise AssertionError("did not finish")


def test_prefix_hit_needs_the_global_chain_and_only_the_last_window_of_local_groups():
    # 44 blocks: exactly what A allocates (11 per group), so after A every block is A's.
    h = Harness(num_blocks=44, budget=8)
    prompt = tokens(41, 0)  # 10 full blocks; the hit stops at 40 (the last token is computed)
    a = make_seq("A", prompt, max_tokens=1)
    h.sched.add(a)
    first_ids: dict[tuple[int, int], int] = {}  # (group, table index) -> the block A had there
    while not a.is_finished:
        h.step()
        for g in range(len(h.groups)):
            for i, bid in enumerate(h.mgr.block_ids("A", g)):
                if bid is not None:
                    first_ids.setdefault((g, i), bid)
    # The local groups released blocks 0..7 while A ran: they are the least recently freed, so
    # an unrelated request's allocations evict them (its first blocks are the uncached ones).
    run_to_end(h, make_seq("F", tokens(13, 500), max_tokens=1))
    pool = h.mgr.pool
    for g in h.local_groups():
        for i in range(3):
            assert pool.blocks[first_ids[(g, i)]].token_ids != tuple(prompt[i * BS:(i + 1) * BS]), \
                f"group {g} block {i} should have been evicted"

    b = make_seq("B", prompt, max_tokens=3)
    h.sched.add(b)
    h.step()
    assert b.num_cached_tokens == 40, "local groups need only the blocks of the last window before 40"
    first_needed = (40 - W + 1) // BS
    for g in h.local_groups():
        table = h.mgr.block_ids("B", g)
        assert table[:first_needed] == [None] * first_needed
        assert table[first_needed:10] == [first_ids[(g, i)] for i in range(first_needed, 10)]  # A's, revived
    assert h.mgr.block_ids("B", 0)[:10] == [first_ids[(0, i)] for i in range(10)]
    run_to_end(h)
    h.checker.finish()
    h.mgr.assert_idle_whole()


def test_a_missing_block_inside_a_local_window_shortens_the_hit():
    h = Harness(num_blocks=200, budget=8)
    prompt = tokens(41, 0)
    a = make_seq("A", prompt, max_tokens=1)
    h.sched.add(a)
    local = h.local_groups()[0]
    window_block = None
    while not a.is_finished:
        h.step()
        table = h.mgr.block_ids("A", local)
        if len(table) > 9 and table[8] is not None:
            window_block = table[8]  # inside the last window before position 40 (blocks 8, 9)
    pool = h.mgr.pool
    assert pool.blocks[window_block].block_hash is not None
    # Evict exactly that block: what a pool under pressure does to the least recently freed.
    pool.evict(pool.blocks[window_block])
    b = make_seq("B", prompt, max_tokens=3)
    h.sched.add(b)
    h.step()
    # Hits of n blocks need blocks [(4n - 7) // 4, n) in that group: with block 8 gone, n <= 8.
    assert b.num_cached_tokens == 8 * BS
    run_to_end(h)
    h.mgr.assert_idle_whole()


def test_fork_shares_every_groups_blocks_and_the_first_write_copies_in_each_group():
    h = Harness(num_blocks=60, budget=16)
    parent = make_seq("A", tokens(10, 0), max_tokens=6)
    h.sched.add(parent)
    h.step()  # prefill of 10 tokens: position 10 starts in block 2, which is half full
    child = Sequence(seq_id="A.1", request_id="A", index=1, token_ids=list(parent.token_ids),
                     num_prompt_tokens=parent.num_prompt_tokens, params=parent.params)
    h.sched.add_forked(parent, child)
    for g in range(len(h.groups)):
        assert h.mgr.block_ids("A.1", g) == h.mgr.block_ids("A", g)
        for bid in h.mgr.block_ids("A", g):
            if bid is not None:
                assert h.mgr.pool.blocks[bid].ref_count == 2
    out = fake_engine.run_step(h.core)
    assert len(out.block_copies) == len(h.groups)  # one copy-on-write in every group's shared last block
    h.checker.checkpoint()
    for g in range(len(h.groups)):
        assert h.mgr.block_ids("A.1", g)[-1] != h.mgr.block_ids("A", g)[-1]
    for s in (parent, child):
        h.sched.finish(s, "abort")
    h.mgr.assert_idle_whole()


def test_growth_takes_blocks_in_every_group_or_in_none():
    h = Harness(num_blocks=4, budget=8)
    seq = make_seq("A", tokens(3, 0), max_tokens=8)
    h.sched.add(seq)
    h.step()  # 4 groups x 1 block: the pool is full
    assert h.mgr.num_free_blocks() == 0
    tables_before = [h.mgr.block_ids("A", g) for g in range(4)]
    assert not h.mgr.allocate_slots("A", 4, 1)  # needs a 2nd block in each group: none changed
    assert [h.mgr.block_ids("A", g) for g in range(4)] == tables_before
    h.sched.finish(seq, "abort")
    h.mgr.assert_idle_whole()


@pytest.mark.parametrize("seed", [0, 1])
def test_abort_and_preemption_storms_leave_the_pool_whole(seed):
    rng = random.Random(seed)
    h = Harness(num_blocks=30, budget=12, max_seqs=6)
    common = tokens(12, 0)  # a shared prefix: hits, shared blocks, copy-on-write after forks
    seqs = []
    for i in range(14):
        prompt = (common if i % 2 else []) + tokens(rng.randint(2, 14), 100 * (i + 1))
        seqs.append(make_seq(f"S{i}", prompt, max_tokens=rng.randint(4, 24)))
        h.sched.add(seqs[-1])
    forks = 0
    for _ in range(600):
        if not h.sched.has_work():
            break
        h.step()
        running = [s for s in h.sched.running if s.num_output_tokens]
        if running and rng.random() < 0.15:
            victim = rng.choice(running)
            h.log.record("abort", seq=victim.seq_id)
            h.sched.finish(victim, "abort")
            h.checker.checkpoint()
        elif running and forks < 3 and rng.random() < 0.1 and len(h.sched.running) < 6:
            parent = rng.choice(running)
            child = Sequence(seq_id=f"{parent.seq_id}.f{forks}", request_id=parent.request_id, index=1,
                             token_ids=list(parent.token_ids), num_prompt_tokens=parent.num_prompt_tokens,
                             params=parent.params)
            h.sched.add_forked(parent, child)
            forks += 1
    assert not h.sched.has_work()
    assert h.sched.num_preemptions > 0, "the storm should have preempted"
    h.checker.finish()
    h.mgr.assert_idle_whole()
    assert h.mgr.num_free_blocks() == 30
    assert all(s.status is SeqStatus.FINISHED for s in seqs)


def test_the_memory_plan_sizes_groups_and_fits_over_4x_more_32k_gemma3_sequences():
    from kvshare.memory_plan import PlanConfig, plan_memory
    from kvshare.model.config import ModelArchConfig

    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # Gemma 3 270M: 5 local : 1 global
    arch = ModelArchConfig(architecture="qwen2", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                           num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
                           sliding_window=512, layer_windows=windows)
    plans = {grouped: plan_memory(arch, PlanConfig(memory="8GiB", dtype="bfloat16", kv_dtype="bfloat16",
                                                   max_model_len=32768, kv_cache_groups=grouped)).plan
             for grouped in (True, False)}
    on, off = plans[True], plans[False]
    assert off.kv_bytes_per_token == 18 * 2 * 256 * 2 and on.kv_bytes_per_token == 3 * 2 * 256 * 2
    assert on.num_kv_groups == 6 and off.num_kv_groups == 1 and not off.kv_groups
    by_window = {g["window"]: g for g in on.kv_groups}
    assert by_window[None] == {"window": None, "groups": 1, "layers": 3, "blocks_per_seq": 2048,
                               "bytes_per_seq": 2048 * 16 * on.kv_bytes_per_token}
    # Window groups: the window plus one prefill chunk of max_num_batched_tokens (2048), in blocks.
    assert by_window[512]["layers"] == 15 and by_window[512]["blocks_per_seq"] == 5 * ((512 + 2048 - 2) // 16 + 2)
    assert on.max_seqs_at_max_len >= 4 * off.max_seqs_at_max_len > 0
