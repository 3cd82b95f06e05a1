"""Server flags that need their own process: --max-waiting, --api-key, --log-prompts,
--request-timeout, and SIGTERM with --shutdown-timeout."""
from __future__ import annotations

import asyncio
import json
import signal
import uuid
from types import SimpleNamespace

import openai
import pytest

from server_proc import MODEL, ServerProcess

KEY = "sk-test-" + uuid.uuid4().hex
PROMPT = "The history of the bicycle begins"


def _aclient(srv: ServerProcess, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=600)


async def _stream(aclient, max_tokens: int, started: asyncio.Event | None = None, **kw):
    """Stream one completion: (text, finish_reason, number of text chunks)."""
    stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}, **kw)
    text, finish, usage = "", None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
            if started is not None:
                started.set()
    return text, finish, usage.completion_tokens if usage else None


# ---- backpressure ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bp_server():
    srv = ServerProcess("--max-waiting", "8", "--max-num-seqs", "2").wait_ready()
    yield srv
    srv.close()


def test_max_waiting_refuses_the_excess_at_once_and_serves_the_rest(bp_server):
    srv = bp_server
    done_order: list[str] = []

    async def one(aclient):
        try:
            r = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True})
            done_order.append("ok")
            return r
        except openai.RateLimitError as e:
            done_order.append("429")
            return e

    async def main():
        aclient = _aclient(srv)
        try:
            return await asyncio.gather(*(one(aclient) for _ in range(30)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(ok) + len(refused) == 30
    assert len(ok) >= 8 and len(refused) >= 1  # the first 8 always fit; 30 at once cannot
    for e in refused:
        assert e.status_code == 429
        assert e.response.headers["retry-after"] == "1"
        err = e.response.json()["error"]
        assert err["code"] == "queue_full" and "--max-waiting 8" in err["message"]
    texts = {r.choices[0].text for r in ok}
    assert len(texts) == 1 and all(r.usage.completion_tokens == 16 for r in ok)
    # Refusals did not wait for room: all of them came back before the admitted work drained.
    last_ok = max(i for i, k in enumerate(done_order) if k == "ok")
    assert all(i < last_ok for i, k in enumerate(done_order) if k == "429")
    # Refused requests never reached the engine: no prompt tokens, no blocks, no outcome.
    assert srv.metric("kvshare:rejected_requests_total", reason="queue_full") == len(refused)
    assert srv.metric("vllm:request_success_total") == len(ok)
    assert srv.metric("vllm:prompt_tokens_total") == len(ok) * ok[0].usage.prompt_tokens
    assert srv.wait_idle()["kvshare:kv_cache_blocks_in_use"] == 0


# ---- API key, prompt logging, request timeout, shutdown timeout -------------------------------

@pytest.fixture(scope="module")
def secure_server():
    # Room for LONG_GENERATION: a request the 3 s timeout cuts short however fast the CPU.
    srv = ServerProcess("--api-key", KEY, "--log-prompts", "--request-timeout", "3",
                        "--shutdown-timeout", "0.5",
                        engine_args=["--kv-cache-memory", "128MiB", "--max-model-len", "4100"]).wait_ready()
    yield srv
    srv.close()


def test_api_key_is_required_on_v1(secure_server):
    srv = secure_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}):
        status, hdrs, body = srv.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers)
        assert status == 401, headers
        assert hdrs["www-authenticate"] == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert srv.request("GET", "/v1/models")[0] == 401
    for path in ("/health", "/ready", "/metrics", "/version"):  # probes stay open
        assert srv.request("GET", path)[0] == 200
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url, api_key="nope", max_retries=0).models.list()
    assert srv.metric("kvshare:rejected_requests_total", reason="unauthorized") >= 6


def test_log_prompts_logs_the_prompt(secure_server):
    marker = f"okapi-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=secure_server.base_url, api_key=KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt=f"Say {marker}", max_tokens=1, temperature=0)
    assert marker in secure_server.log_text()


