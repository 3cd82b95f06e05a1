"""Continuous batching under one token budget per step.

Order within a step: running decodes (one token each, so decode is never starved), then
running requests still in chunked prefill, then waiting requests FCFS. When the pool runs out
of blocks, the most recently admitted running sequence is preempted: its blocks go back through
the manager's one release path and it is recomputed later from its tokens so far.

Under --scheduling-policy priority (vLLM's) the waiting queue is kept in (priority, arrival)
order, the running sequence with the largest (priority, arrival) is the one preempted, and a
waiting request that does not fit preempts running ones of a strictly larger priority value.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvshare.config import EngineConfig
from kvshare.engine.request import Sequence, SeqStatus
from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan
from kvshare.kvcache.interface import KVCore


@dataclass
class _Chunk:
    """A scheduling decision before it becomes a ChunkPlan: compute [start, start + num_tokens)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, manager: KVCore) -> None:
        self.config = config
        self.manager = manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order; the tail is preempted first
        self.num_preemptions = 0
        self.by_priority = config.scheduling_policy == "priority"
        # The last plan's sequences by id: the plan names them by id only (it is plain data),
        # and step_done and the engine's sampling act on these records.
        self.scheduled_seqs: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def _queue(self, seq: Sequence) -> None:
        """Into the waiting queue in (priority, arrival) order, after its equals (FCFS among them)."""
        key = _rank(seq)
        at = next((i for i, w in enumerate(self.waiting) if _rank(w) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def _victim(self) -> Sequence:
        return max(self.running, key=_rank) if self.by_priority else self.running[-1]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        out = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, _Chunk] = {}

        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk_size(seq, seq.num_computed_tokens, budget)
            # Blocks that fell out of the window go back first: they may be what makes room.
            while not (self.manager.slide(seq.seq_id, seq.num_computed_tokens)
                       and self.manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)):
                victim = self._victim()
                undone = scheduled.pop(victim.seq_id, None)
                if undone is not None:
                    budget += undone.num_tokens
                self.preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = _Chunk(seq, seq.num_computed_tokens, num_new)
                budget -= num_new

        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            budget = self._admit_waiting(budget, scheduled, out.preempted)

        out.block_copies = self.manager.take_pending_copies()
        out.rotations = self.manager.take_pending_rotations()
        if scheduled:  # no forward, no transfers: they wait for the next step that runs one
            out.block_stores, out.block_loads, out.tier_drops = self.manager.take_tier_transfers()
        self.scheduled_seqs = {c.seq.seq_id: c.seq for c in scheduled.values()}
        plans = [self._plan(c) for c in scheduled.values()]
        # Decode rows by how many blocks they read (rows of one padded width are adjacent), then prefills.
        decode = sorted((p for p in plans if p.is_decode), key=lambda p: (p.blocks_read, p.start))
        out.chunks = decode + [p for p in plans if not p.is_decode]
        return out

    def _plan(self, c: _Chunk) -> ChunkPlan:
        """What the model computes, reads and writes for this chunk (after this step's copies)."""
        mgr, seq = self.manager, c.seq
        prompt_logits = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done():
            first = max(c.start, len(seq.prompt_logprobs) - 1)  # entry 0 (the first prompt token) is None
            last = min(c.end, seq.num_prompt_tokens - 1)  # exclusive: position p predicts p + 1
            if last > first:
                prompt_logits = (first, last - first)
        return ChunkPlan(
            seq_id=seq.seq_id, start=c.start, token_ids=seq.token_ids[c.start:c.end],
            rope_start=c.start - mgr.rope_offset(seq.seq_id),
            kv=tuple(GroupAccess(*a) for a in mgr.access_by_group(seq.seq_id, c.start, c.end)),
            samples=c.end == seq.num_tokens, prompt_logits=prompt_logits, adapter=seq.namespace.adapter)

    def step_done(self, plan: StepPlan) -> None:
        """After the forward pass: the chunks' KV is written, so their full blocks are published."""
        for c in plan.chunks:
            seq = self.scheduled_seqs[c.seq_id]
            seq.num_computed_tokens = c.end
            self.manager.publish_full_blocks(c.seq_id, seq.token_ids, c.end)
            self.manager.release_behind(c.seq_id, c.end)

    def _chunk_size(self, seq: Sequence, start: int, budget: int) -> int:
        num_new = min(seq.num_tokens - start, budget)
        limit = self.manager.chunk_limit(start)  # e.g. sinks: RoPE positions left
        return num_new if limit is None else min(num_new, limit)

    def _peak_blocks(self, seq: Sequence) -> int | None:
        """Most blocks `seq` can hold from now on under a bounded-KV policy (None: unbounded)."""
        decoding = seq.status is SeqStatus.RUNNING and seq.num_computed_tokens >= seq.num_tokens - 1
        total = max(seq.num_tokens, seq.num_prompt_tokens + (seq.params.max_tokens or 0))
        return self.manager.peak_blocks(decoding, self.config.max_num_batched_tokens, total)

    def _room_to_peak(self, seq: Sequence, cached: list) -> bool:
        """With bounded KV, admit only while every running sequence can still grow to its peak
        and the new one to its own: otherwise a later prefill chunk finds no room, preempts,
        and the recomputed prompt does the same again (thrash)."""
        peak = self._peak_blocks(seq)
        if peak is None:
            return True
        mgr = self.manager
        reserve = sum(max(0, (self._peak_blocks(s) or 0) - mgr.num_held_blocks(s.seq_id)) for s in self.running)
        shared = sum(1 for b in cached if b is not None and b.ref_count > 0)  # held already: no new block
        return peak - shared <= mgr.num_free_blocks() - reserve

    def _admit_waiting(self, budget: int, scheduled: dict[str, _Chunk], preempted: list[str]) -> int:
        mgr = self.manager
        # Blocks being computed this step are not hits yet (their KV is unwritten). A request
        # that would compute one of them again waits a step and then hits the cache instead.
        inflight: set[bytes] = set()
        for c in scheduled.values():
            inflight.update(mgr.hashes_completed_by(c.seq.seq_id, c.seq.token_ids, c.start, c.end))
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.pending_forks > self.config.max_num_seqs:  # forks need seats too
                if self._preempt_for(seq, scheduled, preempted):
                    budget = self._budget_left(scheduled)
                    continue
                break
            # prompt_logprobs need logits for every prompt position, so such requests compute
            # their whole prompt (they still publish their blocks for others).
            uses_cache = seq.prompt_logprobs is None or seq.prompt_logprobs_done()
            plan = mgr.plan_admission(seq.seq_id, seq.token_ids, seq.namespace, budget,
                                      use_cache=uses_cache, inflight=inflight)
            if plan.refusal is not None or not self._room_to_peak(seq, plan.hits):
                if (plan.refusal is None or plan.short_of_blocks) and self._preempt_for(seq, scheduled, preempted):
                    budget = self._budget_left(scheduled)
                    continue
                break  # nobody overtakes the head of the queue (FCFS, or the most important under priority)
            self.waiting.popleft()
            mgr.commit_admission(plan)
            seq.num_computed_tokens = plan.num_computed
            if not seq.admitted_once:
                seq.num_cached_tokens = plan.num_computed
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunk = _Chunk(seq, plan.num_computed, plan.num_new)
            scheduled[seq.seq_id] = chunk
            inflight.update(mgr.hashes_completed_by(seq.seq_id, seq.token_ids, chunk.start, chunk.end))
            budget -= plan.num_new
        return budget

    def _budget_left(self, scheduled: dict[str, _Chunk]) -> int:
        """The step's token budget left after what is scheduled (a preemption gives its chunk back)."""
        return self.config.max_num_batched_tokens - sum(c.num_tokens for c in scheduled.values())

    def _preempt_for(self, seq: Sequence, scheduled: dict[str, _Chunk], preempted: list[str]) -> bool:
        """Priority policy: make room for `seq` by preempting the least important running
        sequence, if it is strictly less important (equal priorities never preempt each other:
        that would only thrash). False: nothing to preempt."""
        if not self.by_priority or not self.running:
            return False
        victim = self._victim()
        if victim.params.priority <= seq.params.priority:
            return False
        scheduled.pop(victim.seq_id, None)
        self.preempt(victim)
        preempted.append(victim.seq_id)
        return True

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """A fork shares its parent's blocks and progress: it is running from birth."""
        self.manager.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.admitted_once = True
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    def preempt(self, seq: Sequence) -> None:
        self.manager.events.record("preempt", seq=seq.seq_id)
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._queue(seq)  # behind more important waiting requests
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Finish (or abort) a sequence wherever it is; a second call is a no-op."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.manager.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason


def _rank(seq: Sequence) -> tuple[int, float]:
    """Priority policy order: lower first, then earlier arrival (vLLM's (priority, arrival_time))."""
    return seq.params.priority, seq.arrival_time
