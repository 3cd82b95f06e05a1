"""Data-parallel serving (issue 14 item 2): `kvshare serve --data-parallel-size 2` runs two real
engine processes behind one front end. The router learns each replica's cache from its KV events,
keeps a tenant's requests on the replica holding its prefix (prefix_aware) or alternates
(round_robin); disconnects reach the replica, 429s reach the client, a SIGKILLed replica fails its
own requests at once while the other keeps serving and leaks no block, SIGTERM drains to exit 0."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import openai
import pytest

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT, token_prompts
from kvshare.kvcache.hashing import BlockHasher
from kvshare.server.prefix_update_subscriber import PrefixUpdateSubscriber
from kvshare.server.routing import Router
from server_proc import MODEL, ServerProcess

DP = ["--data-parallel-size", "2"]
BLOCK = 16
LONG_TOKENS = 120  # long enough that a replica killed mid-load still has all of its requests running
HOLD_TOKENS = 900  # a stream held open while a test checks what its being in flight does (~15 s here)


KEY = "sk-dp-test"


def aclient(srv: ServerProcess, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


def system_prompt(tenant: int) -> str:
    start = 97 * tenant
    return f"You are the assistant of tenant {tenant}. Policy: " + ENGLISH_TEXT[start:start + 900]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def by_engine(srv: ServerProcess, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in srv.metrics():
        if n == name and all(lab.get(k) == x for k, x in labels.items()):
            out[lab.get("engine", "")] = out.get(lab.get("engine", ""), 0.0) + v
    return out


def ready_body(srv: ServerProcess) -> tuple[int, dict]:
    status, _, data = srv.request("GET", "/ready")
    return status, json.loads(data)


# ---- the subscriber, against a real engine's publisher --------------------------------------------

def test_subscriber_rebuilds_a_real_engines_cache_and_the_router_matches_it():
    """Batches published before the subscriber connected come from the replay socket; evictions
    (BlockRemoved) are followed; the router then matches a prompt's cached blocks exactly."""
    llm = LLM(kv_cache_memory=46080 * BLOCK * 60, kv_cache_dtype="float32", kv_events_endpoint="tcp://127.0.0.1:0",
              kv_events_replay_endpoint="tcp://127.0.0.1:0", prefix_caching_hash_seed="dp-test",
              data_parallel_rank=0)
    try:
        pub = llm.engine.prefix_update_publisher
        pool = llm.engine.manager.pool
        tok = llm.get_tokenizer()
        shared = token_prompts(tok.encode, [300], offset_step=11)[0]
        early = [shared + token_prompts(tok.encode, [40 + 8 * i], offset_step=53 + i)[0] for i in range(3)]
        late = token_prompts(tok.encode, [200, 250, 330], offset_step=97) + [shared + [5, 6, 7] * 20]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for p in early:  # published before anyone listens: only the replay socket still has them
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        router = Router(1, block_size=BLOCK, hash_seed="dp-test")

        async def follow():
            import zmq.asyncio

            ctx = zmq.asyncio.Context()
            sub = PrefixUpdateSubscriber(ctx, router.replicas[0], pub.endpoint, pub.replay_endpoint)
            task = asyncio.ensure_future(sub.run())
            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            for p in late:
                await asyncio.to_thread(llm.generate, [{"prompt_token_ids": p}], params, use_tqdm=False)
            deadline = time.monotonic() + 10
            while sub.next_seq != pub._seq and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(linger=0)
            return sub

        sub = asyncio.run(follow())
        assert sub.replayed > 0, "the batches sent before subscribing were not replayed"
        assert sub.next_seq == pub._seq and sub.lost == 0 and sub.foreign == 0
        assert pool.num_evictions > 0  # BlockRemoved events were part of what it followed
        assert router.replicas[0].cached == set(pool.cached)
        hashes = BlockHasher.seeded(BLOCK, "dp-test").prefix_hashes(shared + [1] * 40)
        expected = 0
        for h in hashes:
            if h not in pool.cached:
                break
            expected += 1
        assert expected >= 300 // BLOCK - 2  # the shared prefix, fresh from the last prompt, is still cached
        assert router.matched_blocks(router.replicas[0], hashes) == expected
    finally:
        llm.engine.close()


# ---- prefix-aware front end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefix_server():
    srv = ServerProcess(*DP).wait_ready()
    yield srv
    srv.close()


async def _chat(client, tenant: int, question: str, max_tokens: int = 2):
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": question}])
    return raw.headers["x-kvshare-engine"], raw.parse()


