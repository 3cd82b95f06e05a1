"""Issue 32 over HTTP: a request's `timeout` and `priority` body fields on `kvshare serve
--scheduling-policy priority --request-timeout S`; a deadline ends a request with the partial
output and finish_reason "timeout", or 408 when nothing was produced; a storm of short deadlines
leaves the server serving and its pool whole."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from server_proc import MODEL, ServerProcess

PROMPT = "The history of the bicycle begins"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--request-timeout", "60", engine_args=[
        "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--scheduling-policy", "priority"]).wait_ready()
    yield srv
    srv.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_deadline_mid_generation_returns_the_partial_output(server):
    # 480 tokens take well over 1 s on these CPUs (~4 ms a token alone); the first comes far sooner.
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0,
                                          extra_body={"ignore_eos": True, "timeout": 1.0})
    assert r.choices[0].finish_reason == "timeout"
    assert 0 < r.usage.completion_tokens < 480 and r.choices[0].text


def test_a_deadline_before_any_token_is_408_naming_the_field(server):
    status, body = server.post_json("/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "timeout": 1e-6})
    assert status == 408, body
    err = body["error"]
    assert err["code"] == "request_timeout" and err["param"] == "timeout" and "deadline" in err["message"]
    status, body = server.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 50, "timeout": 1e-6})
    assert status == 408, body


def test_a_stream_past_its_deadline_ends_with_a_timeout_chunk(server):
    # A stream's status line is sent before any token: no 408, its last chunk says "timeout".
    chunks = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, stream=True,
                                                    extra_body={"timeout": 1e-6}))
    assert chunks[-1].choices[0].finish_reason == "timeout"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ""


@pytest.mark.parametrize("body, param", [({"timeout": 0}, "timeout"), ({"timeout": -1}, "timeout"),
                                         ({"timeout": "soon"}, "timeout"), ({"priority": 1.5}, "priority"),
                                         ({"priority": "high"}, "priority")])
def test_bad_timeout_or_priority_is_a_400_naming_it(server, body, param):
    status, out = server.post_json("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400, out
    assert param in json.dumps(out["error"])


def test_priority_is_accepted_under_the_priority_policy(server):
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                          extra_body={"priority": -5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def _storm(srv, count: int) -> list:
    """`count` concurrent requests with deadlines from 1 us to 0.3 s; each result or exception."""
    async def main():
        aclient = openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        try:
            async def one(i: int):
                return await aclient.completions.create(
                    model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0, stream=False,
                    extra_body={"ignore_eos": True, "timeout": [1e-6, 0.05, 0.3][i % 3], "priority": i % 4})
            return await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
        finally:
            await aclient.close()
    return asyncio.run(main())


def _check_storm(srv, results: list) -> None:
    reasons = []
    for r in results:
        if isinstance(r, openai.APIStatusError):
            assert r.status_code == 408, r
            reasons.append("408")
        else:
            assert not isinstance(r, BaseException), r
            reasons.append(r.choices[0].finish_reason)
    assert set(reasons) <= {"408", "timeout", "length"}
    assert "408" in reasons  # the 1 us deadlines at least
    assert srv.wait_idle()["kvshare:kv_cache_blocks_in_use"] == 0
    r = client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4  # still serving


def test_a_storm_of_200_short_deadlines_leaves_the_server_serving(server):
    # ~5 s on 2 Zen 4 cores: small enough for the default suite.
    _check_storm(server, _storm(server, 200))