LONG_GENERATION = 4000  # tokens: a request the 3 s --request-timeout always cuts short


def test_request_timeout_ends_with_finish_reason_timeout(secure_server):
    srv = secure_server
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=300)
    # 4,000 tokens take far longer than 3 s on a CPU (500 did not: ~4 ms a token on a quiet Zen 4
    # finished them in 2 s); the timeout ends the request early.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG_GENERATION, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "timeout"
    assert 0 < r.usage.completion_tokens < LONG_GENERATION
    assert len(r.choices[0].text) > 0

    async def streamed():
        aclient = _aclient(srv, KEY)
        try:
            return await _stream(aclient, LONG_GENERATION)
        finally:
            await aclient.close()

    text, finish, n = asyncio.run(streamed())
    assert finish == "timeout" and 0 < n < LONG_GENERATION and text
    # The engine ends it (its deadline), not the server: a finish reason, not a server abort.
    assert srv.metric("vllm:request_success_total", finished_reason="timeout") == 2
    assert srv.wait_idle()["kvshare:kv_cache_blocks_in_use"] == 0


def test_a_priority_under_fcfs_is_a_400_naming_the_flag(secure_server):
    status, body = secure_server.post_json("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": 1},
                                           {"Authorization": f"Bearer {KEY}"})
    assert status == 400, body
    assert body["error"]["param"] == "priority" and "--scheduling-policy priority" in body["error"]["message"]


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(secure_server):
    srv = secure_server

    async def main():
        aclient = _aclient(srv, KEY)
        started = asyncio.Event()
        task = asyncio.create_task(_stream(aclient, 400, started))
        await started.wait()
        srv.proc.send_signal(signal.SIGTERM)
        result = await task
        await aclient.close()
        return result

    text, finish, n = asyncio.run(main())
    assert finish == "abort" and n < 400
    assert srv.proc.wait(60) == 0
    assert "shutdown timeout: aborted 1 request(s)" in srv.log_text()


# ---- SIGTERM drain ---------------------------------------------------------------------------

def test_sigterm_finishes_in_flight_refuses_new_and_exits_zero():
    srv = ServerProcess("--shutdown-timeout", "300").wait_ready()
    try:
        async def main():
            aclient = _aclient(srv)
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(_stream(aclient, 24, ev)) for ev in started]
            await asyncio.gather(*(ev.wait() for ev in started))
            srv.proc.send_signal(signal.SIGTERM)
            ready = None
            for _ in range(200):  # until the server says it is draining
                ready = await asyncio.to_thread(srv.request, "GET", "/ready")
                if ready[0] == 503:
                    break
                await asyncio.sleep(0.05)
            refused = await asyncio.to_thread(srv.request, "POST", "/v1/completions",
                                              {"prompt": "Hi", "max_tokens": 2})
            health = await asyncio.to_thread(srv.request, "GET", "/health")
            results = await asyncio.gather(*tasks)
            await aclient.close()
            return ready, refused, health, results

        ready, refused, health, results = asyncio.run(main())
        assert ready[0] == 503 and json.loads(ready[2])["status"] == "draining"
        assert refused[0] == 503 and json.loads(refused[2])["error"]["code"] == "shutting_down"
        assert health[0] == 200  # alive while draining
        texts = {r[0] for r in results}
        assert len(texts) == 1 and all(r[1] == "length" and r[2] == 24 for r in results)
        assert srv.proc.wait(120) == 0
    finally:
        srv.close()


# ---- an engine failure's text stays in the log ------------------------------------------------

