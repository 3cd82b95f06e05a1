"""`kvshare audit replay`: re-check a recorded block event log offline.

The recorded events go through the same IsolationChecker (kvshare/kvcache/isolation.py) the live
audit feeds as it records them, so the verdict is the one the live audit reaches: the first
violation, named as the live audit names it, at the same step and block.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.kvcache.events import read_events
from kvshare.kvcache.isolation import IsolationChecker, Violation


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


def replay(path: str) -> Verdict:
    events = read_events(path)
    checker = IsolationChecker()  # the log's "pool" event gives the block size
    n = 0
    try:
        for n, e in enumerate(events, start=1):
            checker.feed(e)
        checker.finish()
    except Violation as v:
        return Verdict(v.invariant, v.block, v.step, v.detail, n)
    return Verdict(events_checked=len(events))
