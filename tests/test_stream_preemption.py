"""Streaming under preemption, and clients that leave before the engine has their request.

A real server whose KV pool holds two of the requests below at a time: streamed together they
preempt each other (recompute), and what each stream says must be what the same request says
alone and non-streamed: the same text, the same tokens one by one (nothing repeated after a
recompute, nothing lost), the same count in usage, the same finish reason. And a client that
hangs up while its request waits to be added (the engine thread busy with a long prefill) or
while its grammar compiles leaves nothing behind: no running or waiting request, no KV block
held, and the server serves the next request.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import openai
import pytest
from prometheus_client import generate_latest

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.server.async_engine import AsyncEngine, EngineRequest
from kvshare.server.metrics import ServerMetrics
from server_proc import MODEL, ServerProcess, parse_metrics

BLOCK_SIZE = 16
POOL_BLOCKS = 14
MAX_TOKENS = 40
# A recomputed row goes through the prefill path, a batched one may share a step with prompt
# rows: in the default mode its bfloat16 prefill GEMMs (CPUs with avx512_bf16) magnify float32
# summation-order differences so that a chosen-token logprob moves by up to 0.1 (tests/helpers.py,
# default_mode_logprob_tolerance). The tokens must not move: every completion prompt below goes on
# by copying a line it has seen three times, so each greedy token leads its runner-up by more
# than 1.0 logprob (measured in the default mode), far beyond that noise; ordinary English text
# has near ties (leads of 0.001-0.1) within 32 tokens, which that noise flips.
LOGPROB_TOL = 0.1
IDLE = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0,
        "kvshare:kv_cache_blocks_in_use": 0}


def _repeated_line(start: int) -> str:
    return (" ".join(ENGLISH_TEXT.split()[start:start + 12]) + "\n") * 3


COMPLETIONS = [
    {"prompt": _repeated_line(30), "temperature": 0},
    {"prompt": _repeated_line(120), "temperature": 0},
    {"prompt": _repeated_line(240), "temperature": 0, "n": 2},
    {"prompt": _repeated_line(210), "temperature": 0.7, "seed": 1234, "n": 2},
]
# tests/test_server.py's question whose answer leads by >= 1.0 logprob at every token.
CHAT = {"messages": [{"role": "user", "content": "Name the capital of France."}], "temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def tight_server():
    """A server in the default mode whose pool holds POOL_BLOCKS blocks: each request below holds
    3-4 blocks of prompt and grows to 6-7, so two fit at a time and five streamed together
    preempt each other. The bfloat16 KV cache (the default mode's on avx512_bf16) is named so the
    pool holds as many blocks on any CPU."""
    kv_bytes_per_token = 30 * 3 * 64 * 2 * 2  # bundled model: layers x KV heads x dims x (K, V) x bytes
    srv = ServerProcess(engine_args=["--kv-cache-dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
                                     "--kv-cache-memory", str(kv_bytes_per_token * BLOCK_SIZE * POOL_BLOCKS),
                                     "--max-model-len", "128"]).wait_ready()
    yield srv
    srv.close()


def _completion_choices_alone(client, body: dict) -> tuple[dict, dict]:
    r = client.completions.create(model=MODEL, max_tokens=MAX_TOKENS, logprobs=1, extra_body={"ignore_eos": True},
                                  **body)
    choices = {c.index: {"text": c.text, "tokens": c.logprobs.tokens, "logprobs": c.logprobs.token_logprobs,
                         "finish": [c.finish_reason]} for c in r.choices}
    return choices, r.usage


def _completion_choices_streamed(client, body: dict) -> tuple[dict, dict]:
    stream = client.completions.create(model=MODEL, max_tokens=MAX_TOKENS, logprobs=1, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **body)
    choices, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"text": "", "tokens": [], "logprobs": [], "finish": []})
            got["text"] += c.text
            if c.logprobs is not None:
                got["tokens"] += c.logprobs.tokens
                got["logprobs"] += c.logprobs.token_logprobs
            if c.finish_reason is not None:
                got["finish"].append(c.finish_reason)
    return choices, usage


def _chat_choices(client, stream: bool) -> tuple[dict, dict]:
    kw = dict(model=MODEL, logprobs=True, **CHAT)
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return {0: {"text": c.message.content, "tokens": [e.token for e in c.logprobs.content],
                    "logprobs": [e.logprob for e in c.logprobs.content], "finish": [c.finish_reason]}}, r.usage
    choices, usage = {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"text": "", "tokens": [], "logprobs": [], "finish": []})
            got["text"] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                got["tokens"] += [e.token for e in c.logprobs.content]
                got["logprobs"] += [e.logprob for e in c.logprobs.content]
            if c.finish_reason is not None:
                got["finish"].append(c.finish_reason)
    return choices, usage


def test_streamed_deltas_under_preemption_equal_the_request_alone(tight_server):
    srv = tight_server
    assert srv.metric("kvshare:kv_cache_blocks_total") == POOL_BLOCKS
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
    # Each request alone and non-streamed first: the pool holds any one of them whole.
    alone = [_completion_choices_alone(client, body) for body in COMPLETIONS] + [_chat_choices(client, stream=False)]
    assert srv.metric("vllm:num_preemptions_total") == 0

    streamed: list = [None] * len(alone)

    def run(i: int) -> None:
        streamed[i] = (_completion_choices_streamed(client, COMPLETIONS[i]) if i < len(COMPLETIONS)
                       else _chat_choices(client, stream=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(alone))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert srv.metric("vllm:num_preemptions_total") > 0, "the streams should have preempted each other"

    for i, ((ref, ref_usage), got) in enumerate(zip(alone, streamed)):
        assert got is not None, f"request {i} did not finish"
        choices, usage = got
        assert sorted(choices) == sorted(ref) == list(range(len(ref))), i
        for index, want in ref.items():
            have = choices[index]
            where = f"request {i} choice {index}"
            assert have["text"] == want["text"], where
            assert have["tokens"] == want["tokens"], where
            assert len(have["tokens"]) == len(have["logprobs"]), where
            if i < len(COMPLETIONS):  # the token strings are the text's pieces (chat's last is the end of turn)
                assert "".join(have["tokens"]) == have["text"], where
            assert len(have["finish"]) == 1 and have["finish"] == want["finish"], where
            worst = max(abs(a - b) for a, b in zip(have["logprobs"], want["logprobs"]))
            assert worst <= LOGPROB_TOL, (where, worst)
        assert usage is not None, i
        streamed_tokens = sum(len(c["tokens"]) for c in choices.values())
        assert usage.completion_tokens == ref_usage.completion_tokens == streamed_tokens, i
        if i < len(COMPLETIONS):  # ignore_eos: every choice runs to max_tokens
            assert usage.completion_tokens == MAX_TOKENS * len(ref), i
        assert usage.prompt_tokens == ref_usage.prompt_tokens, i
    assert srv.wait_idle() == IDLE


# ---- clients that leave before the engine has their request -----------------------------------

@pytest.fixture(scope="module")
def busy_server():
    """Room for a 1,000-token prompt in one prefill step: while that step runs (seconds on two
    cores) the engine thread takes no command, so a request sent meanwhile waits to be added."""
    srv = ServerProcess(engine_args=["--kv-cache-memory", "64MiB", "--max-model-len", "1100",
                                     "--max-num-batched-tokens", "1024"]).wait_ready()
    yield srv
    srv.close()


def _send_and_hang_up_once_logged(srv: ServerProcess, body: dict, marker: str) -> float:
    """POST body on a raw socket and close it as soon as the server has logged the request (it
    logs each request once its body is parsed, before the grammar compile and the add); the
    seconds from sending to closing."""
    logged = srv.log_text().count(marker)
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sent = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    deadline = sent + 120
    while srv.log_text().count(marker) == logged and time.monotonic() < deadline:
        time.sleep(0.005)
    sock.close()
    return time.monotonic() - sent


def _finished(srv: ServerProcess, reason: str) -> float:
    return srv.metric("vllm:request_success_total", finished_reason=reason)


def _serves_normally(srv: ServerProcess) -> None:
    status, body = srv.post_json("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                     "ignore_eos": True})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_while_its_request_waits_to_be_added_leaves_nothing(busy_server, stream):
    srv = busy_server
    rng = random.Random(stream)
    aborted, generated = _finished(srv, "abort"), srv.metric("vllm:generation_tokens_total")
    # The neighbour: a fresh 1,000-token prompt (no prefix-cache hit), prefilled in one step.
    neighbour: dict = {}

    def run_neighbour() -> None:
        neighbour["reply"] = srv.post_json("/v1/completions", {
            "prompt": [rng.randrange(1000, 40000) for _ in range(1000)], "max_tokens": 1})
        neighbour["done"] = time.monotonic()

    t = threading.Thread(target=run_neighbour)
    t.start()
    deadline = time.monotonic() + 120
    while (srv.metric("vllm:num_requests_waiting") + srv.metric("vllm:num_requests_running") == 0
           and "reply" not in neighbour and time.monotonic() < deadline):
        time.sleep(0.01)
    # 32 prompts that would each run 317 tokens: queued behind the neighbour's prefill step.
    prompts = [[rng.randrange(1000, 40000) for _ in range(8)] for _ in range(32)]
    _send_and_hang_up_once_logged(srv, {"prompt": prompts, "max_tokens": 317, "ignore_eos": True, "stream": stream},
                                  "max_tokens=317")
    left = time.monotonic()
    t.join(300)
    assert neighbour["reply"][0] == 200, neighbour["reply"]
    # The premise: the client was gone before the engine thread finished the step it was in.
    assert neighbour["done"] > left, "the neighbour's prefill ended before the client left; make it longer"

    assert srv.wait_idle() == IDLE
    assert _finished(srv, "abort") - aborted == len(prompts)  # every prompt added, then aborted
    assert srv.metric("vllm:generation_tokens_total") - generated < len(prompts) * 317
    _serves_normally(srv)
    assert "Traceback" not in srv.log_text()


def _big_schema(tag: str, branches: int = 800) -> dict:
    """A valid JSON schema that takes llguidance a measurable time to compile (0.3 s and more for
    800 branches of 10 properties); `tag` keeps it out of the compile cache."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}_{j}": {"type": "integer"} for j in range(10)},
                       "required": [f"{tag}{i}_0"]} for i in range(branches)]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_while_its_grammar_compiles_leaves_nothing(busy_server, stream):
    srv = busy_server
    tag = f"s{int(stream)}x{random.randrange(10**6)}_"

    def structured(schema: dict, max_tokens: int) -> dict:
        return {"prompt": "A JSON object:", "max_tokens": max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}

    # The premise: how long a twin of the schema takes from sending to the answer, compile included.
    started = time.monotonic()
    status, body = srv.post_json("/v1/completions", structured(_big_schema("twin" + tag), 1))
    twin_seconds = time.monotonic() - started
    assert status == 200, body

    before = {r: _finished(srv, r) for r in ("stop", "length", "abort")}
    prompt_tokens = srv.metric("vllm:prompt_tokens_total")
    hung_up_after = _send_and_hang_up_once_logged(srv, {**structured(_big_schema(tag), 319), "stream": stream},
                                                  "max_tokens=319")
    assert hung_up_after < twin_seconds, "the client should have left while its grammar compiled"

    # The same schema from a client that stays: answered once a compile of it is done, as long as
    # the first one's (or that one itself, where a compile in flight is shared), so by then the
    # request whose client left has met its fate: it never reaches the engine, or is aborted there.
    status, body = srv.post_json("/v1/completions", structured(_big_schema(tag), 4))
    assert status == 200, body
    time.sleep(0.5)
    assert srv.wait_idle() == IDLE
    deltas = {r: _finished(srv, r) - v for r, v in before.items()}
    deltas[body["choices"][0]["finish_reason"]] -= 1  # the second request's own
    assert deltas["stop"] == deltas["length"] == 0, deltas
    assert deltas["abort"] == 1 or (deltas["abort"] == 0 and srv.metric("vllm:prompt_tokens_total") == prompt_tokens
                                    + body["usage"]["prompt_tokens"]), deltas
    _serves_normally(srv)
    assert "Traceback" not in srv.log_text()