def test_prefix_aware_keeps_each_tenant_on_the_replica_that_caches_it(prefix_server):
    srv = prefix_server
    hits_before = by_engine(srv, "vllm:prefix_cache_hits_total")

    async def main():
        client = aclient(srv)
        try:
            # Tenant 2 arrives while tenant 1's first request runs (its stream is held open until
            # then, whatever the machine's speed): it goes to the idle replica.
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=250, temperature=0, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": system_prompt(1)}, {"role": "user", "content": "Hi?"}])
            stream = raw.parse()
            async for _ in stream:
                break  # a first event: tenant 1's request is routed and running
            home = {1: raw.headers["x-kvshare-engine"], 2: (await _chat(client, 2, "Hello?"))[0]}
            await stream.close()  # aborted there; its prompt's blocks stay cached
            assert home[1] != home[2], home
            # Both replicas' events reached the router before the tenants come back.
            await asyncio.to_thread(wait_for, lambda: all(v >= 10 for v in by_engine(
                srv, "kvshare:router_cached_blocks").values()), 20, "the router to learn both caches")
            later = await asyncio.gather(*(_chat(client, t, f"Question {i} for tenant {t}?")
                                           for i in range(4) for t in (1, 2)))
            return home, later
        finally:
            await client.close()

    home, later = asyncio.run(main())
    for i, (engine, resp) in enumerate(later):
        tenant = (1, 2)[i % 2]
        assert engine == home[tenant], f"tenant {tenant}'s request went to engine {engine}, its prefix is on {home[tenant]}"
        assert resp.usage.prompt_tokens_details.cached_tokens >= 10 * BLOCK
    hits = by_engine(srv, "vllm:prefix_cache_hits_total")
    for engine in home.values():  # the replicas' own counters agree: each served its tenant from cache
        assert hits[engine] - hits_before.get(engine, 0) >= 4 * 10 * BLOCK
    decisions = by_engine(srv, "kvshare:router_decisions_total", reason="prefix")
    assert sum(decisions.values()) >= 8
    assert sum(by_engine(srv, "kvshare:router_prefix_hit_blocks_total").values()) >= 8 * 10


def test_metrics_label_every_replica_series_and_count_routing(prefix_server):
    srv = prefix_server
    routed_before = sum(by_engine(srv, "kvshare:router_routed_requests_total", policy="prefix_aware").values())
    status, _, _ = srv.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Count:", "max_tokens": 1})
    assert status == 200
    status, _, data = srv.request("GET", "/metrics")
    assert status == 200
    text = data.decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family was written twice"
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "kvshare:kv_cache_blocks_in_use",
                 "kvshare:router_routed_requests_total", "kvshare:router_in_flight_requests",
                 "kvshare:router_engine_alive"):
        engines = by_engine(srv, name, model_name=MODEL)
        assert set(engines) == {"0", "1"}, (name, engines)
    routed = by_engine(srv, "kvshare:router_routed_requests_total", policy="prefix_aware")
    assert sum(routed.values()) == routed_before + 1
    assert by_engine(srv, "kvshare:router_engine_alive") == {"0": 1.0, "1": 1.0}
    status, body = ready_body(srv)
    assert status == 200 and body["status"] == "ready" and body["dead_engines"] == []
    assert [e["engine"] for e in body["engines"]] == [0, 1] and body["routing_policy"] == "prefix_aware"
    status, _, data = srv.request("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"


def test_a_client_disconnect_aborts_the_request_on_its_replica(prefix_server):
    srv = prefix_server
    aborted_before = sum(by_engine(srv, "kvshare:aborted_requests_total", reason="client_disconnect").values())

    async def stream_then_leave():
        client = aclient(srv)
        try:
            stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()
        finally:
            await client.close()

    asyncio.run(stream_then_leave())
    # A non-streaming request whose client hangs up while it runs.
    body = json.dumps({"model": MODEL, "prompt": "The weather today", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: sum(by_engine(srv, "kvshare:router_in_flight_requests").values()) == 1, 20,
                 "the request to be routed")
        time.sleep(0.5)
    wait_for(lambda: sum(by_engine(srv, "kvshare:aborted_requests_total", reason="client_disconnect").values())
             >= aborted_before + 2, 30, "both replicas' client_disconnect aborts")
    wait_for(lambda: sum(by_engine(srv, "kvshare:kv_cache_blocks_in_use").values()) == 0
             and sum(by_engine(srv, "kvshare:router_in_flight_requests").values()) == 0, 30,
             "no block held and nothing in flight")


# ---- round robin, backpressure -------------------------------------------------------------------

@pytest.fixture(scope="module")
def rr_server():
    # max-model-len 1024: a held stream (HOLD_TOKENS) runs for many seconds on any machine.
    srv = ServerProcess(*DP, "--routing-policy", "round_robin", "--max-num-seqs", "2", "--max-waiting", "1",
                        "--api-key", KEY, engine_args=["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
                        ).wait_ready()
    yield srv
    srv.close()


def test_round_robin_alternates_behind_the_api_key(rr_server):
    srv = rr_server
    status, _, data = srv.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    engines = []
    for i in range(4):
        status, headers, data = srv.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": system_prompt(3) + f" Question {i}", "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200, data
        engines.append(headers["x-kvshare-engine"])
    assert engines in (["0", "1", "0", "1"], ["1", "0", "1", "0"])
    # Each replica serves the socket the front end bound for it (no race for a free port).
    assert srv.log_text().count("socket fd") == 2


def test_the_front_end_forwards_only_its_own_routes_and_openapi_behind_the_key(rr_server):
    """Before the fix /v1/models/../../kv/snapshot (as sent, or with %2e) reached a replica's KV
    view through the front end, and /openapi.json was a 404 where a single server served it."""
    srv = rr_server
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/models/../../kv/snapshot", "/v1/models/%2e%2e/%2E%2E/kv/snapshot", "/v1/models/.%2e/.%2e/kv/events"):
        status, headers, data = srv.request("GET", path, headers=auth)
        assert status == 404 and "x-kvshare-engine" not in headers, (path, data[:300])
    status, headers, data = srv.request("GET", f"/v1/models/{MODEL}", headers=auth)
    assert status == 200 and json.loads(data)["id"] == MODEL
    assert srv.request("GET", "/openapi.json")[0] == 401
    status, _, data = srv.request("GET", "/openapi.json", headers=auth)
    assert status == 200 and "/v1/completions" in json.loads(data)["paths"]


def test_429s_reach_the_client(rr_server):
    """2 engines x (2 running + 1 waiting): with 6 streams held open, the front end refuses the
    next requests itself (429 queue_full, Retry-After), however fast the machine is."""
    srv = rr_server

    def total(name: str) -> float:
        return sum(by_engine(srv, name).values())

    async def hold(client):
        return await client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=HOLD_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})

    async def one(client):
        try:
            return await client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=4, temperature=0)
        except openai.RateLimitError as e:
            return e

    async def main():
        client = aclient(srv, KEY)
        held = []
        try:
            # One at a time, each running (or, the last two, waiting) before the next is sent: an
            # engine refuses a request itself while another still waits to be scheduled there.
            for k in range(1, 7):
                held.append(asyncio.ensure_future(hold(client)))
                running, waiting = min(k, 4), max(0, k - 4)
                await asyncio.to_thread(wait_for, lambda: total("vllm:num_requests_running") == running
                                        and total("vllm:num_requests_waiting") == waiting, 60,
                                        f"{running} streams running, {waiting} waiting")
            assert total("kvshare:router_in_flight_requests") == 6
            return await asyncio.gather(*(one(client) for _ in range(8)))
        finally:
            for task in held:
                task.cancel()
            for stream in await asyncio.gather(*held, return_exceptions=True):
                if not isinstance(stream, BaseException):
                    await stream.close()
            await client.close()

    refused_before = sum(by_engine(srv, "kvshare:rejected_requests_total", reason="queue_full").values())
    results = asyncio.run(main())
    assert all(isinstance(r, openai.RateLimitError) for r in results), results
    for e in results:
        assert e.status_code == 429 and e.response.headers["retry-after"]
        assert e.response.json()["error"]["code"] == "queue_full"
    assert sum(by_engine(srv, "kvshare:rejected_requests_total", reason="queue_full").values()) == refused_before + 8
    wait_for(lambda: total("kvshare:router_in_flight_requests") == 0, 30, "the held streams to be released")
    # The front end releases a stream when its client closes it; the replica aborts it a step
    # later: until then a new request could still find a replica's waiting slot taken.
    wait_for(lambda: total("vllm:num_requests_running") == 0 and total("vllm:num_requests_waiting") == 0, 30,
             "the replicas to abort the held streams")
    status, _, data = srv.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                                  headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, data


