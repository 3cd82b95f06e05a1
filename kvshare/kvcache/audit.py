"""Audit mode: prove, step by step, that no request can see or damage another's KV.

The invariants are decided by one state machine, IsolationChecker (kvshare/kvcache/isolation.py),
that rebuilds holders, tables, the free queue, tenants, publications and written slots from the
block event stream: the live auditor hands it each event as it is recorded, `kvshare audit
replay` a recorded file, so both name the same violation at the same step. The live auditor
also cross-checks, at the end of each step and after aborts, the real structures (pool, tables,
prefix cache, the step plan the runner executes) against what the checker derived, which
catches a mutation the event log missed; those findings carry the same invariant names.
Invariants:

  refcount_matches_tables   a block's ref count equals the number of tables holding it, and its
                            owner set names exactly those sequences. The prefix cache itself
                            holds no references: a cached block nobody uses has count 0 and
                            sits in the free queue, still hashed.
  free_xor_referenced       a block is in the free queue iff its count is 0; no count below 0;
                            in use + free uncached + free cached = total.
  salt_isolation            every holder of a block has the block's cache namespace (tenant
                            salt, adapter: kvshare/kvcache/cache_key.py).
  adapter_isolation         the same, for a holder whose LoRA adapter differs from the one the
                            block's KV was computed under (another adapter, or the base model).
  cached_block_matches_hash a cached block's hash recomputes from (parent hash, namespace, its
                            token ids), and a sequence holding it has those tokens at that
                            position; a prefix-cache hit is on a block published for reuse, under
                            its namespace.
  cached_block_written      a block published for reuse has KV in every slot.
  write_outside_own_blocks  each slot written this step is the slot of that token's position
                            in the writer's own table.
  write_into_shared_block   no write lands in a block with more than one holder.
  read_outside_own_blocks   the block table a sequence attends over is its own.
  read_unwritten_kv         every key slot a sequence reads holds KV written for this block.
  rewrite_of_cached_block   keys re-rotated in place (attention sinks) only in a block that the
                            rotating sequence alone holds and that is not published for reuse
                            (a shared one is written too: write_into_shared_block).

Tables of windowed sequences hold `None` where a block was released; only held blocks count.
With KV cache groups (kvshare/kvcache/kv_groups.py) a sequence has one table per group, a block
belongs to one group's tables, and every table and every group's access is checked the same way.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Mapping

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.isolation import IsolationChecker, Violation, namespace_violation


class AuditError(AssertionError):
    """An isolation invariant is broken: always a bug in kvshare, never bad user input."""

    def __init__(self, invariant: str, detail: str, block: int | None = None, owners: Iterable[str] = (),
                 step: int | None = None, events: list[dict] | None = None) -> None:
        self.invariant = invariant
        self.detail = detail
        self.block = block
        self.owners = sorted(owners)
        self.step = step
        self.events = events or []
        lines = [f"KV audit: invariant {invariant!r} violated at step {step}: {detail}"]
        if block is not None:
            lines.append(f"  block {block}, owners {self.owners}")
        for e in self.events:
            lines.append(f"  event {e}")
        super().__init__("\n".join(lines))

    def to_dict(self) -> dict:
        return {"invariant": self.invariant, "detail": self.detail, "block": self.block, "owners": self.owners,
                "step": self.step, "events": self.events}


class KVAuditor:
    def __init__(self, manager, events: EventLog, live_tokens: Callable[[], dict[str, list[int]]]) -> None:
        self.manager = manager
        self.pool = manager.pool
        self.events = events
        self.block_size = manager.block_size
        self.full_mask = (1 << self.block_size) - 1
        self._live_tokens = live_tokens
        # Built on an idle pool (set_audit), so the checker's empty start is the truth; the
        # log's "pool" event was recorded before this auditor existed.
        self.checker = IsolationChecker(manager.block_size)
        self.checker.step = events.step
        events.listener = self._observe

    @property
    def num_checks(self) -> int:
        return self.checker.num_checkpoints

    # ---- the checker, fed live ----------------------------------------------------------------
    def _observe(self, e: dict) -> None:
        try:
            self.checker.feed(e)  # looked up per event, so a benchmark can time the checker
        except Violation as v:
            raise self._error(v.invariant, v.detail, v.block, v.owners) from None

    def check_state(self) -> None:
        """A checkpoint (end of step, after an abort): the checker's structural rules, then the
        real structures against the checker's state."""
        try:
            self.checker.checkpoint()
        except Violation as v:
            raise self._error(v.invariant, v.detail, v.block, v.owners) from None
        self._cross_check_pool()
        self._cross_check_cached()
        self._cross_check_contents()

    # ---- reporting ------------------------------------------------------------------------
    def _error(self, invariant: str, detail: str, block: int | None, owners: Iterable[str] = ()) -> AuditError:
        holders = set(owners)
        if block is not None:
            holders |= self.pool.blocks[block].owners
            holders |= {s for tables in self.manager.group_tables for s, t in tables.items()
                        if any(b is not None and b.block_id == block for b in t)}
        self.events.flush()
        return AuditError(invariant, detail, block, holders, self.checker.step,
                          self.events.touching(block) if block is not None else [])

    # ---- cross-checks of the real structures --------------------------------------------------
    def _cross_check_pool(self) -> None:
        ck, pool = self.checker, self.pool
        held: Counter[int] = Counter()
        in_tables: dict[int, set[str]] = {}
        for tables in self.manager.group_tables:  # a block is in one KV cache group's tables
            for seq_id, table in tables.items():
                for b in table:
                    if b is not None:
                        held[b.block_id] += 1
                        in_tables.setdefault(b.block_id, set()).add(seq_id)
        namespaces = self.manager.namespaces
        none: set[str] = set()
        for b in pool.blocks:  # by block id, so the lowest broken block is the one reported
            bid = b.block_id
            model: Mapping[str, int] = ck.holders.get(bid) or {}
            mine = in_tables.get(bid, none)
            if b.ref_count < 0:
                raise self._error("free_xor_referenced", f"reference count {b.ref_count} is below zero", bid)
            if b.ref_count != held[bid] or b.owners != mine or b.owners != model.keys() \
                    or b.ref_count != sum(model.values()) or mine != ck.tables.get(bid, none):
                raise self._error("refcount_matches_tables", f"reference count {b.ref_count} (owners "
                                  f"{sorted(b.owners)}), held by {held[bid]} table(s) {sorted(mine)}; the event "
                                  f"log says references {dict(model)}, tables {sorted(ck.tables.get(bid, none))}",
                                  bid)
            free = pool.is_free(bid)
            if free != (b.ref_count == 0) or free == (bid in ck.busy):
                raise self._error("free_xor_referenced", f"block is {'free' if free else 'not free'} with "
                                  f"reference count {b.ref_count}; the event log has it "
                                  f"{'out of' if bid in ck.busy else 'in'} the free queue", bid)
            if b.ref_count:
                foreign = sorted(s for s in mine if namespaces.get(s, DEFAULT_NAMESPACE) != b.namespace)
                logged = ck.block_namespace.get(bid, DEFAULT_NAMESPACE)
                if foreign or logged != b.namespace:
                    mine_ns = namespaces.get(foreign[0], DEFAULT_NAMESPACE) if foreign else logged
                    raise self._error(namespace_violation(mine_ns, b.namespace), f"holder(s) {foreign} have "
                                      f"{namespaces.get(foreign[0]) if foreign else None!r}, the block's data belongs "
                                      f"to {b.namespace!r} (the event log says {logged!r})", bid, foreign)
        if pool.num_free != pool.num_blocks - len(ck.busy):
            raise self._error("free_xor_referenced", f"free queue holds {pool.num_free} of {pool.num_blocks} blocks, "
                                                     f"the event log says {pool.num_blocks - len(ck.busy)}", None)

    def _cross_check_cached(self) -> None:
        """Each cached block's hash recomputes from its stored (parent hash, namespace, token ids), and
        the checker saw KV written into every slot of it."""
        extra = BlockHasher.extra_keys
        hasher = self.manager.hasher
        written = self.checker.written
        for h, bid in self.pool.cached.items():
            b = self.pool.blocks[bid]
            if b.block_hash != h or hasher.hash_block(b.parent_hash, b.token_ids, extra(b.namespace)) != h:
                raise self._error("cached_block_matches_hash", "stored token ids / namespace do not produce the "
                                                               "block's hash", bid)
            if written.get(bid, 0) != self.full_mask:
                mask = bin(written.get(bid, 0))[2:].zfill(self.block_size)[::-1]
                raise self._error("cached_block_written", f"published for reuse with written slots {mask}", bid)

    def _cross_check_contents(self) -> None:
        """A sequence holding a cached block has the block's tokens at that position."""
        bs = self.block_size
        live = self._live_tokens()
        for tables in self.manager.group_tables:
            for seq_id, table in tables.items():
                tokens = live.get(seq_id)
                if tokens is None:
                    continue
                for i, b in enumerate(table):
                    if b is not None and b.token_ids is not None and (i + 1) * bs <= len(tokens) and \
                            tuple(tokens[i * bs:(i + 1) * bs]) != b.token_ids:
                        raise self._error("cached_block_matches_hash", f"sequence {seq_id} holds it at index {i}, "
                                                                       f"but its tokens there differ", b.block_id,
                                          [seq_id])

    def check_io(self, plan) -> None:
        """After the checker passed the step's reads and writes: the block tables the step plan
        reads are the sequences' real tables, index by index (the checker verified the writes
        against these tables and that each block is one the reader holds)."""
        group_tables = self.manager.group_tables
        for g, tables in enumerate(group_tables):  # each KV cache group against its own tables
            group = f" (KV cache group {g})"
            for c in plan.chunks:
                seq_id = c.seq_id
                table = tables.get(seq_id, [])
                a = c.access(g)
                at = a.read_index if a.read_index is not None else range(len(a.read_blocks))
                for i, bid in zip(at, a.read_blocks):
                    b = table[i] if i < len(table) else None
                    if b is None or b.block_id != bid:
                        raise self._error("read_outside_own_blocks", f"{seq_id} attends over block {bid} at index "
                                          f"{i}{group}; its table has {getattr(b, 'block_id', None)} there", bid,
                                          [seq_id])


def record_step_io(events, auditor: KVAuditor | None, plan) -> None:
    """The engine's one hook before a forward pass: log exactly what the step plan says the model
    will read and write. `plan` is a StepPlan (kvshare/engine/step_plan.py): what the runner
    executes is exactly what is logged. In audit mode the checker, listening to the log, checks
    the copies and rotations as they are recorded and the writes and reads at "forward"."""
    if not events.enabled:
        return
    for src, dst in plan.block_copies:
        events.record("copy", src=src, dst=dst)
    for seq_id, block_ids, shift in plan.rotations:
        events.record("rotate", seq=seq_id, blocks=block_ids, shift=shift)
    for c in plan.chunks:
        for g, a in enumerate(c.kv):  # one access per KV cache group's table
            fields = {"group": g} if a.read_index is None else {"group": g, "index": a.read_index}
            events.record("access", seq=c.seq_id, table=a.read_blocks, ctx=c.num_keys, write_pos=c.start,
                          write_slots=a.write_slots, **fields)
    events.record("forward")
    if auditor is not None:
        auditor.check_io(plan)
