"""Audit mode: prove, step by step, that no request can see or damage another's KV.

The auditor reads the real structures (pool, tables, the step plan the runner executes), never
the manager's intentions, and keeps one shadow fact of its own: which slots of each block have
had KV written since the block was last handed out. Checks:

  refcount_matches_tables   a block's ref count equals the number of tables holding it, and its
                            owner set names exactly those sequences. The prefix cache itself
                            holds no references: a cached block nobody uses has count 0 and
                            sits in the free queue, still hashed.
  free_xor_referenced       a block is in the free queue iff its count is 0; no count below 0;
                            in use + free uncached + free cached = total.
  salt_isolation            every holder of a block has the block's tenant salt.
  cached_block_matches_hash a cached block's hash recomputes from (parent hash, salt, its token
                            ids), and a sequence holding it has those tokens at that position.
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
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from kvshare.kvcache.block_pool import Block
from kvshare.kvcache.events import EventLog
from kvshare.kvcache.hashing import BlockHasher


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
        # block id -> (generation, bitmask of written slots)
        self._written: dict[int, tuple[int, int]] = {}
        self._live_tokens = live_tokens
        self._gen_at_forward = [b.generation for b in self.pool.blocks]
        self.num_checks = 0

    # ---- reporting ------------------------------------------------------------------------
    def _fail(self, invariant: str, detail: str, block: Block | None = None, owners: Iterable[str] = ()):
        holders = set(owners)
        if block is not None:
            holders |= block.owners
            holders |= {s for s, t in self.manager.tables.items() if any(b is block for b in t)}
        self.events.flush()
        raise AuditError(invariant, detail, block.block_id if block is not None else None, holders,
                         self.events.step, self.events.touching(block.block_id) if block is not None else [])

    # ---- shadow of written KV ---------------------------------------------------------------
    def _mask(self, block: Block) -> int:
        gen, mask = self._written.get(block.block_id, (None, 0))
        return mask if gen == block.generation else 0

    def _mark(self, block: Block, mask: int) -> None:
        self._written[block.block_id] = (block.generation, self._mask(block) | mask)

    # ---- structural checks --------------------------------------------------------------------
    def check_state(self) -> None:
        self.num_checks += 1
        pool, tables = self.pool, self.manager.tables
        held: Counter[int] = Counter()
        holders: dict[int, set[str]] = {}
        for seq_id, table in tables.items():
            for b in table:
                if b is None:
                    continue
                held[b.block_id] += 1
                holders.setdefault(b.block_id, set()).add(seq_id)
        salts = self.manager.salts
        free_cached = free_plain = in_use = 0
        for b in pool.blocks:  # by block id, so the lowest broken block is the one reported
            mine = holders.get(b.block_id, set())
            if b.ref_count < 0:
                self._fail("free_xor_referenced", f"reference count {b.ref_count} is below zero", b)
            if b.ref_count != held[b.block_id] or b.owners != mine:
                self._fail("refcount_matches_tables",
                           f"reference count {b.ref_count} (owners {sorted(b.owners)}) but held by "
                           f"{held[b.block_id]} table(s): {sorted(mine)}", b)
            if pool.is_free(b.block_id) != (b.ref_count == 0):
                state = "free" if pool.is_free(b.block_id) else "not free"
                self._fail("free_xor_referenced", f"block is {state} with reference count {b.ref_count}", b)
            foreign = sorted(s for s in mine if salts.get(s) != b.salt)
            if foreign:
                self._fail("salt_isolation", f"holder(s) {foreign} have salt {salts.get(foreign[0])!r}, the block's "
                                             f"data belongs to salt {b.salt!r}", b, foreign)
            if b.ref_count:
                in_use += 1
            elif b.block_hash is not None:
                free_cached += 1
            else:
                free_plain += 1
        if in_use + free_cached + free_plain != pool.num_blocks or pool.num_free != free_cached + free_plain:
            self._fail("free_xor_referenced", f"in use {in_use} + free cached {free_cached} + free {free_plain} "
                                              f"!= {pool.num_blocks} blocks (free queue holds {pool.num_free})")
        self._check_cached()
        self._check_contents()

    def _check_cached(self) -> None:
        extra = BlockHasher.extra_keys
        hasher = self.manager.hasher
        for h, bid in self.pool.cached.items():
            b = self.pool.blocks[bid]
            if b.block_hash != h or hasher.hash_block(b.parent_hash, b.token_ids, extra(b.salt)) != h:
                self._fail("cached_block_matches_hash", "stored token ids / salt do not produce the block's hash", b)
            if self._mask(b) != self.full_mask:
                self._fail("cached_block_written", f"published for reuse with written slots "
                                                   f"{bin(self._mask(b))[2:].zfill(self.block_size)[::-1]}", b)

    def _check_contents(self) -> None:
        bs = self.block_size
        live = self._live_tokens()
        for seq_id, table in self.manager.tables.items():
            tokens = live.get(seq_id)
            if tokens is None:
                continue
            for i, b in enumerate(table):
                if b is not None and b.token_ids is not None and (i + 1) * bs <= len(tokens) and \
                        tuple(tokens[i * bs:(i + 1) * bs]) != b.token_ids:
                    self._fail("cached_block_matches_hash",
                               f"sequence {seq_id} holds it at index {i}, but its tokens there differ", b, [seq_id])

    # ---- what the model reads and writes ---------------------------------------------------------
    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        # Copies run before the forward pass, so a source block re-handed-out during this
        # step's scheduling still holds the content it had at the last forward.
        for src, dst in copies:
            d = self.pool.blocks[dst]
            if d.ref_count > 1:
                self._fail("write_into_shared_block", f"copy-on-write target has {d.ref_count} holders", d)
            gen, mask = self._written.get(src, (None, 0))
            self._written[dst] = (d.generation, mask if gen == self._gen_at_forward[src] else 0)

    def check_rotations(self, rotations: list[tuple[str, list[int], int]]) -> None:
        """(seq id, block ids, shift) re-rotated in place before this forward pass."""
        tables = self.manager.tables
        for seq_id, block_ids, _ in rotations:
            table = tables.get(seq_id, [])
            for bid in block_ids:
                b = self.pool.blocks[bid]
                if not any(x is b for x in table):
                    self._fail("write_outside_own_blocks", f"{seq_id} re-rotates keys of a block not in its table",
                               b, [seq_id])
                if b.ref_count > 1:
                    self._fail("write_into_shared_block", f"{seq_id} re-rotates keys of a block with {b.ref_count} "
                                                          f"holders", b, [seq_id])
                if b.block_hash is not None:
                    self._fail("rewrite_of_cached_block", f"{seq_id} re-rotates keys of a block published in the "
                                                          f"prefix cache", b, [seq_id])

    def check_io(self, rows: list[tuple[str, int, int]], slots: list[int],
                 read_tables: list[tuple[str, list[int], int] | tuple[str, list[int], int, list[int] | None]]) -> None:
        """rows: (seq id, first position, count) in slot-mapping order; read_tables: (seq id, the
        block ids attention walks, number of keys read[, the table index of each block when the
        sequence reads only some of its blocks (windows)]). A read may see KV written in an earlier
        step, or written this step by the reader itself (its own prefill chunk); KV another
        sequence writes in this same step is not yet published, so reading it is a violation."""
        bs = self.block_size
        blocks = self.pool.blocks
        tables = self.manager.tables
        fresh: dict[tuple[int, str], int] = {}  # (block, writer) -> slots written this step
        k = 0
        for seq_id, start, count in rows:
            table = tables.get(seq_id, [])
            for pos in range(start, start + count):
                slot = slots[k]
                k += 1
                b = blocks[slot // bs]
                i = pos // bs
                if i >= len(table) or table[i] is not b or slot % bs != pos % bs:
                    self._fail("write_outside_own_blocks", f"{seq_id} writes position {pos} into slot {slot} "
                               f"(block {b.block_id} offset {slot % bs}); its table has "
                               f"{getattr(table[i], 'block_id', None) if i < len(table) else None} there", b,
                               [seq_id])
                if b.ref_count > 1:
                    self._fail("write_into_shared_block", f"{seq_id} writes position {pos} into a block with "
                                                          f"{b.ref_count} holders", b, [seq_id])
                key = (b.block_id, seq_id)
                fresh[key] = fresh.get(key, 0) | 1 << (slot % bs)
        for seq_id, ids, num_keys, *index in read_tables:
            table = tables.get(seq_id, [])
            need = -(-num_keys // bs)
            at = index[0] if index and index[0] is not None else range(need)
            for k, i in enumerate(at):
                b = blocks[ids[k]]
                if i >= len(table) or table[i] is not b:
                    self._fail("read_outside_own_blocks", f"{seq_id} attends over block {b.block_id} at index {i}, "
                                                          f"not in its own table", b, [seq_id])
                want = self.full_mask if i < need - 1 or num_keys % bs == 0 else (1 << (num_keys % bs)) - 1
                have = self._mask(b) | fresh.get((b.block_id, seq_id), 0)
                if have & want != want:
                    self._fail("read_unwritten_kv", f"{seq_id} reads keys of block {b.block_id} (index {i}) whose KV "
                                                    f"was not written before this step", b, [seq_id])
        for (block_id, _), mask in fresh.items():
            self._mark(blocks[block_id], mask)
        self._gen_at_forward = [b.generation for b in blocks]


def record_step_io(events, auditor: KVAuditor | None, plan) -> None:
    """The engine's one hook before a forward pass: log (and, in audit mode, check) exactly what
    the step plan says the model will read and write. `plan` is a StepPlan
    (kvshare/engine/step_plan.py): what the runner executes is exactly what is checked here."""
    if not events.enabled:
        return
    for src, dst in plan.block_copies:
        events.record("copy", src=src, dst=dst)
    for seq_id, block_ids, shift in plan.rotations:
        events.record("rotate", seq=seq_id, blocks=block_ids, shift=shift)
    for c in plan.chunks:
        fields = {} if c.read_index is None else {"index": c.read_index}
        events.record("access", seq=c.seq.seq_id, table=c.read_blocks, ctx=c.num_keys, write_pos=c.start,
                      write_slots=c.write_slots, **fields)
    events.record("forward")
    if auditor is not None:
        auditor.apply_copies(plan.block_copies)
        auditor.check_rotations(plan.rotations)
        auditor.check_io([(c.seq.seq_id, c.start, c.num_tokens) for c in plan.chunks],
                         [s for c in plan.chunks for s in c.write_slots],
                         [(c.seq.seq_id, c.read_blocks, c.num_keys, c.read_index) for c in plan.chunks])
        auditor.check_state()