def test_an_engine_failure_text_reaches_the_log_but_no_response(caplog):
    """A failed step's exception can quote a tenant's salt (a BlockPoolError names the block's
    salt group): /health, /ready and every 503 say the engine failed and where to look, with a
    stable code; only the server log has the text."""
    import httpx2

    from kvshare.kvcache.block_pool import BlockPoolError
    from kvshare.server.app import build_app
    from kvshare.server.async_engine import AsyncEngine
    from kvshare.server.metrics import ServerMetrics
    from kvshare.server.settings import ServerConfig
    from kvshare.server.state import ServerState

    secret = "salt-" + uuid.uuid4().hex

    class FakeLoop:  # the hand-over to the event loop, at once
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    def failing_step():
        raise BlockPoolError(f"block 7 is cached under salt {secret!r} but has ref_count -1")

    engine = SimpleNamespace(layout=SimpleNamespace(num_blocks=8), take_view_events=lambda: None, step_count=3,
                             audit_checks=None,
                             has_unfinished_requests=lambda: True, step=failing_step)
    ae = AsyncEngine(engine, ServerMetrics(MODEL))
    ae._loop = FakeLoop()
    with caplog.at_level("ERROR", logger="kvshare.server"):
        ae._run()  # returns once the step has failed
    assert secret in caplog.text  # the operator has it

    state = ServerState(config=ServerConfig(), engine=ae, metrics=ae.metrics, model_name=MODEL, model_source="m",
                        tokenizer=None, max_model_len=64, max_num_seqs=2)

    async def main():
        transport = httpx2.ASGITransport(app=build_app(state))
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return [await c.get("/health"), await c.get("/ready"), await c.get("/kv/snapshot"),
                    await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})]

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [503] * 4
    for r in replies:
        assert secret not in r.text and "ref_count" not in r.text, r.text
        body = r.json()
        assert body.get("status") == "engine_dead" or body["error"]["code"] == "engine_dead"
        assert "server log" in r.text


# ---- slow clients -------------------------------------------------------------------------------

def test_a_stalled_body_gets_408_and_a_closed_connection_while_a_neighbour_is_served():
    """Slowloris: headers and half a body, then nothing. After --request-body-timeout the client
    gets a 408 in OpenAI's shape and the server closes the connection; a neighbour meanwhile is
    served as usual."""
    import socket
    import time

    deadline = 2.0
    srv = ServerProcess("--request-body-timeout", str(deadline), "--limit-concurrency", "64",
                        "--timeout-keep-alive", "5").wait_ready()
    try:
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
        started = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
        status, _, answer = srv.request("POST", "/v1/completions", json.loads(body), timeout=120)
        assert status == 200 and json.loads(answer)["choices"][0]["finish_reason"] in ("length", "stop")
        reply = b""
        while chunk := slow.recv(65536):  # until the server closes the connection
            reply += chunk
        elapsed = time.monotonic() - started
        slow.close()
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert b"connection: close" in head.lower()
        err = json.loads(payload)["error"]
        assert err["code"] == "request_timeout" and "--request-body-timeout" in err["message"]
        assert deadline * 0.9 <= elapsed < deadline + 30
        # The server is still there for the next client.
        assert srv.request("GET", "/v1/models")[0] == 200
    finally:
        srv.close()


def test_uvicorn_gets_the_connection_limit_and_keep_alive_timeout(monkeypatch):
    from kvshare.server import runner
    from kvshare.server.settings import ServerConfig

    seen = {}

    class CapturingServer:
        def __init__(self, config, state):
            seen["config"] = config

        def run(self, sockets=None):
            pass

    monkeypatch.setattr(runner, "build_app", lambda state: object())
    monkeypatch.setattr(runner, "DrainingServer", CapturingServer)
    runner.serve(SimpleNamespace(config=ServerConfig(limit_concurrency=7, timeout_keep_alive=3.5)))
    assert (seen["config"].limit_concurrency, seen["config"].timeout_keep_alive) == (7, 3.5)
    defaults = ServerConfig()
    assert (defaults.request_body_timeout, defaults.limit_concurrency, defaults.timeout_keep_alive) == (30.0, 1024, 5.0)
    with pytest.raises(ValueError, match="request_body_timeout=0 is invalid"):
        ServerConfig(request_body_timeout=0)