# ---- a replica dies; then the front end drains ---------------------------------------------------

def test_a_killed_replica_fails_its_requests_and_the_other_keeps_serving():
    srv = ServerProcess(*DP, "--routing-policy", "round_robin").wait_ready()
    try:
        status, body = ready_body(srv)
        assert status == 200 and body["status"] == "ready"
        victim = body["engines"][1]

        async def one(client, i: int):
            try:
                raw = await client.completions.with_raw_response.create(
                    model=MODEL, prompt=f"Story number {i}:", max_tokens=LONG_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})
                return raw.headers["x-kvshare-engine"], raw.parse()
            except openai.APIError as e:
                return None, e

        async def streamed(client):
            try:
                stream = await client.completions.create(model=MODEL, prompt="A long tale:", max_tokens=LONG_TOKENS,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                         stream_options={"include_usage": True})
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                return "stream", usage  # None if the stream ended early without an error
            except openai.APIError as e:
                return None, e

        async def main():
            client = aclient(srv)
            try:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(6)]
                tasks += [asyncio.ensure_future(streamed(client)) for _ in range(2)]
                await asyncio.to_thread(wait_for, lambda: by_engine(srv, "vllm:num_requests_running").get("1", 0) > 0
                                        and by_engine(srv, "vllm:generation_tokens_total").get("1", 0) > 0, 30,
                                        "engine 1 to be generating")
                import os
                os.kill(victim["pid"], signal.SIGKILL)
                # Every request ends (answer or error) well within the timeout: none hangs.
                return await asyncio.wait_for(asyncio.gather(*tasks), 90)
            finally:
                await client.close()

        results = asyncio.run(main())
        failed = [r for _, r in results if isinstance(r, Exception)]
        served = [(e, r) for e, r in results if not isinstance(r, Exception)]
        assert failed, "killing engine 1 mid-load failed none of its requests"
        for e in failed:
            assert "engine 1" in str(e) and "killed by SIGKILL" in str(e), e
        for engine, r in served:  # everything that did not fail is whole, wherever it ran
            assert engine in ("0", "stream"), engine
            usage = r.usage if engine == "0" else r
            assert usage is not None and usage.completion_tokens == LONG_TOKENS
        # Round robin gave engine 0 half of them (more if a request that never reached engine 1
        # was sent on to it); all of those were served.
        assert len(served) >= 4 and len(failed) + len(served) == 8
        status, body = ready_body(srv)
        assert status == 200 and body["status"] == "degraded" and body["dead_engines"] == [1]
        assert body["engines"][1]["status"] == "dead" and "SIGKILL" in body["engines"][1]["detail"]
        # New requests go to the survivor only.
        for i in range(3):
            status, headers, data = srv.request("POST", "/v1/completions",
                                                {"model": MODEL, "prompt": f"After {i}", "max_tokens": 2})
            assert status == 200 and headers["x-kvshare-engine"] == "0", data
        # The survivor holds no block once idle: nothing leaked by the failed neighbour's requests.
        wait_for(lambda: by_engine(srv, "kvshare:kv_cache_blocks_in_use").get("0") == 0
                 and by_engine(srv, "vllm:num_requests_running").get("0") == 0
                 and sum(by_engine(srv, "kvshare:router_in_flight_requests").values()) == 0, 30,
                 "the survivor to be idle with no block in use")
        assert by_engine(srv, "kvshare:router_engine_alive") == {"0": 1.0, "1": 0.0}
        assert by_engine(srv, "kvshare:router_failed_requests_total", reason="replica_died").get("1", 0) >= 1

        # SIGTERM with a request in flight: it completes, the survivor drains, the front end exits 0.
        async def drain():
            client = aclient(srv)
            try:
                task = asyncio.ensure_future(one(client, 99))
                await asyncio.to_thread(wait_for, lambda: by_engine(srv, "vllm:num_requests_running").get("0", 0)
                                        > 0, 20, "the request to run")
                srv.proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(task, 60)
            finally:
                await client.close()

        engine, r = asyncio.run(drain())
        assert engine == "0" and r.usage.completion_tokens == LONG_TOKENS
        assert srv.proc.wait(60) == 0
    finally:
        srv.close()


