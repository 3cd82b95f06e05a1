"""Block event log: what happened to each KV block, in order, with step and sequence ids.

Only built when auditing or when a log file is asked for; with neither, the pool and the
manager hold a `NullEventLog`, whose `record` does nothing (one no-op call per block
operation, and no `is not None` test anywhere).

Kinds and their fields (every event also has "ev", "step"):
  step       begin of an engine step
  admit      seq, salt                  a sequence takes its first blocks
  alloc      block, seq                 a free block handed out (ref 0 -> 1)
  evict      block                      a cached free block loses its hash on reuse
  incref     block, seq, ref            another holder (fork share or prefix hit)
  cache_hit  block, seq                 a prefix-cache hit (followed by its incref)
  decref     block, seq, ref            a holder lets go; ref is the count after
  free       block                      the count reached 0: the block is back in the free queue
  register   block, hash, parent, salt, tokens   a full written block published for reuse
  cow        seq, src, dst              copy-on-write of a shared block
  fork       seq, parent                a child shares its parent's blocks
  access     seq, group, table, ctx, write_pos, write_slots[, index]   what the model reads and
             writes this step in one KV cache group (one access per group, each over that group's
             table; logs written before the field existed leave it out for group 0); index: the
             table index of each block read, when a windowed sequence reads only some of its blocks
  rotate     seq, blocks, shift         keys re-rotated in place (attention sinks), after the copies
  copy       src, dst                   a block copy the runner performs before the forward
  forward    the step's accesses are all listed; the forward pass runs
  tier_store block, hash, group         a cached block's KV evicted from the pool kept in the KV tiers
  tier_load  block, hash, tier, group, salt  a free block takes a tier's copy (loaded before the forward)
  tier_drop  hash, tier, group          a tier lets go of a block (least recently used out)
  preempt    seq
  abort      seq
"""
from __future__ import annotations

import json
from collections import deque
from typing import Callable


class EventLog:
    enabled = True

    def __init__(self, capacity: int = 4096, path: str | None = None) -> None:
        self.step = 0
        self.recent: deque[dict] = deque(maxlen=capacity)
        self.path = path
        self._file = open(path, "w", encoding="utf-8") if path else None
        # Called with each event once it is stored and written, so that what a live consumer
        # (the audit's isolation checker) raises on is already in the file for the replay.
        self.listener: Callable[[dict], None] | None = None

    def record(self, ev: str, **fields) -> None:
        fields["ev"] = ev
        fields["step"] = self.step
        self.recent.append(fields)
        if self._file is not None:
            self._file.write(json.dumps(fields, separators=(",", ":")) + "\n")
        if self.listener is not None:
            self.listener(fields)

    def touching(self, block_id: int, limit: int = 12) -> list[dict]:
        """The last events that name this block (as block, src, dst, or inside a table)."""
        out = []
        for e in reversed(self.recent):
            if (e.get("block") == block_id or e.get("src") == block_id or e.get("dst") == block_id
                    or block_id in e.get("table", ())):
                out.append(e)
                if len(out) == limit:
                    break
        return out[::-1]

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class NullEventLog:
    """The recorder when nothing listens: same interface, records nothing."""

    enabled = False
    step = 0
    recent: tuple = ()
    path = None

    def record(self, ev: str, **fields) -> None:
        pass

    def touching(self, block_id: int, limit: int = 12) -> list[dict]:
        return []

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def as_event_log(log: "EventLog | NullEventLog | None") -> "EventLog | NullEventLog":
    return NullEventLog() if log is None else log


class Recorder:
    """A class attribute holding an object's event log; setting it to None installs a
    NullEventLog, so the owner records unconditionally."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, log) -> None:
        setattr(obj, self.slot, as_event_log(log))


def read_events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
