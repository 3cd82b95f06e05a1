"""`kvshare audit replay`: re-check a recorded block event log offline.

The replay rebuilds each block's holders, written slots, tenant and publication from the
events alone (never trusting the counts the log reports) and applies the audit's invariants at
the same points the live audit does: the model's reads and writes when a step's forward pass
is announced, the structural rules at every checkpoint (forward, next step, end of log). The
verdict is the first violation, named as the live audit names it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvshare.kvcache.events import read_events

# The live audit checks the model's I/O first, then the structure block by block.
_STATE_ORDER = ["refcount_matches_tables", "free_xor_referenced", "salt_isolation", "cached_block_matches_hash",
                "cached_block_written"]


@dataclass
class Verdict:
    invariant: str | None = None
    block: int | None = None
    step: int | None = None
    detail: str = ""
    events_checked: int = 0

    @property
    def clean(self) -> bool:
        return self.invariant is None

    def to_dict(self) -> dict:
        return {"clean": self.clean, "invariant": self.invariant, "block": self.block, "step": self.step,
                "detail": self.detail, "events_checked": self.events_checked}


@dataclass
class _State:
    block_size: int = 16
    holders: dict[int, Counter] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    block_salt: dict[int, str | None] = field(default_factory=dict)
    seq_salt: dict[str, str | None] = field(default_factory=dict)
    published: dict[int, None] = field(default_factory=dict)  # insertion-ordered set

    def held(self, b: int) -> Counter:
        return self.holders.setdefault(b, Counter())


class _Found(Exception):
    def __init__(self, invariant: str, block: int | None, detail: str) -> None:
        self.invariant, self.block, self.detail = invariant, block, detail


def replay(path: str) -> Verdict:
    events = read_events(path)
    st = _State()
    pending: list[tuple[str, int, str]] = []  # structural violations awaiting the next checkpoint
    accesses: list[dict] = []
    step = 0
    n = 0
    try:
        for n, e in enumerate(events, start=1):
            ev = e["ev"]
            if ev == "step":
                _checkpoint(st, pending)
                step = e["step"]
            elif ev == "forward":
                step = e["step"]
                _check_io(st, accesses, pending)
                accesses.clear()
                _checkpoint(st, pending)
            elif ev == "access":
                accesses.append(e)
            else:
                _apply(st, e, pending)
        _checkpoint(st, pending)
    except _Found as f:
        return Verdict(f.invariant, f.block, step, f.detail, n)
    return Verdict(events_checked=len(events))


def _apply(st: _State, e: dict, pending: list) -> None:
    ev = e["ev"]
    b = e.get("block")
    if ev == "pool":
        st.block_size = e["block_size"]
    elif ev == "admit":
        st.seq_salt[e["seq"]] = e.get("salt")
    elif ev == "fork":
        st.seq_salt[e["seq"]] = st.seq_salt.get(e["parent"])
    elif ev == "alloc":
        if sum(st.held(b).values()):
            pending.append(("refcount_matches_tables", b, f"handed to {e['seq']} while held by {dict(st.held(b))}"))
        st.holders[b] = Counter({e["seq"]: 1})
        st.written[b] = 0
        st.block_salt[b] = st.seq_salt.get(e["seq"])
        st.published.pop(b, None)
    elif ev == "incref":
        st.held(b)[e["seq"]] += 1
    elif ev == "cache_hit":
        if st.block_salt.get(b) != st.seq_salt.get(e["seq"]):
            pending.append(("salt_isolation", b, f"{e['seq']} (salt {st.seq_salt.get(e['seq'])!r}) hit a block of "
                                                 f"salt {st.block_salt.get(b)!r}"))
    elif ev == "decref":
        h = st.held(b)
        if h[e["seq"]] <= 0:
            pending.append(("refcount_matches_tables", b, f"{e['seq']} let go of a reference it does not hold"))
        else:
            h[e["seq"]] -= 1
            if not h[e["seq"]]:
                del h[e["seq"]]
    elif ev == "free":
        if sum(st.held(b).values()):
            pending.append(("refcount_matches_tables", b, f"freed while held by {dict(st.held(b))}"))
    elif ev == "register":
        st.published[b] = None
    elif ev == "evict":
        st.published.pop(b, None)
    elif ev == "copy":
        if sum(st.held(e["dst"]).values()) > 1:
            raise _Found("write_into_shared_block", e["dst"], "copy-on-write target is shared")
        st.written[e["dst"]] = st.written.get(e["src"], 0)
    elif ev == "rotate":
        for b in e["blocks"]:
            if st.held(b)[e["seq"]] <= 0:
                raise _Found("write_outside_own_blocks", b, f"{e['seq']} re-rotates keys of a block it does not hold")
            if sum(st.held(b).values()) > 1:
                raise _Found("write_into_shared_block", b, f"{e['seq']} re-rotates keys of a shared block")
            if b in st.published:
                raise _Found("rewrite_of_cached_block", b, f"{e['seq']} re-rotates keys of a published block")


def _check_io(st: _State, accesses: list[dict], pending: list) -> None:
    bs = st.block_size
    full = (1 << bs) - 1
    fresh: dict[tuple[int, str], int] = {}
    for a in accesses:
        seq, table = a["seq"], a["table"]
        # Windowed sequences read only some of their blocks: "index" gives each one's table index.
        at = dict(zip(a.get("index", range(len(table))), table))
        for k, slot in enumerate(a["write_slots"]):
            pos = a["write_pos"] + k
            b = slot // bs
            if at.get(pos // bs) != b or slot % bs != pos % bs:
                raise _Found("write_outside_own_blocks", b, f"{seq} writes position {pos} into slot {slot}")
            if sum(st.held(b).values()) > 1:
                raise _Found("write_into_shared_block", b, f"{seq} writes position {pos} into a shared block")
            fresh[(b, seq)] = fresh.get((b, seq), 0) | 1 << (slot % bs)
    for a in accesses:
        seq, table, ctx = a["seq"], a["table"], a["ctx"]
        need = -(-ctx // bs)
        for i, b in zip(a.get("index", range(need)), table):
            want = full if i < need - 1 or ctx % bs == 0 else (1 << (ctx % bs)) - 1
            if (st.written.get(b, 0) | fresh.get((b, seq), 0)) & want != want:
                raise _Found("read_unwritten_kv", b, f"{seq} reads block {b} (index {i}) before its KV was written")
    for (b, _), mask in fresh.items():
        st.written[b] = st.written.get(b, 0) | mask
    # A table the kernel walks must consist of blocks the sequence holds, of its own tenant.
    for a in accesses:
        for b in a["table"]:
            if st.held(b)[a["seq"]] <= 0:
                pending.append(("refcount_matches_tables", b, f"{a['seq']} uses it without holding a reference"))
            if st.block_salt.get(b) != st.seq_salt.get(a["seq"]):
                pending.append(("salt_isolation", b, f"{a['seq']} uses a block of another tenant"))


def _checkpoint(st: _State, pending: list) -> None:
    if pending:
        # Per-block rules first, lowest block id first, as the live audit walks the pool.
        inv, b, detail = min(pending, key=lambda p: (p[1], _STATE_ORDER.index(p[0])))
        raise _Found(inv, b, detail)
    full = (1 << st.block_size) - 1
    for b in st.published:
        if st.written.get(b, 0) != full:
            raise _Found("cached_block_written", b, "published for reuse with unwritten slots")
