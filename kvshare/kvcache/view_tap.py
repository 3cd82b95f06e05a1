"""The live KV view's recorder: an event log placed in front of the engine's own one while a
view client listens, so the engine records nothing extra when nobody does.

Every event still goes to the engine's log (an EventLog when auditing or logging to a file, a
NullEventLog otherwise) exactly as before; the block events a view shows are also kept, in
order, until the engine thread takes them as one batch per engine step. The tap also remembers
the last event that touched each block, for the pool snapshot. Given the pool, it adds to each
event that names a block the block's state right after it (kvshare.kvcache.pool_view.block_state),
so a view receives states and never derives them.
"""
from __future__ import annotations

from kvshare.kvcache.events import as_event_log
from kvshare.kvcache.pool_view import state_of

# What the view shows: what happened to blocks and to the sequences holding them. Step markers,
# the per-step access lists (tables, write slots) and copies stay in the engine's own log.
VIEW_KINDS = frozenset({"admit", "alloc", "evict", "incref", "cache_hit", "decref", "free", "register", "cow",
                        "fork", "preempt", "abort"})


class ViewTap:
    """Has the event-log interface (record, step, enabled, touching, flush, close)."""

    def __init__(self, inner=None, pool=None) -> None:
        self.inner = as_event_log(inner)
        self.pool = pool  # a kvshare.kvcache.block_pool.BlockPool, or None: events carry no state
        self.batch: list[dict] = []  # events since the last take(), engine thread only
        self.last_event: dict[int, tuple[str, int]] = {}  # block id -> (kind, step)

    # The engine's log decides whether per-step access lists are built at all (record_step_io
    # checks `enabled`): the view does not show them, so it never turns them on.
    @property
    def enabled(self) -> bool:
        return self.inner.enabled

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value  # a NullEventLog keeps it too (as an instance attribute)

    def record(self, ev: str, **fields) -> None:
        # The engine's log first: in audit mode its listener may raise, and the view must not
        # show an event the audit refused.
        self.inner.record(ev, **fields)
        if ev not in VIEW_KINDS:
            return
        step = self.inner.step
        fields["ev"] = ev
        fields["step"] = step
        self.batch.append(fields)
        if ev == "cow":
            self.last_event[fields["src"]] = self.last_event[fields["dst"]] = (ev, step)
        elif "block" in fields:
            self.last_event[fields["block"]] = (ev, step)
            if self.pool is not None:
                fields["state"] = state_of(self.pool.blocks[fields["block"]])

    def take(self) -> list[dict]:
        batch, self.batch = self.batch, []
        return batch

    def touching(self, block_id: int, limit: int = 12) -> list[dict]:
        return self.inner.touching(block_id, limit)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