# ---- the front end's plumbing, without servers ---------------------------------------------------

def test_replica_endpoints_are_offset_by_rank_as_in_vllm():
    from kvshare.server.data_parallel import connect_endpoint, offset_endpoint

    assert offset_endpoint("tcp://*:5557", 1, "--kv-events-endpoint") == "tcp://*:5558"
    assert connect_endpoint("tcp://*:5558") == "tcp://127.0.0.1:5558"
    assert connect_endpoint("tcp://10.0.0.2:5558") == "tcp://10.0.0.2:5558"
    assert offset_endpoint("ipc:///tmp/kv", 2, "--kv-events-endpoint") == "ipc:///tmp/kv.2"
    with pytest.raises(ValueError, match=r"--kv-events-endpoint 'tcp://127.0.0.1:0' is invalid with "
                                         r"--data-parallel-size: give tcp://HOST:PORT with an explicit port"):
        offset_endpoint("tcp://127.0.0.1:0", 0, "--kv-events-endpoint")


def test_cpus_and_threads_are_split_between_replicas():
    import os

    from kvshare.server.data_parallel import split_cpus

    cpus = sorted(os.sched_getaffinity(0))
    shares = split_cpus(2, None)
    assert [t for t, _ in shares] == [max(1, len(cpus) // 2)] * 2
    if len(cpus) >= 2:
        assert set(shares[0][1]).isdisjoint(shares[1][1])
    assert [t for t, _ in split_cpus(2, 2)] == [1, 1]  # OMP_NUM_THREADS=2 is the budget of both together
    assert all(cpu is None for _, cpu in split_cpus(len(cpus) + 1, None))  # fewer CPUs than replicas: no pinning


def test_replica_command_line_passes_the_users_flags_and_sets_its_own():
    from kvshare.cli import build_parser
    from kvshare.server.cli import replica_argv

    parser = build_parser()
    args = parser.parse_args(["serve", "-dp", "2", "--port", "9000", "--max-model-len", "512", "--audit",
                              "--api-key", "k", "--kv-events-endpoint", "tcp://*:5557", "--routing-policy",
                              "round_robin", "--api-key-file", "/keys.txt", "--admin-key", "adm",
                              "--cache-salt-from-api-key"])
    serve = args.func.keywords["parser"]
    argv = replica_argv(serve, args, {"port": 9100, "kv_events_endpoint": "tcp://*:5558"})
    assert argv[:4] == ["--cache-salt-from-api-key", "--max-model-len", "512", "--audit"]
    assert argv[4:] == ["--port", "9100", "--kv-events-endpoint", "tcp://*:5558"]
    # The keys travel in the environment (kvshare.server.tenants.REPLICA_AUTH_ENV), not where `ps` shows them.
    assert "k" not in argv and "adm" not in argv and "/keys.txt" not in argv


def test_the_hash_seed_reaches_replicas_through_the_environment_not_their_command_line(monkeypatch):
    """Other users read command lines (ps, /proc/PID/cmdline): the seed a router hashes with is not
    on a replica's; its environment (readable by its user only) carries it."""
    import subprocess

    import kvshare.server.data_parallel as dp
    from kvshare.cli import build_parser
    from kvshare.engine_args import HASH_SEED_ENV
    from kvshare.server.replica import ReplicaLaunch, ReplicaProcess

    seen = {}

    def fake_serve(config, options, argv, model):
        seen["options"], seen["argv"] = options, argv(1, 9101, "ipc://e", "ipc://r")
        return 0

    monkeypatch.setattr(dp, "serve_data_parallel", fake_serve)
    monkeypatch.delenv(HASH_SEED_ENV, raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", "-dp", "2", "--prefix-caching-hash-seed", "seed-on-the-cli",
                              "--kv-cache-memory", "16MiB"])
    assert args.func(args) == 0
    assert seen["options"].hash_seed == "seed-on-the-cli"
    assert not any("seed" in a for a in seen["argv"]), seen["argv"]

    started = {}

    class FakePopen:
        def __init__(self, cmd, env, **_kw):
            started["cmd"], started["env"] = cmd, env
            self.pid, self.stdout = 1, iter(())

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    ReplicaProcess(ReplicaLaunch(1, 9101, seen["argv"], "ipc://e", "ipc://r", 1, None, None,
                                 hash_seed="seed-on-the-cli")).start()
    assert started["env"][HASH_SEED_ENV] == "seed-on-the-cli" and "seed-on-the-cli" not in started["cmd"]
    # The replica's parser takes it from there.
    monkeypatch.setenv(HASH_SEED_ENV, "seed-on-the-cli")
    replica = build_parser().parse_args(["serve", *seen["argv"]])
    assert replica.prefix_caching_hash_seed == "seed-on-the-cli"


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size 0 is invalid: must be >= 1"),
    (["-dp", "2", "--kv-events-endpoint", "tcp://127.0.0.1:0"], "--kv-events-endpoint 'tcp://127.0.0.1:0' is invalid"),
])
def test_bad_data_parallel_flags_name_the_flag(argv, message, capsys):
    from kvshare.cli import main

    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_front_end_refuses_bad_requests_itself_in_openais_shape(prefix_server):
    srv = prefix_server
    status, body = srv.post_json("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = srv.post_json("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, _, data = srv.request("GET", "/v1/completions")
    assert status == 405 and "not allowed" in json.loads(data)["error"]["message"]
    status, _, data = srv.request("GET", "/kv/snapshot")
    assert status == 404 and "its url is in /ready" in json.loads(data)["error"]["message"]
    status, body = srv.post_json("/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found"  # the replica's answer, passed through
    status, _, data = srv.request("GET", "/v1/models")
    assert status == 200 and json.loads(data)["data"][0]["id"] == MODEL


def test_batches_of_another_rank_are_ignored():
    """Every replica's batches carry its data_parallel_rank (as vLLM's do); a subscriber that gets
    another rank's events (a misconfigured endpoint) does not believe them."""
    import zmq.asyncio

    from kvshare.engine.prefix_update_publisher import encode_batch
    from kvshare.kvcache.prefix_updates import BlockStored

    def batch(rank: int, h: bytes) -> bytes:
        return encode_batch([BlockStored((h,), None, tuple(range(BLOCK)), BLOCK)], 0.0, rank)

    async def main():
        ctx = zmq.asyncio.Context()
        router = Router(2, block_size=BLOCK, hash_seed="s")
        sub = PrefixUpdateSubscriber(ctx, router.replicas[1], "tcp://127.0.0.1:1")  # nothing publishes there
        await sub._accept(0, batch(0, b"a" * 32))
        await sub._accept(1, batch(1, b"b" * 32))
        ctx.destroy(linger=0)
        return router, sub

    router, sub = asyncio.run(main())
    assert router.replicas[1].cached == {b"b" * 32}
    assert sub.foreign == 1 and sub.batches == 1 and sub.next_seq == 2


def test_a_replica_whose_engine_thread_stopped_is_marked_dead_and_the_request_goes_on():
    """A replica process can outlive its engine thread: it then answers 503 engine_dead. The front
    end (driven in-process here, its replicas' HTTP answers scripted) marks it dead and sends the
    request to another replica, where it has not run yet."""
    import httpx2

    from kvshare.server.data_parallel import DataParallelOptions, FrontendState, build_frontend_app
    from kvshare.server.dp_metrics import RouterMetrics
    from kvshare.server.replica import ReplicaLaunch, ReplicaProcess
    from kvshare.server.settings import ServerConfig

    replicas = [ReplicaProcess(ReplicaLaunch(i, 41000 + i, [], "ipc://unused", "ipc://unused", 1, None, None))
                for i in range(2)]
    asked = []

    def replica_http(request: httpx2.Request) -> httpx2.Response:
        asked.append(request.url.port)
        if request.url.port == 41000:
            return httpx2.Response(503, json={"error": {
                "message": "the engine loop has stopped (RuntimeError: boom); restart the server",
                "type": "server_error", "param": None, "code": "engine_dead"}})
        return httpx2.Response(200, json={"object": "text_completion", "choices": []})

    state = FrontendState(config=ServerConfig(), options=DataParallelOptions(2, "least_loaded", BLOCK, "s"),
                          metrics=RouterMetrics(MODEL, 2, "least_loaded"), router=Router(2, "least_loaded"),
                          replicas=replicas, tokenizer=None, model_name=MODEL)
    app = build_frontend_app(state, [])

    async def main():
        state.client = httpx2.AsyncClient(transport=httpx2.MockTransport(replica_http))
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost") as c:
            answer = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            again = await c.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 1})
            ready = await c.get("/ready")
        await state.client.aclose()
        return answer, again, ready

    answer, again, ready = asyncio.run(main())
    assert answer.status_code == 200 and answer.headers["x-kvshare-engine"] == "1"
    assert again.status_code == 200 and again.headers["x-kvshare-engine"] == "1"
    assert asked == [41000, 41001, 41001]  # engine 0 was asked once, then never again
    body = ready.json()
    assert ready.status_code == 200 and body["status"] == "degraded" and body["dead_engines"] == [0]
    assert "engine thread stopped" in body["engines"][0]["detail"] and "boom" in body["engines"][0]["detail"]
    assert state.metrics.failed[0]["engine_dead"] == 1 and state.metrics.routed == [0, 2]


