"""The isolation checker: one state machine over the block event stream (kvshare/kvcache/events.py)
that decides whether any request could see or damage another's KV.

It rebuilds, from the events alone (never trusting the counts the log reports), each block's
reference holders, the sequences whose tables hold it, whether it sits in the free queue, its
tenant, its publication in the prefix cache and which of its slots hold written KV. The live
audit feeds it events as they are recorded; `kvshare audit replay` feeds it a recorded file.
Both therefore reach the same verdict at the same point.

When the rules are applied (the invariants are listed in kvshare/kvcache/audit.py):
  copy, rotate   the block rewrites the runner performs before the forward pass, on arrival;
  forward        the model's writes, then its reads, as listed by this step's access events;
  checkpoints    the structural rules (forward, the next step, the end of the log, and wherever
                 the live audit asks): over the blocks touched since the last checkpoint, so the
                 cost follows the events, not the pool size.
Structural findings made between checkpoints wait for the next one, which reports the lowest
block (then the first rule in STATE_ORDER), as a walk over the pool by block id would.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace

# The per-block structural rules, in the order they are reported for one block.
STATE_ORDER = ("refcount_matches_tables", "free_xor_referenced", "adapter_isolation", "salt_isolation",
               "cached_block_matches_hash", "cached_block_written")


def namespace_violation(mine: CacheNamespace, theirs: CacheNamespace) -> str:
    """The invariant a holder of another namespace's block breaks: a block computed under another
    LoRA adapter (or the base model) is other bits, named apart from another tenant's salt."""
    return "adapter_isolation" if mine.adapter != theirs.adapter else "salt_isolation"


class Violation(Exception):
    """What the checker found: the invariant, the block, who was involved, and the step."""

    def __init__(self, invariant: str, block: int | None, detail: str, owners: set[str], step: int) -> None:
        super().__init__(f"{invariant} on block {block} at step {step}: {detail}")
        self.invariant, self.block, self.detail, self.owners, self.step = invariant, block, detail, owners, step


