"""The live KV view's data endpoints (/kv/snapshot, /kv/events): the pool read block by block
(engine-less, on a manager), the event fan-out's redaction and bounded queues, and a real
`kvshare serve` on loopback under --api-key running a shared-prefix workload."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import openai
import pytest

from kvshare.engine.core import EngineStatus
from kvshare.kvcache.audit import AuditError
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.kvcache.coordinator import KVCacheCoordinator
from kvshare.kvcache.kv_groups import plan_kv_groups
from kvshare.kvcache.pool_view import manager_counts, read_pool
from kvshare.kvcache.view_tap import ViewTap
from kvshare.server.async_engine import AsyncEngine
from kvshare.server.kv_stream import EventRedactor, KVEventHub, Subscriber
from kvshare.server.metrics import ServerMetrics
from server_proc import MODEL, ServerProcess

KEY = "view-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEX12 = re.compile(r"^[0-9a-f]{12}$")


# ---- the pool read, on a manager (no model) --------------------------------------------------

def _admit(mgr, seq_id: str, token_ids: list[int], salt: str | None = None) -> None:
    plan = mgr.plan_admission(seq_id, token_ids, CacheNamespace(salt=salt), max_new_tokens=len(token_ids))
    assert plan.refusal is None
    mgr.commit_admission(plan)
    mgr.publish_full_blocks(seq_id, token_ids, len(token_ids))


def test_pool_read_states_owners_positions_and_counts():
    mgr = KVCacheCoordinator(8, 4, plan_kv_groups([None], 4))
    tap = ViewTap()
    mgr.events = mgr.pool.events = tap
    a = list(range(13))  # 3 full blocks + 1 token
    _admit(mgr, "a", a)
    _admit(mgr, "b", a[:12] + [99, 98])  # hits a's 3 full blocks, 1 block of its own
    rows, counts = read_pool(mgr, lambda s: f"req-{s}", tap.last_event)
    assert counts == {"free": 3, "cached": 0, "in_use": 2, "shared": 3} == manager_counts(mgr)
    shared = [r for r in rows if r["state"] == "shared"]
    assert [r["position"] for r in shared] == [0, 1, 2]
    # Each names the block before it in the chain (what the dashboard's prefix tree is drawn from).
    assert shared[0]["parent"] is None and [r["parent"] for r in shared[1:]] == [r["hash"] for r in shared[:-1]]
    for r in shared:
        assert r["owners"] == ["req-a", "req-b"] and r["ref_count"] == 2 and r["group"] == 0
        assert HEX12.match(r["hash"]) and r["last_event"]["ev"] == "incref"
    free = [r for r in rows if r["state"] == "free"]
    assert all(r["owners"] == [] and r["position"] is None and r["hash"] is None and r["parent"] is None
               for r in free)
    kinds = {e["ev"] for e in tap.take()}
    assert {"admit", "alloc", "register", "cache_hit", "incref"} <= kinds and tap.take() == []

    mgr.free("a")
    assert read_pool(mgr, str)[1] == {"free": 4, "cached": 0, "in_use": 4, "shared": 0} == manager_counts(mgr)
    mgr.free("b")  # its 3 hashed blocks stay cached (evictable), the partial one is plain free
    rows, counts = read_pool(mgr, str, tap.last_event)
    assert counts == {"free": 5, "cached": 3, "in_use": 0, "shared": 0} == manager_counts(mgr)
    assert {r["last_event"]["ev"] for r in rows if r["state"] == "cached"} == {"free"}
    assert {"decref", "free"} <= {e["ev"] for e in tap.take()}


def test_pool_read_names_the_kv_group():
    groups = plan_kv_groups([None, 8], 4)  # one global group, one window group
    mgr = KVCacheCoordinator(16, 4, groups)
    _admit(mgr, "a", list(range(10)))  # 3 blocks in each group
    rows, counts = read_pool(mgr, str)
    held = [r for r in rows if r["ref_count"]]
    assert sorted((r["group"], r["position"]) for r in held) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert counts == manager_counts(mgr) and counts["in_use"] == 6


# ---- the fan-out: redaction, bounded queues, switching the recorder -----------------------------

def test_redactor_hashes_salts_and_keeps_tokens_out():
    red = EventRedactor(show_tokens=False, key=b"k" * 16)
    e = red.event({"ev": "register", "block": 3, "hash": "ab" * 8, "parent": None, "salt": "tenant-7",
                   "tokens": [1, 2, 3]})
    assert "tokens" not in e and e["hash"] == "ab" * 6 and HEX12.match(e["salt"]) and "tenant" not in e["salt"]
    assert red.event({"ev": "admit", "seq": "x", "salt": "tenant-7"})["salt"] == e["salt"]  # stable
    assert EventRedactor(False, key=b"j" * 16).salt("tenant-7") != e["salt"]  # keyed per process
    assert red.event({"ev": "admit", "seq": "x", "salt": None})["salt"] is None
    assert EventRedactor(show_tokens=True).event({"ev": "register", "tokens": [1]})["tokens"] == [1]


def test_slow_subscriber_drops_oldest_batches_and_says_how_many():
    async def run():
        sub = Subscriber(2)
        for step in range(1, 6):
            sub.put((step, "[]"))
        assert await sub.get(0) == (4, "[]", 3)
        assert await sub.get(0) == (5, "[]", 0)
        assert await sub.get(0.01) is None
    asyncio.run(run())


def test_hub_switches_the_recorder_on_once_and_off_after_the_last_client():
    class FakeEngine:
        def __init__(self):
            self.sink, self.watches, self.unwatches = None, 0, 0

        async def watch_kv(self, sink):
            self.sink, self.watches = sink, self.watches + 1

        def unwatch_kv(self):
            self.unwatches += 1

    async def run():
        eng = FakeEngine()
        hub = KVEventHub(eng, EventRedactor(False))
        s1, s2 = await hub.subscribe(4), await hub.subscribe(4)
        eng.sink(7, [{"ev": "alloc", "block": 1, "seq": "r", "step": 7}])
        for s in (s1, s2):
            step, events, dropped = await s.get(0)
            assert (step, json.loads(events), dropped) == (7, [{"ev": "alloc", "block": 1, "seq": "r", "step": 7}], 0)
        hub.unsubscribe(s1)
        assert eng.unwatches == 0
        hub.unsubscribe(s2)
        hub.unsubscribe(s2)  # twice: a no-op
        assert (eng.watches, eng.unwatches) == (1, 1)
        await hub.subscribe(4)
        assert eng.watches == 2
    asyncio.run(run())


def test_step_batches_carry_audit_verdicts_and_a_failure_names_only_the_invariant():
    class FakeLoop:  # runs the hand-over at once, as the event loop would a moment later
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    tap = ViewTap()
    engine = SimpleNamespace(layout=SimpleNamespace(num_blocks=8), take_view_events=tap.take, step_count=3,
                             audit_checks=41)
    ae = AsyncEngine(engine, ServerMetrics("m"))
    ae._loop, got = FakeLoop(), []
    ae._view_sink = lambda step, events: got.append((step, events))
    tap.record("alloc", block=2, seq="r")
    ae._flush_view(stepped=True)
    assert got == [(3, [{"block": 2, "seq": "r", "ev": "alloc", "step": 0},
                        {"ev": "audit", "step": 3, "ok": True, "checks": 41}])]
    ae._flush_view(stepped=False)  # no step, nothing recorded: no message
    assert len(got) == 1
    ae._flush_view_on_failure(AuditError("salt_isolation", "salt 'tenant-secret' ...", block=5))
    assert got[-1] == (3, [{"ev": "audit", "step": 3, "ok": False, "invariant": "salt_isolation", "block": 5}])


def test_a_failed_audit_is_kept_redacted_after_the_engine_stops():
    """What a view opened after the stop gets (/kv/snapshot's dead-engine answer): the invariant,
    block and step, and a dead reason that quotes neither the audit's detail nor its owners."""
    class FakeLoop:
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    def failing_step():
        raise AuditError("salt_isolation", "salt 'tenant-secret' reached another tenant", block=5,
                         owners=["req-victim"], step=9)

    engine = SimpleNamespace(layout=SimpleNamespace(num_blocks=8), take_view_events=lambda: None, step_count=9,
                             audit_checks=None,
                             has_unfinished_requests=lambda: True, step=failing_step)
    ae = AsyncEngine(engine, ServerMetrics("m"))
    ae._loop = FakeLoop()
    ae._run()  # returns once the step has failed
    assert ae.audit_failure == {"invariant": "salt_isolation", "block": 5, "step": 9}
    assert "salt_isolation" in ae.dead and "block 5" in ae.dead
    assert "tenant-secret" not in ae.dead and "req-victim" not in ae.dead
    with pytest.raises(RuntimeError):  # a live engine is read through call(), never this way
        asyncio.run(AsyncEngine(engine, ServerMetrics("m")).read_stopped(lambda: None))
    assert asyncio.run(ae.read_stopped(lambda: "the pool")) == "the pool"  # no thread: nothing to wait for


def test_concurrent_snapshot_viewers_share_one_pass_over_the_pool(monkeypatch):
    """M viewers asking at once (any `blocks` choice) cost the engine thread one snapshot; asking
    again before the engine changes costs nothing; after a step, one more."""
    import httpx2

    from kvshare.server.app import build_app
    from kvshare.server.settings import ServerConfig
    from kvshare.server.state import ServerState

    builds = []

    def counting_snapshot(engine, blocks="all"):
        builds.append(engine.step_count)
        time.sleep(0.05)  # an O(blocks) pass takes a while: the other viewers arrive meanwhile
        return {"step": engine.step_count, "blocks": [{"ref_count": 1}, {"ref_count": 0}], "requests": []}

    engine = SimpleNamespace(
        layout=SimpleNamespace(num_blocks=2), status=lambda: EngineStatus(blocks_total=2, step=engine.step_count),
        kv_snapshot=lambda blocks="all": counting_snapshot(engine, blocks), step_count=0, work=0,
        has_unfinished_requests=lambda: engine.work > 0, close=lambda: None)

    def step():
        engine.work -= 1
        engine.step_count += 1
        return []

    engine.step = step
    ae = AsyncEngine(engine, ServerMetrics("m"))
    state = ServerState(config=ServerConfig(), engine=ae, metrics=ae.metrics, model_name="m", model_source="m",
                        tokenizer=None, max_model_len=64, max_num_seqs=2)
    app = build_app(state)

    async def main():
        ae.start(asyncio.get_running_loop())
        try:
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
                paths = ["/kv/snapshot", "/kv/snapshot?blocks=held", "/kv/snapshot?blocks=none"] * 4
                first = await asyncio.gather(*(c.get(p) for p in paths))
                assert len(builds) == 1
                again = await c.get("/kv/snapshot")
                assert len(builds) == 1  # nothing changed since: the same snapshot
                await ae.call(lambda: setattr(engine, "work", 1))  # one step follows this call
                while ae.snapshot.step < 1:
                    await asyncio.sleep(0.01)
                after = await c.get("/kv/snapshot")
                assert len(builds) == 2
                return first, again, after
        finally:
            await asyncio.to_thread(ae.stop, 10)

    first, again, after = asyncio.run(main())
    assert all(r.status_code == 200 for r in (*first, again, after))
    assert [len(r.json()["blocks"]) for r in first[:3]] == [2, 1, 0]
    assert again.json() == first[0].json() and first[0].json()["step"] == 0 and after.json()["step"] == 1


# ---- a real server ------------------------------------------------------------------------------

PREFIX = ("The history of the lighthouse keepers of the northern coast is a long one. Each keeper kept a log "
          "of ships, storms, tides and lamps, and every log was read by the next keeper before the season "
          "began. ") * 2


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY).wait_ready()
    yield srv
    srv.close()


