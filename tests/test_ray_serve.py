"""kvshare on Ray Serve (kvshare.ray): a real local Ray cluster on loopback, the application with
two replicas of the bundled model, real HTTP requests through Serve's proxy with the official
openai client. The routing shown: each tenant's requests land on the replica that caches its
system prompt, and the router's view of each replica's cache (from its KV events) is the
replica's own."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import time
import types
import urllib.error
import urllib.request

import openai
import pytest
import ray  # in the test extra: a missing ray is a broken setup, not a skip

from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.ray import build_app, parse_app_args

BLOCK = 16
MODEL = "SmolLM2-135M-Instruct"
LATER_TENANTS = (1, 1, 2, 2, 1, 2)
KEY = "sk-ray-test"
APP_ARGS = {"api_key": KEY, "num_replicas": "2", "max_num_seqs": "4", "kv_cache_memory": "24MiB", "max_model_len": "1024",
            "num_cpus_per_replica": "1", "max_body_bytes": "64KiB"}
BODY_LIMIT = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(tenant: int) -> str:
    start = 97 * tenant
    return f"You are the assistant of tenant {tenant}. Policy: " + ENGLISH_TEXT[start:start + 900]


def get_json(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_app():
    """A local Ray cluster on loopback (2 CPUs, a small object store), Serve's HTTP proxy on a
    free loopback port, and the application deployed with two engine replicas."""
    from ray import serve

    # A single-node cluster entirely on loopback: otherwise Ray takes the machine's routable
    # address as its node IP (its own servers, and the replicas' KV event sockets, which bind on
    # the node IP as they would on a multi-machine cluster). This process read Ray's constants at
    # import, so it is told the IP; the Ray processes started below read the variable at their
    # import. Restored when the fixture ends, so no other test module sees it.
    with pytest.MonkeyPatch.context() as env:
        if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ:
            env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        yield from _cluster(serve)


def _cluster(serve):
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False,
             configure_logging=False, _node_ip_address="127.0.0.1")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(APP_ARGS), name="kvshare", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get_json(base + "/ready")[1].get("status") == "ready", 120, "both replicas to be ready")
        yield base
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def client(base: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def engines(base: str) -> dict[int, dict]:
    status, body = get_json(base + "/ready", KEY)
    assert status == 200 and body["status"] == "ready", body
    return {row["rank"]: row for row in body["engines"]}


async def _chat(c, tenant: int, question: str, max_tokens: int = 2):
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": question}])
    return raw.headers["x-kvshare-engine"], raw.parse()


def test_openai_endpoints_through_serve(ray_app):
    async def main():
        c = client(ray_app)
        try:
            models = await c.models.list()
            assert [m.id for m in models.data] == [MODEL]
            raw = await c.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is",
                                                               max_tokens=4, temperature=0)
            comp = raw.parse()
            assert raw.headers["x-kvshare-engine"] in ("0", "1")
            assert comp.usage.completion_tokens == 4 and comp.choices[0].text
            # A question whose first 5 greedy tokens each lead their runner-up by > 2 logprob in the
            # default mode: the second request may take the other engine, or reuse the first's
            # cached prompt, which rounds its last bits differently ("Say hi" leads by 0.006 and
            # flipped; benchmarks/answer_margins.py).
            ask = [{"role": "user", "content": "What is the capital of Japan?"}]
            stream = await c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                                                     messages=ask)
            pieces, finish = [], None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            chat = await c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=ask)
            # Greedy: the stream and the whole answer are the same text.
            assert "".join(pieces) == chat.choices[0].message.content and finish == "length"
            with pytest.raises(openai.BadRequestError) as bad:
                await c.completions.create(model=MODEL, prompt="x", max_tokens=-1)
            assert bad.value.body["param"] == "max_tokens"
        finally:
            await c.close()

    async def wrong_key():
        c = client(ray_app, key="sk-wrong")
        try:
            with pytest.raises(openai.AuthenticationError):
                await c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        finally:
            await c.close()

    asyncio.run(main())
    asyncio.run(wrong_key())
    status, health = get_json(ray_app + "/health")
    assert status == 200 and health["status"] == "ok"


def post(url: str, body: bytes, key: str | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST, errors included."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_the_ingress_refuses_oversized_bodies_and_missing_keys_itself(ray_app):
    """Answered by the ingress (no replica's x-kvshare-engine header): an oversized body is not
    read whole nor tokenized, an unauthorized call to a passthrough route costs no replica a call."""
    prompt = "x " * BODY_LIMIT
    big = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    status, headers, body = post(ray_app + "/v1/completions", big, KEY)
    assert status == 413 and "x-kvshare-engine" not in {k.lower() for k in headers}, (status, body)
    assert body["error"]["message"] == (f"the request body is {len(big)} bytes; the limit is {BODY_LIMIT} bytes "
                                        f"(max_body_bytes)")
    status, headers, _ = post(ray_app + "/tokenize", json.dumps({"model": MODEL, "prompt": prompt}).encode(), KEY)
    assert status == 413 and "x-kvshare-engine" not in {k.lower() for k in headers}
    for path in ("/tokenize", "/detokenize"):
        status, headers, body = post(ray_app + path, json.dumps({"model": MODEL, "prompt": "hi", "tokens": [1]}).encode())
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
        assert "x-kvshare-engine" not in {k.lower() for k in headers}
    status, body = get_json(ray_app + "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, headers, body = post(ray_app + "/tokenize", json.dumps({"model": MODEL, "prompt": "hi"}).encode(), KEY)
    assert status == 200 and body["count"] >= 1 and "x-kvshare-engine" in {k.lower() for k in headers}


def test_ready_shows_details_only_with_the_key(ray_app):
    # Without the key: whether each replica answers, nothing about what it caches or serves.
    status, body = get_json(ray_app + "/ready")
    assert status == 200 and body == {"status": "ready", "replicas": 2,
                                      "engines": [{"rank": 0, "status": "ready"}, {"rank": 1, "status": "ready"}]}
    assert get_json(ray_app + "/ready", "sk-wrong")[1] == body
    # The key is parsed as `kvshare serve` parses it: the scheme in any case, the token trimmed.
    req = urllib.request.Request(ray_app + "/ready", headers={"Authorization": f"bearer  {KEY} "})
    with urllib.request.urlopen(req, timeout=30) as resp:
        rows = json.loads(resp.read())["engines"]
    assert [r["rank"] for r in rows] == [0, 1] and all("cached_digest" in r and r["router"] for r in rows)


def test_prefix_aware_routing_keeps_each_tenant_on_its_replica(ray_app):
    async def main():
        c = client(ray_app)
        try:
            # Tenant 2 arrives while tenant 1's first request runs: it goes to the idle replica.
            # Tenant 1's is streamed and held open (its first chunk came: it was routed and runs),
            # long enough (ignore_eos) that it cannot end before tenant 2's is routed, short
            # enough that its ~225 prompt tokens plus these fit the 24 MiB pool (~540 tokens with a
            # float32 cache, ~1,090 with the default mode's bfloat16 one on avx512_bf16 CPUs).
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=280, temperature=0, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": system_prompt(1)}, {"role": "user", "content": "Hi?"}])
            t1_stream = raw.parse()
            try:
                await t1_stream.__anext__()
                home = {1: raw.headers["x-kvshare-engine"], 2: (await _chat(c, 2, "Hello?"))[0]}
            finally:
                await t1_stream.close()  # the replica aborts it; its prompt's blocks stay cached
            assert home[1] != home[2], home
            # The router learns both caches from the replicas' events: its view is theirs, block for block.
            await asyncio.to_thread(wait_for, lambda: all(
                e["router"]["cached_digest"] == e["cached_digest"] and e["cached_blocks"] >= 10
                for e in engines(ray_app).values()), 30, "the router's view to match both replicas' caches")
            # An order that round-robin (or any alternation) would scatter over both replicas.
            later = await asyncio.gather(*(_chat(c, t, f"Question {i} for tenant {t}?")
                                           for i, t in enumerate(LATER_TENANTS)))
            return home, later
        finally:
            await c.close()

    before = engines(ray_app)
    home, later = asyncio.run(main())
    for tenant, (engine, resp) in zip(LATER_TENANTS, later):
        assert engine == home[tenant], f"tenant {tenant}'s request went to engine {engine}, its prefix is on {home[tenant]}"
        assert resp.usage.prompt_tokens_details.cached_tokens >= 10 * BLOCK
    after = wait_for(lambda: (lambda e: e if all(x["router"]["cached_digest"] == x["cached_digest"]
                                                 for x in e.values()) else None)(engines(ray_app)),
                     30, "the router's view to match again")
    for tenant, engine in home.items():  # the replicas' own counters: each served its tenant from cache
        rank = int(engine)
        hits = after[rank]["prefix_cache_hits"] - before[rank]["prefix_cache_hits"]
        assert hits >= 3 * 10 * BLOCK, (tenant, hits)
        assert after[rank]["router"]["lost_batches"] == 0
    assert sum(e["router"]["decisions"].get("prefix", 0) for e in after.values()) >= 6


def replayed_events(endpoint: str) -> list:
    """Every event a replica still buffers, from its replay socket (kvshare.engine.prefix_update_publisher)."""
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
        events = []
        while True:
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return events
            events.extend(msgpack.unpackb(payload, raw=False)[1])
    finally:
        sock.close(0)


def test_replica_kv_events_carry_no_token_ids(ray_app):
    """The event sockets are unauthenticated on the node's network: what anyone there can read is
    block hashes, never a tenant's prompt (the routing test shows the router needs nothing more)."""
    async def main():
        c = client(ray_app)
        try:
            return await _chat(c, 4, "Hi?")
        finally:
            await c.close()

    engine, _ = asyncio.run(main())
    row = engines(ray_app)[int(engine)]
    stored = [e for e in replayed_events(row["kv_events_replay_endpoint"]) if e[0] == "BlockStored"]
    assert len(stored) >= 10  # tenant 4's system prompt alone is more than 10 blocks
    assert all(len(e) == 7 and e[3] == [] and len(e[1][0]) == 32 for e in stored), stored[0]


@dataclasses.dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def fake_router():
    """kvshare's Serve request router without Serve: two followed replicas of ranks 0 and 1 (fake
    ids, no event endpoints yet), called as Serve calls it."""
    from kvshare.ray.request_router import KVSharePrefixRouter, _Followed
    from kvshare.server.routing import ReplicaState

    router = KVSharePrefixRouter.__new__(KVSharePrefixRouter)  # Serve's own __init__ needs a deployment
    router.initialize_state(block_size=BLOCK, hash_seed="s1")
    a, b = FakeReplicaID("a"), FakeReplicaID("b")
    for rank, rid in enumerate((a, b)):
        router._followed[rid] = _Followed(ReplicaState(rank), rid.unique_id)
    replicas = [types.SimpleNamespace(replica_id=rid, routing_stats={}) for rid in (a, b)]
    return router, a, b, replicas


PROMPT = list(range(100, 100 + 4 * BLOCK))


def pending(request_id: str, prompt: list[int] = PROMPT):
    """What Serve hands choose_replicas and on_request_routed for one call."""
    return types.SimpleNamespace(metadata=types.SimpleNamespace(internal_request_id=request_id),
                                 kwargs={"route": {"token_ids": prompt, "cache_salt": None}},
                                 routing_context=types.SimpleNamespace(should_backoff=False))


def test_a_late_completion_from_a_replica_that_refused_does_not_end_the_retry_s_count():
    """Serve's hook order when replica A refuses a request (at max_ongoing_requests) and the retry
    goes to B under the same internal request id: A's on_request_completed can come after the
    retry was chosen, and even after it was routed. No cluster: the router's methods, called as
    Serve calls them, with fake replicas."""
    router, a, b, replicas = fake_router()

    def in_flight() -> tuple[int, int]:
        return router._followed[a].state.in_flight, router._followed[b].state.in_flight

    async def main():
        pr = pending("req-1")
        first = await router.choose_replicas(replicas, pr)
        assert first[0][0].replica_id == a  # both idle and empty: the lowest rank
        # A refused. Serve asks again, and A's completion arrives between the choice and the routing.
        await router.choose_replicas(replicas, pr)
        router.on_request_completed(a, "req-1")
        router.on_request_routed(pr, b, None)  # the retry went to the next in the list
        assert in_flight() == (0, 1)
        assert router._followed[b].state.pending  # the prompt's blocks count as held on B
        router.on_request_completed(a, "req-1")  # A's completion once more, later still
        assert in_flight() == (0, 1)
        # Another request, which Serve sent to A, is counted there apart from req-1.
        other = pending("req-2")
        await router.choose_replicas(replicas, other)
        router.on_request_routed(other, a, None)
        assert in_flight() == (1, 1)
        router.on_request_completed(b, "req-1")
        assert in_flight() == (1, 0) and not router._followed[b].state.pending
        router.on_request_completed(a, "req-2")
        assert in_flight() == (0, 0) and not router._in_flight

    asyncio.run(main())


def test_a_request_s_prompt_is_hashed_once_however_often_serve_asks():
    router, a, _, replicas = fake_router()
    hasher = router._router.hasher
    calls = []
    real = hasher.prefix_hashes
    hasher.prefix_hashes = lambda *args: calls.append(args) or real(*args)

    async def main():
        pr = pending("req-1")
        for _ in range(3):  # no replica could take it: Serve backs off and asks again
            await router.choose_replicas(replicas, pr)
        assert len(calls) == 1
        router.on_request_routed(pr, a, None)
        assert router._followed[a].state.pending and not router._prompt_hashes
        # Another prompt under the same id (a second call while serving one ingress request): hashed anew.
        other = pending("req-1", PROMPT[:2 * BLOCK])
        decision_hashes = len(calls)
        await router.choose_replicas(replicas, other)
        assert len(calls) == decision_hashes + 1

    asyncio.run(main())


def test_a_failed_event_subscription_is_logged_and_made_again(monkeypatch, caplog):
    import kvshare.ray.request_router as rr

    made = []

    class Subscriber:  # the first subscription fails as a broken socket would; the next one runs
        def __init__(self, *args) -> None:
            made.append(self)

        async def run(self) -> None:
            if len(made) == 1:
                raise OSError("socket gone")
            await asyncio.Event().wait()

    monkeypatch.setattr(rr, "PrefixUpdateSubscriber", Subscriber)
    monkeypatch.setattr(rr, "RESUBSCRIBE_DELAY_S", 0.0)
    router, a, _, _ = fake_router()
    followed = router._followed[a]
    followed.kv_events_endpoint = "tcp://127.0.0.1:1"

    async def main():
        router._follow_events()
        first = followed.task
        with pytest.raises(OSError):
            await first  # its done-callback ran before this await returned (registered first)
        assert followed.task is None and followed.subscriber is None
        router._follow_events()  # the next routing subscribes again
        assert len(made) == 2 and followed.subscriber is made[1] and not followed.task.done()
        followed.task.cancel()

    with caplog.at_level("ERROR", logger="kvshare.ray"):
        asyncio.run(main())
    assert "KV event subscription of replica rank 0 (a) on tcp://127.0.0.1:1 ended (OSError: socket gone)" in caplog.text


def test_bad_application_options_name_the_option():
    with pytest.raises(ValueError, match="unknown option 'num_replica'.*allowed are num_replicas"):
        parse_app_args({"num_replica": "2"})
    with pytest.raises(ValueError, match="max_num_seqs='many' is invalid: must be an integer"):
        parse_app_args({"max_num_seqs": "many"})
    with pytest.raises(ValueError, match="kv_events_endpoint is set by the application"):
        parse_app_args({"kv_events_endpoint": "tcp://127.0.0.1:5557"})
    with pytest.raises(ValueError, match="kv_events_token_ids is set by the application"):
        parse_app_args({"kv_events_token_ids": "true"})
    with pytest.raises(ValueError, match="routing_policy='nearest' is invalid: allowed are prefix_aware"):
        parse_app_args({"routing_policy": "nearest"})
    opts = parse_app_args({"num_replicas": "3", "kv_cache_memory": "64MiB", "enable_prefix_caching": "true"})
    assert opts.num_replicas == 3 and opts.engine == {"kv_cache_memory": "64MiB", "enable_prefix_caching": True}


def test_a_client_that_leaves_mid_stream_aborts_its_request_on_the_replica(ray_app):
    async def main():
        c = client(ray_app)
        try:
            stream = await c.completions.create(model=MODEL, prompt="Tell a very long story.", max_tokens=400,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
            received = 0
            async for _chunk in stream:
                received += 1
                if received == 3:
                    break
            await stream.close()  # closes the connection: Serve cancels the call, the replica aborts
        finally:
            await c.close()

    def disconnects() -> int:
        return sum(e["aborted"].get("client_disconnect", 0) for e in engines(ray_app).values())

    async def impatient():  # not streamed: the client gives up before the whole answer is ready
        c = client(ray_app)
        try:
            call = asyncio.ensure_future(c.completions.create(
                model=MODEL, prompt="Tell a very long story.", max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True}))
            # Given up once the replica runs it (not after a guessed time, which a fast machine
            # could outrun and a slow one could hit before the request reached the replica).
            await asyncio.to_thread(wait_for, lambda: sum(e["running"] for e in engines(ray_app).values()) == 1,
                                    30, "the replica to run the request")
            assert not call.done()
            call.cancel()  # closes the connection: Serve cancels the call, the replica aborts
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            await c.close()

    before = disconnects()
    asyncio.run(main())
    # The replica's own count: the request was aborted because its client left (not run to its end).
    wait_for(lambda: disconnects() == before + 1, 15, "the replica to abort the streamed request")
    asyncio.run(impatient())
    wait_for(lambda: disconnects() == before + 2, 15, "the replica to abort the request whose client timed out")
    wait_for(lambda: all(e["running"] == 0 and e["router"]["in_flight"] == 0 for e in engines(ray_app).values()),
             15, "the request to be gone from the replica and from the router's count")


@pytest.mark.slow
def test_a_killed_replica_fails_its_stream_serve_replaces_it_and_the_router_follows_the_new_one(ray_app):
    """Last in this file: it kills one of the fixture's replicas."""
    async def main():
        c = client(ray_app)
        try:
            raw = await c.completions.with_raw_response.create(
                model=MODEL, prompt="Tell a very long story.", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            rank, replica_id = raw.headers["x-kvshare-engine"], raw.headers["x-kvshare-replica"]
            stream = raw.parse()
            received = 0
            with pytest.raises(openai.APIError, match="engine replica failed while serving this request"):
                async for _chunk in stream:
                    received += 1
                    if received == 3:
                        actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                                     if a["name"].endswith(f"#{replica_id}"))
                        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            # The other replica (and soon the replacement) serves on.
            answers = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=3)
                                             for i in range(4)))
            assert all(a.usage.completion_tokens == 3 for a in answers)
            return int(rank), replica_id
        finally:
            await c.close()

    rank, dead = asyncio.run(main())

    def replaced():
        status, body = get_json(ray_app + "/ready", KEY)
        if status != 200 or body["status"] != "ready":
            return None
        rows = {row["rank"]: row for row in body["engines"]}
        return rows if rank in rows and rows[rank]["replica_id"] != dead else None

    rows = wait_for(replaced, 180, f"Serve to replace the killed replica of rank {rank}")
    new = rows[rank]
    assert new["router"]["following"] == new["kv_events_endpoint"]  # the new replica's events, not the dead one's
    async def one_more():
        c = client(ray_app)
        try:
            await _chat(c, 3, "Hi?")
        finally:
            await c.close()

    asyncio.run(one_more())
    wait_for(lambda: all(e["router"]["cached_digest"] == e["cached_digest"] for e in engines(ray_app).values()),
             30, "the router's view to match both replicas, the new one included")