class IsolationChecker:
    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.step = 0
        self.num_checkpoints = 0
        self.holders: dict[int, Counter[str]] = {}  # block -> seq -> references it holds
        self.tables: dict[int, set[str]] = {}  # block -> sequences whose block table has it
        self.seq_blocks: dict[str, set[int]] = {}  # the same relation, by sequence (forks copy it)
        self.busy: set[int] = set()  # blocks out of the free queue
        # Whose data each block holds, and each admitted sequence's namespace; a block or a
        # sequence the log has not named (yet, or any more) counts as the default namespace.
        self.block_namespace: dict[int, CacheNamespace] = {}
        self.seq_namespace: dict[str, CacheNamespace] = {}
        self.published: set[int] = set()
        self.written: dict[int, int] = {}  # block -> bitmask of slots holding KV for its current data
        # Masks of blocks re-handed-out since the last forward: a copy in the coming forward
        # still reads the content its source had then.
        self._before_reuse: dict[int, int] = {}
        self._accesses: list[dict] = []
        # Since the last checkpoint: findings (invariant, block, detail, seqs involved), blocks
        # whose relations changed, blocks newly published, sequences that let go of everything.
        self._pending: list[tuple[str, int, str, tuple[str, ...]]] = []
        self._dirty: set[int] = set()
        self._new_published: list[int] = []
        self._idle: set[str] = set()
        self._handlers = {
            "pool": self._pool, "admit": self._admit, "fork": self._fork, "alloc": self._alloc,
            "incref": self._incref, "cache_hit": self._cache_hit, "decref": self._decref, "free": self._free,
            "register": self._register, "evict": self._evict,
            "tier_load": self._tier_load, "copy": self._copy, "rotate": self._rotate,
            "access": self._accesses.append, "forward": self._forward, "step": self._step,
        }  # cow, preempt, abort: the allocs and decrefs around them carry all that changes

    # ---- feeding --------------------------------------------------------------------------
    def feed(self, e: dict) -> None:
        """Apply one event; raises Violation at the point the rule it breaks is checked."""
        handler = self._handlers.get(e["ev"])
        if handler is not None:
            handler(e)

    def finish(self) -> None:
        """The end of the log is a checkpoint too."""
        self.checkpoint()

    # ---- what holds what --------------------------------------------------------------------
    def _num_holders(self, b: int) -> int:
        h = self.holders.get(b)
        return sum(h.values()) if h else 0

    def _join(self, seq: str, b: int) -> None:
        self.tables.setdefault(b, set()).add(seq)
        self.seq_blocks.setdefault(seq, set()).add(b)
        self._idle.discard(seq)

    def _leave(self, seq: str, b: int) -> None:
        t = self.tables.get(b)
        if t is not None:
            t.discard(seq)
        mine = self.seq_blocks.get(seq)
        if mine is not None:
            mine.discard(b)
            if not mine:
                self._idle.add(seq)

    def owners(self, b: int | None) -> set[str]:
        """Everyone the checker sees involved with a block: holders and tables (error path only)."""
        if b is None:
            return set()
        return set(self.holders.get(b, ())) | self.tables.get(b, set())

    def _found(self, invariant: str, b: int | None, detail: str, seqs=()) -> Violation:
        return Violation(invariant, b, detail, self.owners(b) | set(seqs), self.step)

    # ---- structural events --------------------------------------------------------------------
    def _pool(self, e: dict) -> None:
        self.block_size = e["block_size"]

    def _admit(self, e: dict) -> None:
        self.seq_namespace[e["seq"]] = CacheNamespace.from_event(e)
        self._idle.discard(e["seq"])

    def _fork(self, e: dict) -> None:
        child, parent = e["seq"], e["parent"]
        self.seq_namespace[child] = self.seq_namespace.get(parent, DEFAULT_NAMESPACE)
        for b in self.seq_blocks.get(parent, ()):  # the child's table is a copy of the parent's
            self._join(child, b)
            self._dirty.add(b)

    def _alloc(self, e: dict) -> None:
        b, seq = e["block"], e["seq"]
        if self._num_holders(b):
            self._pending.append(("refcount_matches_tables", b, f"handed to {seq} while held by "
                                  f"{dict(self.holders[b])}", (seq,)))
        elif b in self.busy:
            self._pending.append(("free_xor_referenced", b, f"handed to {seq} though not in the free queue", (seq,)))
        self.holders[b] = Counter({seq: 1})
        self._join(seq, b)
        self.busy.add(b)
        self._before_reuse.setdefault(b, self.written.get(b, 0))
        self.written[b] = 0
        self.block_namespace[b] = self.seq_namespace.get(seq, DEFAULT_NAMESPACE)
        self.published.discard(b)
        self._dirty.add(b)

    def _tier_load(self, e: dict) -> None:
        """A free block takes a KV tier's copy of a block (kvcache/kv_tiers.py): whole, under the
        namespace the tier kept it for, loaded by the runner before the next forward reads it."""
        b = e["block"]
        if self._num_holders(b) or b in self.busy:
            self._pending.append(("free_xor_referenced", b, "a tier's KV loaded into a block in use", ()))
        self._before_reuse.setdefault(b, self.written.get(b, 0))
        self.written[b] = (1 << self.block_size) - 1
        self.block_namespace[b] = CacheNamespace.from_event(e)
        self.published.discard(b)
        self._dirty.add(b)

    def _incref(self, e: dict) -> None:
        b, seq = e["block"], e["seq"]
        self.holders.setdefault(b, Counter())[seq] += 1
        self._join(seq, b)
        self.busy.add(b)  # a cached free block is revived
        self._dirty.add(b)

    def _cache_hit(self, e: dict) -> None:
        # The hit goes into the table whether or not its reference is counted (the incref follows).
        b, seq = e["block"], e["seq"]
        if b not in self.published:  # nothing vouches for its content: no register, or evicted since
            self._pending.append(("cached_block_matches_hash", b, f"{seq} hit a block not published for reuse",
                                  (seq,)))
        mine = self.seq_namespace.get(seq, DEFAULT_NAMESPACE)
        theirs = self.block_namespace.get(b, DEFAULT_NAMESPACE)
        if theirs != mine:
            self._pending.append((namespace_violation(mine, theirs), b, f"{seq} ({mine!r}) hit a block of {theirs!r}",
                                  (seq,)))
        self._join(seq, b)
        self._dirty.add(b)

    def _decref(self, e: dict) -> None:
        b, seq = e["block"], e["seq"]
        h = self.holders.setdefault(b, Counter())
        n = h.pop(seq, 0)
        if n <= 0:
            self._pending.append(("refcount_matches_tables", b, f"{seq} let go of a reference it does not hold",
                                  (seq,)))
        elif n > 1:
            h[seq] = n - 1
        if seq not in h:
            self._leave(seq, b)
        self._dirty.add(b)

    def _free(self, e: dict) -> None:
        b = e["block"]
        if self._num_holders(b):
            self._pending.append(("refcount_matches_tables", b, f"freed while held by {dict(self.holders[b])}", ()))
        elif b not in self.busy:
            self._pending.append(("free_xor_referenced", b, "freed while already in the free queue", ()))
        self.busy.discard(b)
        self._dirty.add(b)

    def _register(self, e: dict) -> None:
        b = e["block"]
        if "salt" in e:
            published, owner = CacheNamespace.from_event(e), self.block_namespace.get(b, DEFAULT_NAMESPACE)
            if published != owner:
                self._pending.append(("cached_block_matches_hash", b, f"published under {published!r}, the block's "
                                      f"data belongs to {owner!r}", ()))
        self.published.add(b)
        self._new_published.append(b)

    def _evict(self, e: dict) -> None:
        self.published.discard(e["block"])

    # ---- what the runner rewrites before the forward pass ------------------------------------
    def _copy(self, e: dict) -> None:
        src, dst = e["src"], e["dst"]
        if self._num_holders(dst) > 1:
            raise self._found("write_into_shared_block", dst, f"copy-on-write target has {self._num_holders(dst)} "
                                                              f"holders")
        self.written[dst] = self._before_reuse.get(src, self.written.get(src, 0))
        if dst in self.published:  # its written slots changed while published: check them again
            self._new_published.append(dst)

    def _rotate(self, e: dict) -> None:
        seq = e["seq"]
        mine = self.seq_blocks.get(seq, ())
        for b in e["blocks"]:
            if b not in mine:
                raise self._found("write_outside_own_blocks", b, f"{seq} re-rotates keys of a block not in its table",
                                  (seq,))
            if self._num_holders(b) > 1:
                raise self._found("write_into_shared_block", b, f"{seq} re-rotates keys of a block with "
                                                                f"{self._num_holders(b)} holders", (seq,))
            if b in self.published:
                raise self._found("rewrite_of_cached_block", b, f"{seq} re-rotates keys of a block published in the "
                                                                f"prefix cache", (seq,))

    # ---- the forward pass: writes, then reads ----------------------------------------------------
    def _forward(self, e: dict) -> None:
        self.step = e["step"]
        accesses = self._accesses
        try:
            self._check_io(accesses)
        finally:
            accesses.clear()
            self._before_reuse.clear()
        self.checkpoint()

    def _check_io(self, accesses: list[dict]) -> None:
        """A read may see KV written in an earlier step, or written this step by the reader itself
        (its own prefill chunk); KV another sequence writes in this same step is not yet
        published, so reading it is a violation."""
        bs = self.block_size
        full = (1 << bs) - 1
        fresh: dict[tuple[int, str], int] = {}  # (block, writer) -> slots written this step
        for a in accesses:
            seq, table = a["seq"], a["table"]
            mine = self.seq_blocks.get(seq, ())
            # Windowed sequences read only some of their blocks: "index" gives each one's table index.
            at = dict(zip(a.get("index") or range(len(table)), table))
            last = None  # consecutive slots mostly share a block: check its holders once
            for k, slot in enumerate(a["write_slots"]):
                pos = a["write_pos"] + k
                b = slot // bs
                if b not in mine or at.get(pos // bs) != b or slot % bs != pos % bs:
                    where = "a block its table does not hold" if b not in mine else \
                        f"offset {slot % bs}; its table has {at.get(pos // bs)} there"
                    raise self._found("write_outside_own_blocks", b, f"{seq} writes position {pos} into slot {slot} "
                                      f"(block {b}, {where})", (seq,))
                if b != last and self._num_holders(b) > 1:
                    raise self._found("write_into_shared_block", b, f"{seq} writes position {pos} into a block with "
                                                                    f"{self._num_holders(b)} holders", (seq,))
                last = b
                fresh[(b, seq)] = fresh.get((b, seq), 0) | 1 << (slot % bs)
        written = self.written
        for a in accesses:
            seq, table, ctx = a["seq"], a["table"], a["ctx"]
            mine = self.seq_blocks.get(seq, ())
            need = -(-ctx // bs)
            for i, b in zip(a.get("index") or range(need), table):
                if b not in mine:
                    raise self._found("read_outside_own_blocks", b, f"{seq} attends over block {b} at index {i}, not "
                                                                    f"in its own table", (seq,))
                want = full if i < need - 1 or ctx % bs == 0 else (1 << (ctx % bs)) - 1
                if (written.get(b, 0) | fresh.get((b, seq), 0)) & want != want:
                    raise self._found("read_unwritten_kv", b, f"{seq} reads keys of block {b} (index {i}) whose KV "
                                                              f"was not written before this step", (seq,))
        for (b, _), mask in fresh.items():
            written[b] = written.get(b, 0) | mask

    # ---- checkpoints ----------------------------------------------------------------------------
    def _step(self, e: dict) -> None:
        self.checkpoint()  # what the previous step (and any abort after it) left
        self.step = e["step"]

    def checkpoint(self) -> None:
        """Apply the structural rules to everything that changed since the last checkpoint."""
        self.num_checkpoints += 1
        findings = self._pending
        for b in self._dirty:
            held: Mapping[str, int] = self.holders.get(b) or {}
            tables = self.tables.get(b, set())
            if set(held) != tables or any(n != 1 for n in held.values()):
                findings.append(("refcount_matches_tables", b, f"references {dict(held)} but held by the table(s) "
                                 f"of {sorted(tables)}", ()))
            if (b in self.busy) != bool(held):
                state = "out of" if b in self.busy else "in"
                findings.append(("free_xor_referenced", b, f"{state} the free queue with {sum(held.values())} "
                                                           f"reference(s)", ()))
            owner = self.block_namespace.get(b, DEFAULT_NAMESPACE)
            foreign = sorted(s for s in tables | set(held) if self.seq_namespace.get(s, DEFAULT_NAMESPACE) != owner)
            if foreign:
                findings.append((namespace_violation(self.seq_namespace.get(foreign[0], DEFAULT_NAMESPACE), owner), b,
                                 f"holder(s) {foreign} have "
                                 f"{self.seq_namespace.get(foreign[0], DEFAULT_NAMESPACE)!r}, the block's data "
                                 f"belongs to {owner!r}",
                                 tuple(foreign)))
        # A published block's written slots only change when it is handed out again, which
        # unpublishes it, or by a copy into it (_copy queues it again): checking each
        # publication once is checking them all.
        full = (1 << self.block_size) - 1
        for b in self._new_published:
            if b in self.published and self.written.get(b, 0) != full:
                mask = bin(self.written.get(b, 0))[2:].zfill(self.block_size)[::-1]
                findings.append(("cached_block_written", b, f"published for reuse with written slots {mask}", ()))
        self._dirty.clear()
        self._new_published.clear()
        for seq in self._idle:  # a sequence holding nothing is forgotten; it is admitted afresh
            if not self.seq_blocks.get(seq):
                self.seq_blocks.pop(seq, None)
                self.seq_namespace.pop(seq, None)
        self._idle.clear()
        if findings:
            inv, b, detail, seqs = min(findings, key=lambda f: (f[1], STATE_ORDER.index(f[0])))
            findings.clear()
            raise self._found(inv, b, detail, seqs)