class EventStreamReader:
    """GET /kv/events read on a thread: every (event, data) message, and the raw text."""

    def __init__(self, srv: ServerProcess, headers: dict) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        self.conn.request("GET", "/kv/events", headers=headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        assert self.resp.getheader("content-type").startswith("text/event-stream")
        self.messages: list[tuple[str, dict]] = []
        self.raw: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        event, data = None, []
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    return
                line = line.decode().rstrip("\n")
                self.raw.append(line)
                if line == "" and data:
                    self.messages.append((event, json.loads("\n".join(data))))
                    event, data = None, []
                elif line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("data: "):
                    data.append(line[len("data: "):])
        except (OSError, ValueError, AttributeError):  # the socket shut under it by close()
            return

    def events(self) -> list[dict]:
        return [e for kind, m in list(self.messages) if kind == "step" for e in m["events"]]

    def wait_for(self, pred, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"stream never got there; last: {self.messages[-3:]}"
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # unblocks the reader's readline
        except (OSError, AttributeError):
            pass
        self.thread.join(10)  # before closing: the reader must not find its response half torn down
        self.conn.close()


def _get(srv: ServerProcess, path: str, headers: dict = AUTH) -> tuple[int, dict]:
    status, _, body = srv.request("GET", path, headers=headers)
    return status, json.loads(body)


def _snapshot(srv: ServerProcess) -> dict:
    status, snap = _get(srv, "/kv/snapshot")
    assert status == 200, snap
    assert sum(snap["counts"].values()) == snap["num_blocks"] == len(snap["blocks"])
    assert snap["counts"] == snap["engine_counts"]  # per-block states agree with the manager's own counts
    return snap


def _salted_request_freed(reader: "EventStreamReader"):
    def done() -> bool:
        events = reader.events()
        admits = [i for i, e in enumerate(events) if e["ev"] == "admit" and e.get("salt") is not None]
        return bool(admits) and any(e["ev"] == "free" for e in events[admits[0]:])
    return done


def _in_use_metric(srv: ServerProcess) -> float:
    return srv.metric("kvshare:kv_cache_blocks_in_use")


def test_view_endpoints_need_the_key_and_name_unknown_parameters(server):
    for path in ("/kv/snapshot", "/kv/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, hdrs, body = server.request("GET", path, headers=headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (path, headers)
    status, snap = _get(server, "/kv/snapshot")
    assert status == 200 and snap["block_size"] == 16 and snap["requests"] == []
    assert _get(server, "/kv/snapshot?blocks=none")[1]["blocks"] == []
    for path, param in (("/kv/snapshot?block=all", "block"), ("/kv/events?follow=1", "follow"),
                        ("/kv/snapshot?blocks=some", "blocks"), ("/kv/events?queue=0", "queue")):
        status, body = _get(server, path)
        assert status == 400 and body["error"]["param"] == param and param in body["error"]["message"], path
    assert "unknown query parameter 'block'" in _get(server, "/kv/snapshot?block=all")[1]["error"]["message"]


def test_shared_prefix_snapshot_metrics_and_event_stream(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    reader = EventStreamReader(server, AUTH)
    streams = []
    try:
        reader.wait_for(lambda: any(kind == "hello" for kind, _ in reader.messages))
        # Two long-running requests on one long prefix: the second admits on the first's cached blocks.
        ids = []
        for question in (" Question one:", " Question two:"):
            stream = client.completions.create(model=MODEL, prompt=PREFIX + question, max_tokens=300,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            streams.append(stream)
            first = next(iter(stream))  # it runs: its prompt is computed
            ids.append(first.id + "-0")  # the engine's request id for prompt 0
        snap = _snapshot(server)
        live = {r["request_id"]: r for r in snap["requests"]}
        assert set(ids) <= set(live) and all(live[i]["status"] == "running" for i in ids)
        shared = [b for b in snap["blocks"] if b["state"] == "shared"]
        assert shared and all(b["owners"] == sorted(ids) and b["ref_count"] == 2 for b in shared)
        assert sorted(b["position"] for b in shared) == list(range(len(shared)))  # the prefix chain
        assert all(HEX12.match(b["hash"]) and b["last_event"] is not None for b in shared)
        assert live[ids[1]]["cached_tokens"] >= 16 * len(shared)
        assert live[ids[0]]["blocks"] > len(shared) and live[ids[1]]["blocks"] > len(shared)
        # Against /metrics: a reading sandwiched between two equal scrapes (the count only grows
        # while both decode, so it was the same in between).
        for _ in range(30):
            before = _in_use_metric(server)
            snap = _snapshot(server)
            if _in_use_metric(server) == before:
                break
        else:
            pytest.fail("blocks in use never held still for a snapshot")
        assert snap["counts"]["in_use"] + snap["counts"]["shared"] == before
        assert server.metric("kvshare:kv_cache_blocks_total") == snap["num_blocks"]
    finally:
        for s in streams:
            s.close()  # the server aborts both
    server.wait_idle()
    client.completions.create(model=MODEL, prompt="Tenant check", max_tokens=2, temperature=0,
                              extra_body={"cache_salt": "secret-tenant-salt"})
    server.wait_idle()

    snap = _snapshot(server)
    assert snap["counts"]["in_use"] == snap["counts"]["shared"] == 0 and snap["requests"] == []
    assert snap["counts"]["cached"] >= len(shared)
    assert _in_use_metric(server) == 0 and server.metric("vllm:prefix_cache_hits_total") >= 16 * len(shared)

    reader.wait_for(_salted_request_freed(reader))  # the last request: everything before it arrived too
    steps = [m for kind, m in reader.messages if kind == "step"]
    numbers = [m["step"] for m in steps]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)  # one message per step
    assert all(m["dropped"] == 0 for m in steps)
    assert all(e["step"] <= m["step"] for m in steps for e in m["events"])
    kinds = {e["ev"] for e in reader.events()}
    assert {"admit", "alloc", "register", "cache_hit", "incref", "decref", "free", "abort"} <= kinds
    # No prompt content without --log-prompts, and the tenant's salt only as a keyed hash.
    raw = "\n".join(reader.raw)
    assert "secret-tenant-salt" not in raw and "lighthouse" not in raw and '"tokens"' not in raw
    assert all(HEX12.match(e["salt"]) for e in reader.events() if e["ev"] == "admit" and e["salt"])

    # Last client gone: the recorder comes off (blocks keep no last event in later snapshots).
    reader.close()
    deadline = time.monotonic() + 10
    while any(b["last_event"] is not None for b in _snapshot(server)["blocks"]):
        assert time.monotonic() < deadline, "the view's recorder stayed on without a client"
        time.sleep(0.1)


def test_open_event_stream_does_not_hold_up_shutdown(server):
    """Last in this file: it stops the module's server. An event stream is not an in-flight request
    (the drain would wait --shutdown-timeout for it): it ends by itself once draining starts."""
    reader = EventStreamReader(server, AUTH)
    try:
        reader.wait_for(lambda: any(kind == "hello" for kind, _ in reader.messages))
        t0 = time.monotonic()
        assert server.terminate(timeout=20) == 0
        assert time.monotonic() - t0 < 10
        reader.thread.join(5)
        assert not reader.thread.is_alive()  # the server ended the stream
    finally:
        reader.close()


def test_block_states_are_decided_once_and_travel_on_each_block_event():
    """The one state rule (pool_view.block_state) and the events that carry its verdict to the
    dashboard: the page shows the `state` each block event brings (it derives none), so every
    event naming a block must carry the block's state right after it."""
    from kvshare.kvcache.block_pool import BlockPool
    from kvshare.kvcache.events import EventLog
    from kvshare.kvcache.pool_view import STATES, block_state

    assert [block_state(0, False), block_state(0, True), block_state(1, False), block_state(1, True),
            block_state(2, False), block_state(5, True)] == ["free", "cached", "in_use", "in_use", "shared", "shared"]
    assert set(STATES) == {"free", "cached", "in_use", "shared"}

    pool = BlockPool(1)
    log = EventLog()
    tap = ViewTap(log, pool=pool)
    pool.events = tap
    block = pool.allocate("a")
    pool.publish(block, b"h" * 32, (1, 2))
    pool.incref(block, "b")
    pool.decref(block, "b")
    pool.decref(block, "a")  # decref to 0, then free: the hash stays, the block is cached
    pool.allocate("c")  # the one block again: its hash goes (evict), then it is handed out
    assert [(e["ev"], e["state"]) for e in tap.take()] == [
        ("alloc", "in_use"), ("register", "in_use"), ("incref", "shared"), ("decref", "in_use"),
        ("decref", "cached"), ("free", "cached"), ("evict", "free"), ("alloc", "in_use")]
    # The engine's own block log is unchanged: the state is the view's, not the log's.
    assert len(log.recent) == 8 and not any("state" in e for e in log.recent)