def test_serve_run_app_reads_its_options_from_the_environment(monkeypatch):
    import kvshare.ray

    monkeypatch.setenv("KVSHARE_RAY_NUM_REPLICAS", "3")
    monkeypatch.setenv("KVSHARE_RAY_MAX_NUM_SEQS", "6")
    app = kvshare.ray.app  # what `serve run kvshare.ray:app` looks up
    # The ingress is bound to the engine deployment (Ray's Application internals, pinned 2.60.0).
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.num_replicas == 3 and engine.max_ongoing_requests == 12  # 6 running + 6 waiting
    # The replicas' engine options; seed None: each replica draws its own root (as kvshare serve)
    assert engine.init_args[0] == {"max_num_seqs": 6, "seed": None}
    monkeypatch.setenv("KVSHARE_RAY_SEED", "5")
    assert kvshare.ray.app._bound_deployment.init_args[0]._bound_deployment.init_args[0]["seed"] == 5
    monkeypatch.delenv("KVSHARE_RAY_SEED")
    # The request limits reach the ingress too, so its routing parse stops where a replica's would.
    monkeypatch.setenv("KVSHARE_RAY_MAX_SEQUENCES_PER_REQUEST", "8")
    monkeypatch.setenv("KVSHARE_RAY_MAX_TOOLS_BYTES", "2KiB")
    limits = kvshare.ray.app._bound_deployment.init_kwargs["server_config"]
    assert limits.max_sequences_per_request == 8 and limits.max_tools_bytes == 2048
    monkeypatch.delenv("KVSHARE_RAY_MAX_SEQUENCES_PER_REQUEST")
    monkeypatch.delenv("KVSHARE_RAY_MAX_TOOLS_BYTES")
    monkeypatch.setenv("KVSHARE_RAY_MAX_NUM_SEQ", "6")
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'"):
        kvshare.ray.app  # noqa: B018


