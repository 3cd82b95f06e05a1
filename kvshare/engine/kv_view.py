"""The engine's side of the live KV view: a whole snapshot of the pool and of the requests holding
it, and switching the view's event recorder on and off. Called on the thread that steps the
engine, between steps (the server queues these calls like adds and aborts)."""
from __future__ import annotations

from kvshare.engine.request import SeqStatus
from kvshare.kvcache.pool_view import manager_counts, read_pool
from kvshare.kvcache.view_tap import ViewTap


def request_status(state) -> str:
    statuses = {s.status for s in state.seqs}
    if SeqStatus.RUNNING in statuses:
        return "running"
    if SeqStatus.WAITING in statuses:
        return "waiting"
    return "finished"


def kv_snapshot(engine, blocks: str = "all") -> dict:
    """The pool block by block and the live requests. blocks: "all", "held" (only blocks some
    sequence holds) or "none" (counts and requests only)."""
    request_of = {s.seq_id: st.request_id for st in engine.requests.values() for s in st.seqs}
    tap = engine.view_tap
    rows, counts = read_pool(engine.manager, lambda seq: request_of.get(seq, seq),
                             tap.last_event if tap is not None else None)
    held: dict[str, int] = {}
    for row in rows:
        for rid in row["owners"]:
            held[rid] = held.get(rid, 0) + 1
    requests = [{"request_id": st.request_id, "status": request_status(st), "blocks": held.get(st.request_id, 0),
                 "cached_tokens": max((s.num_cached_tokens for s in st.seqs), default=0)}
                for st in engine.requests.values()]
    return select_blocks({"step": engine.step_count, "num_blocks": engine.manager.num_blocks,
                          "block_size": engine.manager.block_size, "counts": counts,
                          "engine_counts": manager_counts(engine.manager), "blocks": rows, "requests": requests},
                         blocks)


def select_blocks(snapshot: dict, blocks: str) -> dict:
    """A whole snapshot narrowed to the rows `blocks` asks for (a new dict; the rows are shared)."""
    if blocks == "held":
        return {**snapshot, "blocks": [r for r in snapshot["blocks"] if r["ref_count"]]}
    if blocks == "none":
        return {**snapshot, "blocks": []}
    return snapshot


def start_view(engine) -> ViewTap:
    """The view's recorder, installed in front of the engine's own event log (one at most)."""
    if engine.view_tap is None:
        engine.set_view_tap(ViewTap(pool=engine.manager.pool))
    return engine.view_tap


def stop_view(engine) -> None:
    engine.set_view_tap(None)