# ---- a handler cancelled while its add is queued (AsyncEngine.submit's CancelledError path) ------

@pytest.fixture
def engine_thread():
    """An AsyncEngine around a real engine, its thread started on the test's event loop."""
    engine = LLM(kv_cache_memory="16MiB", max_model_len=256).engine
    ae = AsyncEngine(engine, ServerMetrics("m"))
    yield ae
    ae.stop(timeout=30)


async def _assert_nothing_left(ae: AsyncEngine) -> None:
    """Polled on the engine thread (queued behind every earlier command): no request left, not
    even one owing its final output, and no KV block held."""
    def idle() -> bool:
        return not ae.engine.has_unfinished_requests() and ae.engine.manager.num_used_blocks() == 0

    deadline = time.monotonic() + 60
    while not await ae.call(idle):
        assert time.monotonic() < deadline, "the engine should go idle"
        await asyncio.sleep(0.01)
    assert ae._streams == {} and ae._tracks == {} and ae._shared.pending == 0


def _metric(ae: AsyncEngine, name: str) -> float:
    text = generate_latest(ae.metrics.registry(ae.metrics_snapshot)).decode()
    return sum(v for n, _, v in parse_metrics(text) if n == name)


async def _serves_the_next(ae: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    stream = await ae.submit([EngineRequest("after", [1, 2, 3, 4], params)], time.monotonic())
    out = await stream.get()
    while not out.finished:
        out = await stream.get()
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_a_handler_cancelled_before_the_engine_takes_its_add_adds_nothing(engine_thread):
    ae = engine_thread
    release = threading.Event()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        ae.start(asyncio.get_running_loop())
        ae.post(lambda: release.wait(60))  # the engine thread is busy until released
        task = asyncio.create_task(ae.submit([EngineRequest("gone", [5, 6, 7, 8], params)], time.monotonic()))
        while ae._shared.pending != 1:  # the add is queued
            await asyncio.sleep(0.005)
        # Queued behind the engine thread's work, it waits: /metrics says so.
        assert _metric(ae, "vllm:num_requests_waiting") == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await _assert_nothing_left(ae)
        assert _metric(ae, "vllm:num_requests_waiting") == 0
        m = ae.metrics  # never added: nothing computed, nothing finished, nothing to abort
        assert (m.prompt_tokens, m.generation_tokens, sum(m.success.values()), sum(m.aborted.values())) == (0, 0, 0, 0)
        await _serves_the_next(ae)

    asyncio.run(main())


def test_a_handler_cancelled_while_the_engine_adds_it_is_aborted(engine_thread):
    ae = engine_thread
    adding, go = threading.Event(), threading.Event()
    add_request = ae.engine.add_request

    def slow_add(request_id, *args, **kwargs):  # the engine thread, in the middle of the add
        adding.set()
        go.wait(60)
        return add_request(request_id, *args, **kwargs)

    ae.engine.add_request = slow_add
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    requests = [EngineRequest(f"gone-{i}", [5, 6, 7, 8 + i], params) for i in range(3)]

    async def main():
        ae.start(asyncio.get_running_loop())
        task = asyncio.create_task(ae.submit(requests, time.monotonic()))
        await asyncio.to_thread(adding.wait, 60)
        task.cancel()  # too late to take the add back: it must be aborted once made
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await _assert_nothing_left(ae)
        m = ae.metrics  # all three added, then aborted long before max_tokens
        assert m.success == {**dict.fromkeys(m.success, 0), "abort": len(requests)}
        assert m.aborted["client_disconnect"] == 1 and m.generation_tokens < len(requests) * 200
        await _serves_the_next(ae)

    asyncio.run(main())