# ---- supervision, against stand-in replica processes (tests/fake_replica.py) ----------------------

def _fake_replicas(n: int, *flags: str):
    """n running stand-in replicas (ReplicaProcess objects with their process set) on their ports;
    `flags` are the first one's (tests/fake_replica.py)."""
    import subprocess
    import sys
    from pathlib import Path

    from kvshare.server.replica import ReplicaLaunch, ReplicaProcess

    script = str(Path(__file__).with_name("fake_replica.py"))
    procs = [subprocess.Popen([sys.executable, script, *(flags if i == 0 else ())], stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    replicas = []
    for i, proc in enumerate(procs):
        word, port = proc.stdout.readline().split()  # blocks until it is bound: no guessing how long
        assert word == "listening"
        rep = ReplicaProcess(ReplicaLaunch(i, int(port), [], "ipc://unused", "ipc://unused", 1, None, None))
        rep.proc = proc
        replicas.append(rep)
    return replicas


def _frontend(replicas, policy: str = "least_loaded", **state_fields):
    from kvshare.server.data_parallel import DataParallelOptions, FrontendState, build_frontend_app
    from kvshare.server.dp_metrics import RouterMetrics
    from kvshare.server.settings import ServerConfig

    n = len(replicas)
    state = FrontendState(config=ServerConfig(), options=DataParallelOptions(n, policy, BLOCK, "s"),
                          metrics=RouterMetrics(MODEL, n, policy), router=Router(n, policy),
                          replicas=replicas, tokenizer=None, model_name=MODEL, **state_fields)
    return state, build_frontend_app(state, [])


def test_a_stuck_replica_is_killed_and_its_requests_fail_while_the_other_serves():
    """A replica process that stops answering (SIGSTOP: alive, accepting connections, answering
    nothing) is found by the poller after `stuck_polls` timed-out polls and SIGKILLed: the request
    that was waiting on it fails with 502 engine_failed within a bound, new ones go to the other."""
    import os

    import httpx2

    from kvshare.server.data_parallel import new_upstream_client, start_background

    replicas = _fake_replicas(2)
    state, app = _frontend(replicas, poll_seconds=0.1, poll_timeout=0.5, stuck_polls=3)

    async def main():
        state.client = new_upstream_client()
        tasks = start_background(state, [])
        try:
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost",
                                          timeout=60) as c:
                first = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
                os.kill(replicas[0].pid, signal.SIGSTOP)
                started = time.monotonic()
                stuck = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
                waited = time.monotonic() - started
                after = [await c.post("/v1/completions", json={"prompt": [3], "max_tokens": 1}) for _ in range(2)]
                ready = await c.get("/ready")
            return first, stuck, waited, after, ready
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.client.aclose()

    try:
        first, stuck, waited, after, ready = asyncio.run(main())
        reaped = replicas[0].proc.returncode  # set by a wait/poll: the front end reaped it (no zombie)
    finally:
        for rep in replicas:
            rep.kill_and_wait()
    assert first.status_code == 200 and first.headers["x-kvshare-engine"] == "0"
    assert stuck.status_code == 502, stuck.text
    error = stuck.json()["error"]
    assert error["code"] == "engine_failed" and "engine 0" in error["message"] and "stuck" in error["message"]
    assert waited < 10, f"the request to the stuck replica took {waited:.1f}s to fail"
    assert [(r.status_code, r.headers["x-kvshare-engine"]) for r in after] == [(200, "1"), (200, "1")]
    body = ready.json()
    assert body["status"] == "degraded" and body["dead_engines"] == [0] and "SIGKILL" in body["engines"][0]["detail"]
    assert reaped == -signal.SIGKILL
    assert state.metrics.failed[0]["replica_died"] == 1


def test_a_connect_timeout_sends_the_request_to_another_replica_and_passthroughs_are_not_load():
    """A replica that cannot be connected to in time never got the request: it goes to the other
    replica (counted connection_failed, not replica_died). A /tokenize waiting on a replica is not
    a request in flight there (it takes no sequence slot)."""
    import httpx2

    from kvshare.server.replica import ReplicaLaunch, ReplicaProcess

    replicas = [ReplicaProcess(ReplicaLaunch(i, 41000 + i, [], "ipc://unused", "ipc://unused", 1, None, None))
                for i in range(2)]
    state, app = _frontend(replicas)
    tokenize_arrived, tokenize_go = asyncio.Event(), asyncio.Event()

    async def replica_http(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/tokenize":
            tokenize_arrived.set()
            await tokenize_go.wait()
            return httpx2.Response(200, json={"tokens": [1]})
        if request.url.port == 41000:
            raise httpx2.ConnectTimeout("timed out", request=request)
        return httpx2.Response(200, json={"object": "text_completion", "choices": []})

    async def main():
        state.client = httpx2.AsyncClient(transport=httpx2.MockTransport(replica_http))
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost") as c:
            answer = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            tokenizing = asyncio.ensure_future(c.post("/tokenize", json={"prompt": "x"}))
            await tokenize_arrived.wait()
            load = [r.in_flight for r in state.router.replicas]
            tokenize_go.set()
            tokenized = await tokenizing
        await state.client.aclose()
        return answer, load, tokenized

    answer, load, tokenized = asyncio.run(main())
    assert answer.status_code == 200 and answer.headers["x-kvshare-engine"] == "1"
    assert state.metrics.failed[0]["connection_failed"] == 1 and state.metrics.failed[0]["replica_died"] == 0
    assert load == [0, 0] and tokenized.status_code == 200
    assert [r.in_flight for r in state.router.replicas] == [0, 0]


def test_prefix_aware_routes_by_load_when_prefix_caching_is_off():
    from kvshare.server.data_parallel import DataParallelOptions, build_router

    assert build_router(DataParallelOptions(2, "prefix_aware", BLOCK, "s"), None).policy == "prefix_aware"
    router = build_router(DataParallelOptions(2, "prefix_aware", BLOCK, "s", max_num_seqs=4, prefix_caching=False), 2)
    assert router.policy == "least_loaded" and router.replica_limit == 6
    prompt = list(range(100))
    first = router.route(prompt)
    router.replicas[first.index].in_flight += 1
    router.replicas[first.index].hold(first.block_hashes)
    # With nothing cached, the blocks held in flight would have pulled the same prompt to the same replica.
    assert router.route(prompt).index != first.index


def test_pooled_connections_expire_well_before_the_replicas_keep_alive():
    """A connection the replica closes (uvicorn's keep-alive timeout) just as the front end reuses
    it fails a request that never reached the replica: the pool drops idle connections first."""
    import uvicorn

    from kvshare.server.data_parallel import KEEPALIVE_EXPIRY_SECONDS, new_upstream_client

    replica_keep_alive = uvicorn.Config(app=None).timeout_keep_alive  # runner.serve keeps uvicorn's default
    assert KEEPALIVE_EXPIRY_SECONDS <= replica_keep_alive / 2
    client = new_upstream_client()
    assert client._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_SECONDS


def test_malformed_kv_event_batches_are_skipped_and_a_failed_subscription_clears_the_view():
    """Bad payloads published on a replica's events socket (not msgpack, the wrong shape, an
    unknown event tag) are skipped one by one: the batch after them is applied. A subscription
    whose socket fails clears the replica's cached set (no stale affinity) and raises."""
    import zmq
    import zmq.asyncio

    from kvshare.engine.prefix_update_publisher import encode_batch
    from kvshare.kvcache.prefix_updates import BlockStored

    def good(h: bytes) -> bytes:
        return encode_batch([BlockStored((h,), None, tuple(range(BLOCK)), BLOCK)], 0.0, 0)

    async def main():
        import msgpack

        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        router = Router(1, block_size=BLOCK, hash_seed="s")
        sub = PrefixUpdateSubscriber(ctx, router.replicas[0], f"tcp://127.0.0.1:{port}")
        task = asyncio.ensure_future(sub.run())
        bad = [b"\xc1 not msgpack", msgpack.packb(7), msgpack.packb([0.0, [["NoSuchEvent", 1]], 0])]
        seq = 0
        deadline = time.monotonic() + 10
        while sub.malformed == 0:  # ZMQ's slow joiner: send until the subscription is up
            assert time.monotonic() < deadline and not task.done(), "the subscriber never received a batch"
            await pub.send_multipart((b"", seq.to_bytes(8, "big", signed=True), bad[0]))
            seq += 1
            await asyncio.sleep(0.02)
        for payload in bad[1:] + [good(b"g" * 32)]:
            await pub.send_multipart((b"", seq.to_bytes(8, "big", signed=True), payload))
            seq += 1
        while sub.next_seq != seq:
            assert time.monotonic() < deadline and not task.done(), (sub.next_seq, seq, task)
            await asyncio.sleep(0.02)
        alive_after_bad_batches = not task.done()
        cached_after = set(router.replicas[0].cached)

        class BrokenSocket:  # the subscription's socket failing (e.g. the context terminated)
            async def recv_multipart(self):
                raise zmq.ZMQError(zmq.ETERM)

            def close(self, linger=None):
                pass

        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        broken = PrefixUpdateSubscriber(ctx, router.replicas[0], f"tcp://127.0.0.1:{port}")
        broken._sub.close(0)
        broken._sub = BrokenSocket()
        with pytest.raises(zmq.ZMQError):
            await broken.run()
        pub.close(0)
        ctx.destroy(linger=0)
        return sub, broken, alive_after_bad_batches, cached_after

    sub, broken, alive, cached_after = asyncio.run(main())
    assert alive, "a malformed batch ended the subscription"
    assert sub.malformed >= 3 and sub.batches == 1 and cached_after == {b"g" * 32}
    assert broken.failed and broken.replica.cached == set()  # nothing stale left to route by


def test_a_replica_whose_front_end_is_gone_before_it_starts_exits_at_once():
    """The replica asks for SIGTERM on its parent's death in its first lines (no preexec_fn in the
    threaded front end); a parent that died before that sends no signal, which the replica
    notices (its parent is not the pid it was given) and exits, before importing anything heavy."""
    import os
    import subprocess
    import sys

    from kvshare.server.replica import PARENT_ENV, REPLICA_BOOT

    not_my_parent = os.getpid() + 1_000_000  # no process has it: the replica's parent is this test
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", REPLICA_BOOT, "serve"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **{PARENT_ENV: str(not_my_parent)}))
    assert proc.returncode == 1 and f"front end (pid {not_my_parent}) exited before it started" in proc.stderr
    assert time.monotonic() - started < 10 and "Traceback" not in proc.stderr


def test_a_replica_retired_alive_is_killed_after_a_grace_and_reaped():
    """A replica whose engine thread stopped (its /health says engine_dead) is marked dead and sent
    SIGTERM; one that ignores it is SIGKILLed after `retire_grace` and reaped (no zombie left)."""
    from kvshare.server.data_parallel import new_upstream_client, start_background

    replicas = _fake_replicas(2, "--engine-dead", "--ignore-sigterm")
    state, _app = _frontend(replicas, poll_seconds=0.1, retire_grace=0.5)

    async def main():
        state.client = new_upstream_client()
        tasks = start_background(state, [])
        try:
            deadline = time.monotonic() + 20
            while replicas[0].proc.returncode is None:  # set once reaped (by exit_code's poll)
                assert time.monotonic() < deadline, "the retired replica was never killed and reaped"
                await asyncio.sleep(0.05)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.client.aclose()

    try:
        asyncio.run(main())
    finally:
        for rep in replicas:
            rep.kill_and_wait()
    assert replicas[0].proc.returncode == -signal.SIGKILL  # SIGTERM was ignored: it took the SIGKILL
    assert state.live() == [1] and "engine thread stopped" in state.dead_detail[0]


def test_the_exit_status_says_when_replicas_were_killed_or_all_died():
    from kvshare.server.data_parallel import exit_status

    replicas = [object(), object()]
    state, _app = _frontend(replicas)
    assert exit_status(state) == 0
    state.mark_dead(0, "killed by SIGKILL")
    assert exit_status(state) == 0  # one engine still served
    state.mark_dead(1, "killed by SIGKILL")
    assert exit_status(state) == 1
    state, _app = _frontend(replicas)
    state.draining = True
    state.mark_dead(0, "exited with code 0")  # drained: not a death
    state.mark_dead(1, "exited with code 0")
    assert exit_status(state) == 0
    state.killed_after_drain.append(1)
    assert exit_status(state) == 1


def test_a_stream_whose_upstream_fails_to_close_still_releases_its_slot():
    """The request's in-flight slot is released however the passed-through stream ends, even when
    closing the upstream response raises (it would otherwise count as load forever)."""
    import httpx2

    from kvshare.server.dp_proxy import Proxy

    released = []

    class Upstream:
        status_code = 200
        headers = httpx2.Headers({"content-type": "text/event-stream"})

        async def aiter_raw(self):
            yield b"data: {}\n\n"

        async def aclose(self):
            raise RuntimeError("closing failed")

    replicas = [object()]
    state, _app = _frontend(replicas)
    response = Proxy(state)._respond(Upstream(), 0, lambda: released.append(True))
    sent = []

    async def receive():
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        sent.append(message)

    async def main():
        with pytest.raises(RuntimeError, match="closing failed"):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    assert released == [True]
    assert any(m.get("body") == b"data: {}\n\n" for m in sent)


def test_the_front_end_refuses_too_many_prompts_before_validating_them():
    """The front end parses a body to route it: with its --max-sequences-per-request the prompt
    count is checked before any of them is validated (800k one-token prompts held its interpreter
    for seconds before the replica's 400), and the 400 is the replica's."""
    from kvshare.errors import InvalidRequestError
    from kvshare.server.dp_proxy import prompt_for_routing
    from kvshare.server.settings import ServerConfig

    body = json.dumps({"prompt": [[7]] * 3, "max_tokens": 1}).encode()
    with pytest.raises(InvalidRequestError) as refused:
        prompt_for_routing(None, None, body, chat=False, config=ServerConfig(max_sequences_per_request=2))
    assert refused.value.param == "prompt" and "--max-sequences-per-request" in str(refused.value)
    ids, _ = prompt_for_routing(None, None, body, chat=False, config=ServerConfig(max_sequences_per_request=3))
    assert ids == [7]
