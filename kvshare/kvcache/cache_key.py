"""The prefix cache's key beyond the tokens: the namespace a block's KV belongs to.

A cached block is reused only by a request of the same namespace. Its parts are the tenant's
salt (the request's `cache_salt`) and the adapter the KV was computed under (None until
adapters land: KV computed with one adapter is wrong for another). vLLM v1 calls these the
block hash's extra keys. One frozen value, so blocks, records, the checker, the audit and the
routers compare and hash the same thing, and a new part is one new field here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheNamespace:
    salt: str | None = None
    adapter: str | None = None

    def event_fields(self) -> dict:
        """The namespace as block-event fields: "salt" always (as the log wrote it before
        adapters), "adapter" only when set, so logs without adapters read as they always did."""
        return {"salt": self.salt} if self.adapter is None else {"salt": self.salt, "adapter": self.adapter}

    @classmethod
    def from_event(cls, e: dict) -> "CacheNamespace":
        return cls(e.get("salt"), e.get("adapter"))


# No salt, no adapter: the namespace every request that names neither shares.
DEFAULT_NAMESPACE = CacheNamespace()