def test_the_api_key_comes_from_the_environment_as_for_kvshare_serve(monkeypatch):
    """Not from serve run's command line, which every user of the machine can read (ps)."""
    import kvshare.ray

    monkeypatch.delenv("KVSHARE_RAY_API_KEY", raising=False)
    monkeypatch.setenv("KVSHARE_API_KEY", "sk-from-env")
    assert parse_app_args({}).server["api_key"] == "sk-from-env"
    assert parse_app_args({"api_key": "sk-given"}).server["api_key"] == "sk-given"  # an explicit key wins
    ingress = kvshare.ray.app._bound_deployment  # Ray's Application internals, pinned 2.60.0
    assert ingress.init_kwargs["api_key"] == "sk-from-env"
    assert ingress.init_args[0]._bound_deployment.init_args[1] == {"api_key": "sk-from-env"}  # the replicas check it too
    monkeypatch.setenv("KVSHARE_RAY_API_KEY", "sk-ray")  # kvshare.ray:app's own variable wins
    assert kvshare.ray.app._bound_deployment.init_kwargs["api_key"] == "sk-ray"
    # Empty is an error, as for kvshare serve (it used to mean no key: authentication off).
    with pytest.raises(ValueError, match="api_key is empty"):
        parse_app_args({"api_key": ""})  # as KVSHARE_RAY_API_KEY="" gives it
    monkeypatch.setenv("KVSHARE_API_KEY", "")
    monkeypatch.delenv("KVSHARE_RAY_API_KEY")
    with pytest.raises(ValueError, match="KVSHARE_API_KEY is set but empty"):
        parse_app_args({})
    monkeypatch.delenv("KVSHARE_API_KEY")
    assert "api_key" not in parse_app_args({}).server
