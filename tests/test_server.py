"""The OpenAI-compatible server as a real process on loopback, driven by the official `openai`
client (raw HTTP where a client cannot send what the test needs: broken bytes, early hang-ups)."""
from __future__ import annotations

import asyncio
import json
import random
import re
import uuid

import httpx2
import openai
import pytest

import kvshare
from server_proc import MODEL, ServerProcess

FRANCE = "The capital of France is"
# A question whose greedy answer does not rest on a near tie: in the default mode every token of
# its 24 leads its runner-up by >= 1.0 logprob under last-bit changes to attention (so a second
# request that reuses the first's cached prompt decodes the same), where "What is the capital of
# France?" leads by 0.0003 at worst and flips (benchmarks/answer_margins.py).
CHAT = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _collect_stream(stream, chat: bool):
    """Joined text, finish reasons and chunk count per choice index; the usage chunk if any."""
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []  # usage rides on its own final chunk
            usage = chunk.usage
        for ch in chunk.choices:
            piece = (ch.delta.content or "") if chat else ch.text
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                finishes.setdefault(ch.index, []).append(ch.finish_reason)
    return texts, finishes, usage


# ---- endpoints -------------------------------------------------------------------------------

def test_probes_version_models_and_metric_names(server, client):
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = server.request("GET", "/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"
    status, _, body = server.request("GET", "/version")
    assert status == 200 and json.loads(body)["version"] == kvshare.__version__
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, headers, _ = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    names = {n for n, _, _ in server.metrics()}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "kvshare:aborted_requests_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum",
                 "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert name in names, name
    assert server.metric("process_resident_memory_bytes") > 50 * 2**20  # the process collector, not a stub
    # HEAD on every probe: the GET's status and headers, no body.
    for path in ("/health", "/ready", "/version", "/v1/models", "/metrics"):
        status, headers, body = server.request("HEAD", path)
        assert (status, body) == (200, b""), path
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    status, _, body = server.request("GET", "/v1/models/gpt-4o")
    err = json.loads(body)["error"]
    assert status == 404 and "'gpt-4o'" in err["message"] and err["code"] == "model_not_found"


def test_a_keyless_loopback_server_answers_only_loopback_host_names(server):
    """DNS rebinding: a page on evil.example that resolves its name to 127.0.0.1 sends Host
    evil.example. Before the fix the server answered it (and its /kv/ view) like anyone."""
    for path in ("/v1/models", "/kv/snapshot", "/health"):
        resp = httpx2.get(server.url + path, headers={"Host": "evil.example"})
        error = resp.json()["error"]
        assert resp.status_code == 421 and "'evil.example'" in error["message"] and "--api-key" in error["message"]
        resp = httpx2.get(server.url + path, headers={"Host": f"evil.example:{server.port}"})
        assert resp.status_code == 421, path
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert httpx2.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_a_keyless_loopback_server_takes_only_json_bodies(server):
    """A cross-site form or fetch can POST text/plain without a preflight: refused (415) when no key guards the API."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    for path in ("/v1/completions", "/tokenize"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": content_type} if content_type else {}
            resp = httpx2.post(server.url + path, content=body, headers=headers)
            error = resp.json()["error"]
            assert resp.status_code == 415 and error["param"] == "Content-Type", (path, content_type, resp.text)
            assert "application/json" in error["message"]
    resp = httpx2.post(server.url + "/v1/completions", content=body,
                       headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status_code == 200, resp.text


def test_completion_and_chat_answer_with_usage(server, client):
    before = server.metric("vllm:generation_tokens_total")
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    u = r.usage
    assert u.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0)
    msg = c.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.completion_tokens > 0
    # The metrics saw exactly these tokens.
    assert server.metric("vllm:generation_tokens_total") - before == u.completion_tokens + c.usage.completion_tokens


def test_streamed_text_equals_non_streamed_text(client):
    kw = dict(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    texts, finishes, usage = _collect_stream(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True}), chat=False)
    assert texts == {0: full.choices[0].text}
    assert finishes == {0: [full.choices[0].finish_reason]}
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)

    kw = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    texts, finishes, usage = _collect_stream(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}), chat=True)
    assert texts == {0: full.choices[0].message.content}
    assert finishes == {0: [full.choices[0].finish_reason]}
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stream_without_include_usage_has_no_usage(client):
    texts, _, usage = _collect_stream(
        client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, stream=True), chat=False)
    assert usage is None and texts[0]


def test_n_choices_stream_with_own_index_and_finish_reason(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=11, n=3)
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts, finishes, _ = _collect_stream(client.completions.create(**kw, stream=True), chat=False)
    assert texts == {c.index: c.text for c in full.choices}  # seeded per choice: same draws either way
    assert finishes == {c.index: [c.finish_reason] for c in full.choices}  # each choice finishes once
    assert len({c.text for c in full.choices}) > 1  # choices draw their own tokens

    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0.9, seed=3, n=2)
    full = client.chat.completions.create(**kw)
    texts, finishes, _ = _collect_stream(client.chat.completions.create(**kw, stream=True), chat=True)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert set(finishes) == {0, 1} and all(len(v) == 1 for v in finishes.values())


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite food is", max_tokens=16, temperature=1.0)
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=4321).choices[0].text
    assert a == b
    assert a != c


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4 and tok in top
        assert abs(chosen - max(top.values())) < 1e-5  # greedy picks the most likely token


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5 and e.bytes == list(e.token.encode())


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=24, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    words = text.split()
    stop = words[len(words) // 2]
    r = client.completions.create(**kw, stop=[stop, "zzzz-never"])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    texts, finishes, _ = _collect_stream(client.completions.create(**kw, stop=stop, stream=True), chat=False)
    assert texts[0] == r.choices[0].text and finishes[0] == ["stop"]


def test_several_prompts_give_choices_indexed_prompt_major(client):
    prompts = [FRANCE, "My favourite colour is"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    texts, finishes, _ = _collect_stream(
        client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True),
        chat=False)
    assert texts == {c.index: c.text for c in r.choices}
    assert all(len(finishes[i]) == 1 for i in range(4))


def test_token_id_prompts_and_echo(client):
    ids = [504, 3458, 282, 4649, 314]
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens == len(ids)
    nested = client.completions.create(model=MODEL, prompt=[ids], max_tokens=4, temperature=0)
    assert nested.choices[0].text == plain.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1)
    text = echoed.choices[0].text
    assert text.endswith(plain.choices[0].text) and len(text) > len(plain.choices[0].text)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello there")


def test_cached_tokens_and_cache_salt(client):
    prompt = f"Note {uuid.uuid4().hex}. " + "It is a truth universally acknowledged, that a single man " * 8
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)

    def cached(**extra):
        return client.completions.create(**kw, **extra).usage.prompt_tokens_details.cached_tokens

    first = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = cached()
    assert 16 <= again < first.usage.prompt_tokens and again % 16 == 0  # whole blocks, never the last token
    assert cached(extra_body={"cache_salt": "tenant-b"}) == 0  # another tenant shares nothing
    assert cached(extra_body={"cache_salt": "tenant-b"}) == again


def test_vllm_extras_are_honoured(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0,
                                  extra_body={"min_tokens": 8, "ignore_eos": True, "top_k": 1, "user": "u1"})
    assert r.usage.completion_tokens == 8
    greedy = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0).choices[0].text
    top1 = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=1.0, seed=5,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # top_k=1 leaves only the most likely token


IGNORED_OPENAI_FIELDS = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "reasoning_effort": "low",
                         "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
                         "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {},
                         "safety_identifier": "s1", "prompt_cache_key": "k1", "verbosity": "low",
                         "functions": [], "function_call": "none", "user": "u1"}


def test_openai_fields_are_accepted_ignored_and_logged_once(server, client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    for _ in range(2):
        r = client.chat.completions.create(**kw, extra_body=IGNORED_OPENAI_FIELDS)
        assert r.choices[0].message.content == plain  # ignored: the answer is the same
    log = server.log_text()
    for name in IGNORED_OPENAI_FIELDS:
        if name != "user":
            assert log.count(f"request field '{name}' is accepted and ignored") == 1, name


def test_prompt_logprobs_as_vllm_returns_them(server, client):
    ids = [504, 3458, 282, 4649, 314]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 2})
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    echoed = r.choices[0].logprobs.token_logprobs
    for i, (tid, entries) in enumerate(zip(ids[1:], plps[1:]), 1):
        assert 2 <= len(entries) <= 3 and str(tid) in entries  # top-2 plus the prompt's own token
        own = entries[str(tid)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["rank"] >= 1
        assert abs(own["logprob"] - echoed[i]) < 1e-5  # the same numbers the echo reports
        assert sorted(e["rank"] for e in entries.values())[:2] == [1, 2]
    chat_r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                            extra_body={"prompt_logprobs": 0})
    plps = chat_r.model_extra["prompt_logprobs"]
    assert len(plps) == chat_r.usage.prompt_tokens and plps[0] is None and all(len(e) >= 1 for e in plps[1:])
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).model_extra[
        "prompt_logprobs"] is None


def test_continue_final_message_echo_and_tokenize(server, client):
    messages = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    status, tok = server.post_json("/tokenize", {"model": MODEL, "messages": messages, **extra,
                                                 "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == 512
    status, detok = server.post_json("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"].endswith("<|im_start|>assistant\nThe capital of France is")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={**extra, "echo": True})
    assert r.usage.prompt_tokens == tok["count"]
    # The rendered prompt is exactly what /tokenize gave: the same tokens as a completion continue it.
    same = client.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=6, temperature=0)
    assert r.choices[0].message.content == "The capital of France is" + same.choices[0].text
    assert "Paris" in same.choices[0].text
    texts, _, _ = _collect_stream(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True, extra_body={**extra, "echo": True}),
        chat=True)
    assert texts == {0: r.choices[0].message.content}
    # chat_template_kwargs reach the renderer (this template reads none of them: same tokens).
    status, again = server.post_json("/tokenize", {"messages": messages, **extra,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and again["tokens"] == tok["tokens"]


def test_tokenize_prompt_matches_the_served_prompt(server, client):
    status, tok = server.post_json("/tokenize", {"prompt": FRANCE})
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1)
    assert status == 200 and tok["count"] == r.usage.prompt_tokens and tok["token_strs"] is None
    assert server.post_json("/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": FRANCE})
    status, chat_tok = server.post_json("/tokenize", {"messages": CHAT})
    assert chat_tok["count"] == client.chat.completions.create(model=MODEL, messages=CHAT,
                                                               max_tokens=1).usage.prompt_tokens


def test_a_35_mb_prompt_does_not_hold_the_event_loop(server):
    """/health keeps answering while a 3.5 MB prompt is parsed and tokenized (it is then refused:
    far beyond max_model_len); measured against the big request's own duration."""
    import threading
    import time

    body = json.dumps({"prompt": "It is a truth universally acknowledged, that a single man. " * 60_000,
                       "max_tokens": 1}).encode()
    assert 3.3e6 < len(body) < 3.8e6
    done = {}

    def big():
        t0 = time.monotonic()
        done["status"] = server.request("POST", CMPL, body, {"Content-Type": "application/json"})[0]
        done["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=big)
    thread.start()
    slowest, answered = 0.0, 0
    while thread.is_alive():
        t0 = time.monotonic()
        assert server.request("GET", "/health")[0] == 200
        if thread.is_alive():
            slowest, answered = max(slowest, time.monotonic() - t0), answered + 1
        time.sleep(0.1)  # a probe's pace: hammering the 2-core machine would slow the big request itself
    thread.join()
    assert done["status"] == 400
    assert answered >= 3 and slowest < done["seconds"] / 3, (answered, slowest, done["seconds"])


# ---- bad requests ----------------------------------------------------------------------------

OK = {"prompt": "Hi", "max_tokens": 2}
CHAT_OK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CMPL, CHATP = "/v1/completions", "/v1/chat/completions"


def c(**kw):
    return {**OK, **kw}


def chat(**kw):
    return {**CHAT_OK, **kw}


# (id, method, path, body, status, param, a phrase the message must contain)
BAD_REQUESTS = [
    ("malformed_json", "POST", CMPL, b'{"prompt": "Hi",', 400, None, "not valid JSON"),
    ("invalid_utf8", "POST", CMPL, b'{"prompt": "\xff\xfe Hi"}', 400, None, "not valid UTF-8"),
    ("not_an_object", "POST", CMPL, b"[1, 2, 3]", 400, None, "JSON object"),
    ("empty_body", "POST", CMPL, b"", 400, None, "empty"),
    ("nan_number", "POST", CMPL, b'{"prompt": "Hi", "temperature": NaN}', 400, None, "NaN"),
    ("lone_surrogate", "POST", CMPL, b'{"prompt": "\\ud800"}', 400, None, "surrogate"),
    ("missing_prompt", "POST", CMPL, {"max_tokens": 2}, 400, "prompt", "required"),
    ("missing_messages", "POST", CHATP, {"max_tokens": 2}, 400, "messages", "required"),
    ("unknown_field", "POST", CMPL, c(max_tokenz=5), 400, "max_tokenz", "unknown field"),
    ("prompt_wrong_type", "POST", CMPL, c(prompt=5), 400, "prompt", "must be a string"),
    ("prompt_empty_string", "POST", CMPL, c(prompt=""), 400, "prompt", "empty"),
    ("prompt_empty_list", "POST", CMPL, c(prompt=[]), 400, "prompt", "empty"),
    ("prompt_token_out_of_vocab", "POST", CMPL, c(prompt=[10**12]), 400, "prompt", "token ids must be"),
    ("max_tokens_string", "POST", CMPL, c(max_tokens="ten"), 400, "max_tokens", "valid integer"),
    ("max_tokens_negative", "POST", CMPL, c(max_tokens=-1), 400, "max_tokens", "greater than or equal to 1"),
    ("max_tokens_huge", "POST", CMPL, c(max_tokens=10**9), 400, "max_tokens", "max_model_len"),
    ("temperature_negative", "POST", CMPL, c(temperature=-0.5), 400, "temperature", "greater than or equal"),
    ("temperature_string", "POST", CMPL, c(temperature="hot"), 400, "temperature", "valid number"),
    ("top_p_zero", "POST", CMPL, c(top_p=0), 400, "top_p", "greater than 0"),
    ("top_p_above_one", "POST", CMPL, c(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("top_k_negative", "POST", CMPL, c(top_k=-5), 400, "top_k", "greater than or equal to -1"),
    ("n_zero", "POST", CMPL, c(n=0), 400, "n", "greater than or equal to 1"),
    ("n_huge", "POST", CMPL, c(n=10**6), 400, "n", "less than or equal to"),
    ("n_fraction", "POST", CMPL, c(n=1.5), 400, "n", "valid integer"),
    ("logprobs_huge", "POST", CMPL, c(logprobs=1000), 400, "logprobs", "less than or equal to 20"),
    ("logprobs_bool", "POST", CMPL, c(logprobs=True), 400, "logprobs", "valid integer"),
    ("stop_wrong_type", "POST", CMPL, c(stop=5), 400, "stop", "string or a list of strings"),
    ("stop_empty_string", "POST", CMPL, c(stop=[""]), 400, "stop", "non-empty"),
    ("stop_token_ids_negative", "POST", CMPL, c(stop_token_ids=[-1]), 400, "stop_token_ids[0]", "greater than"),
    ("stop_token_ids_huge", "POST", CMPL, c(stop_token_ids=[2**70], min_tokens=1), 400, "stop_token_ids[0]",
     "less than"),
    ("seed_string", "POST", CMPL, c(seed="abc"), 400, "seed", "valid integer"),
    ("seed_huge", "POST", CMPL, c(seed=2**70), 400, "seed", "less than"),
    ("presence_penalty_range", "POST", CMPL, c(presence_penalty=3), 400, "presence_penalty", "less than"),
    ("repetition_penalty_zero", "POST", CMPL, c(repetition_penalty=0), 400, "repetition_penalty", "greater than"),
    ("min_tokens_above_max", "POST", CMPL, c(min_tokens=10), 400, "min_tokens", "max_tokens"),
    ("stream_not_bool", "POST", CMPL, c(stream="yes"), 400, "stream", "valid boolean"),
    ("stream_options_without_stream", "POST", CMPL, c(stream_options={"include_usage": True}), 400,
     "stream_options", "stream: true"),
    ("cache_salt_empty", "POST", CMPL, c(cache_salt=""), 400, "cache_salt", "at least 1"),
    ("best_of_unsupported", "POST", CMPL, c(best_of=3), 400, "best_of", "not supported"),
    ("logit_bias_unsupported", "POST", CMPL, c(logit_bias={"50": -100}), 400, "logit_bias", "not supported"),
    ("unknown_model", "POST", CMPL, c(model="gpt-4o"), 404, "model", "does not exist"),
    ("prompt_too_long", "POST", CMPL, c(prompt="hello " * 700), 400, "prompt", "max_model_len is 512"),
    ("chat_bad_role", "POST", CHATP, chat(messages=[{"role": "wizard", "content": "Hi"}]), 400,
     "messages[0].role", "'user'"),
    ("chat_content_wrong_type", "POST", CHATP, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "string"),
    ("chat_image_part", "POST", CHATP,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", "text"),
    ("chat_no_messages", "POST", CHATP, chat(messages=[]), 400, "messages", "at least 1"),
    ("chat_top_logprobs_alone", "POST", CHATP, chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    ("chat_max_completion_tokens_zero", "POST", CHATP, chat(max_completion_tokens=0), 400,
     "max_completion_tokens", "greater than or equal to 1"),
    ("chat_prompt_too_long", "POST", CHATP, chat(messages=[{"role": "user", "content": "hello " * 700}]), 400,
     "messages", "max_model_len is 512"),
    ("oversized_body", "POST", CMPL, b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', 413, None, "limit"),
    ("oversized_chunked_body", "POST", CMPL, ("chunked", b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'), 413, None,
     "limit"),
    ("ignored_field_typo", "POST", CHATP, chat(metdata={"k": "v"}), 400, "metdata", "unknown field"),
    ("ignored_field_wrong_type", "POST", CHATP, chat(store="yes"), 400, "store", "valid boolean"),
    ("openai_field_not_on_completions", "POST", CMPL, c(metadata={"k": "v"}), 400, "metadata", "unknown field"),
    ("functions_deprecated", "POST", CHATP, chat(functions=[{"name": "f"}]), 400, "functions", "use 'tools'"),
    ("function_call_deprecated", "POST", CHATP, chat(function_call="auto"), 400, "function_call", "tool_choice"),
    ("prompt_logprobs_stream", "POST", CMPL, c(prompt_logprobs=1, stream=True), 400, "prompt_logprobs", "stream"),
    ("prompt_logprobs_huge", "POST", CHATP, chat(prompt_logprobs=50), 400, "prompt_logprobs", "less than or equal"),
    ("continue_with_generation_prompt", "POST", CHATP, chat(continue_final_message=True, add_generation_prompt=True),
     400, "continue_final_message", "cannot both"),
    ("chat_template_kwargs_reserved", "POST", CHATP, chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", "'messages'"),
    ("tokenize_bad_field", "POST", "/tokenize", {"prompt": "Hi", "add_special_token": True}, 400,
     "add_special_token", "unknown field"),
    ("tokenize_unknown_model", "POST", "/tokenize", {"prompt": "Hi", "model": "gpt-4o"}, 404, "model",
     "does not exist"),
    ("detokenize_out_of_vocab", "POST", "/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "tokens[1]"),
    ("detokenize_not_ids", "POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", "valid integer"),
    ("wrong_method", "GET", CMPL, None, 405, None, "not allowed"),
    ("unknown_route", "POST", "/v1/embeddings", c(), 404, None, "no route"),
]


def test_tool_choice_auto_needs_the_flag_and_the_server_serves_on(client):
    # This server runs without --enable-auto-tool-choice (tests/test_tool_calls.py has one with it).
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for kw in (dict(tool_choice="auto"), {}):  # tools without tool_choice mean "auto", as in vLLM
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, max_tokens=2, **kw)
        assert e.value.body["param"] == "tool_choice"
        assert e.value.body["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                           '--tool-call-parser to be set')
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_a_clear_4xx(server, case):
    _, method, path, body, status, param, phrase = case
    chunked = isinstance(body, tuple)
    got, headers, data = server.request(method, path, body[1] if chunked else body, chunked=chunked)
    assert got == status, data[:300]
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert phrase in err["message"], err["message"]
    assert err["type"] == "invalid_request_error"


def test_prompt_too_long_names_both_token_counts(server):
    status, body = server.post_json(CMPL, c(prompt="hello " * 700))
    m = re.search(r"prompt is (\d+) tokens, but max_model_len is (\d+)", body["error"]["message"])
    assert status == 400 and m and int(m.group(1)) > 512 and int(m.group(2)) == 512


def test_server_still_serves_after_bad_requests(server, client):
    for case in BAD_REQUESTS[:10]:
        server.request(case[1], case[2], case[3] if not isinstance(case[3], tuple) else None)
    assert server.request("GET", "/ready")[0] == 200
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    assert server.wait_idle()["kvshare:kv_cache_blocks_in_use"] == 0


# ---- many clients, some hanging up -----------------------------------------------------------

PROMPTS = [
    "The capital of France is", "Once upon a time, there was a", "The best way to learn to cook is",
    "My favourite season of the year is", "The ocean is full of", "In the morning I like to",
    "A good friend is someone who", "The history of the bicycle begins",
]
STREAM_KW = dict(max_tokens=16, temperature=0)


async def _hang_up(port: int, body: dict, after_chunks: int, linger: float) -> None:
    """Send a request by hand, read `after_chunks` SSE events, then close the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    seen = 0
    while seen < after_chunks:
        line = await reader.readline()
        if not line:
            break
        seen += line.startswith(b"data: {")
    await asyncio.sleep(linger)
    writer.close()
    await writer.wait_closed()


async def _run_clients(server, refs: dict[str, str]):
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(5)

    async def complete(prompt: str):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                  extra_body={"ignore_eos": True}, **STREAM_KW)
        text, finish = "", None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return prompt, text, finish

    tasks, hangups = [], 0
    for i in range(64):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 2:  # a third hang up: mid-stream, before any byte, or while waiting non-streamed
            hangups += 1
            body = {"model": MODEL, "prompt": prompt, "ignore_eos": True, "stream": i % 9 != 8, **STREAM_KW}
            after = rng.choice([0, 1, 2, 4, 8]) if body["stream"] else 0
            tasks.append(_hang_up(server.port, body, after, rng.uniform(0, 0.3)))
        else:
            tasks.append(complete(prompt))
    results = await asyncio.gather(*tasks)
    await aclient.close()
    return [r for r in results if r is not None], hangups


def test_64_streams_with_a_third_hanging_up(server, client):
    refs = {p: client.completions.create(model=MODEL, prompt=p, extra_body={"ignore_eos": True},
                                         **STREAM_KW).choices[0].text for p in PROMPTS}
    aborted_before = server.metric("kvshare:aborted_requests_total", reason="client_disconnect")
    done, hangups = asyncio.run(_run_clients(server, refs))
    assert len(done) == 64 - hangups == 43
    for prompt, text, finish in done:
        assert text == refs[prompt], prompt
        assert finish == "length"
    idle = server.wait_idle()
    assert idle == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                    "vllm:kv_cache_usage_perc": 0, "kvshare:kv_cache_blocks_in_use": 0}
    aborted = server.metric("kvshare:aborted_requests_total", reason="client_disconnect") - aborted_before
    assert 1 <= aborted <= hangups  # a hang-up after the last token has nothing left to abort
    assert server.metric("kvshare:abort_delay_steps_max") <= 2  # applied within two engine steps
    assert server.request("GET", "/ready")[0] == 200


def test_non_streamed_request_is_aborted_when_its_client_hangs_up(server):
    aborted = server.metric("kvshare:aborted_requests_total", reason="client_disconnect")
    generated = server.metric("vllm:generation_tokens_total")

    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        payload = json.dumps({"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        for _ in range(600):  # hang up once it is generating
            if await asyncio.to_thread(server.metric, "vllm:num_requests_running") == 1:
                break
            await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()

    asyncio.run(main())
    assert server.wait_idle()["kvshare:kv_cache_blocks_in_use"] == 0
    assert server.metric("kvshare:aborted_requests_total", reason="client_disconnect") == aborted + 1
    assert server.metric("vllm:generation_tokens_total") - generated < 400


def test_prompts_stay_out_of_the_log(server, client):
    marker = f"zebra-{uuid.uuid4().hex[:8]}"
    client.completions.create(model=MODEL, prompt=f"Say {marker} twice", max_tokens=2, temperature=0)
    log = server.log_text()
    assert "request cmpl-" in log  # requests are logged...
    assert marker not in log  # ...without their text


# ---- the load generator against this server --------------------------------------------------

def test_bench_serve_sweeps_this_server(server, tmp_path):
    import os
    import subprocess
    import sys

    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 3}) + "\n" +
                     json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    runs = (("shared", "completions", ["--concurrency", "1,2"]), (str(jsonl), "chat", ["--concurrency", "1,2"]),
            ("mixed", "completions", ["--request-rate", "5,10", "--prompt-tokens", "16,128", "--output-tokens", "2,3"]))
    # the last: Poisson arrivals; its prompt range keeps the mixed prompts inside this server's
    # --max-model-len 512, its output range overrides --max-tokens
    for workload, endpoint, load in runs:
        r = subprocess.run([sys.executable, "-m", "kvshare.cli", "bench", "serve", "--base-url", server.url, *load,
                            "--num-requests", "2", "--max-tokens", "4", "--warmup", "0",
                            "--workload", workload, "--endpoint", endpoint, "--ignore-eos", "--label", "kv",
                            "--out-json", str(out_json), "--out-png", str(out_png)],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert "knee:" in r.stdout and "total tok/s" in r.stdout
        # A kvshare server: the sweep names its live KV view's page.
        assert f"watch its KV cache live at {server.url}/dashboard" in r.stderr
        sweep = json.loads(out_json.read_text())
        assert sweep["dashboard_url"] == server.url + "/dashboard"
        levels = [float(x) for x in load[1].split(",")]
        assert [s["level"] for s in sweep["levels"]] == levels and sweep["model"] == MODEL
        assert sweep["mode"] == ("rate" if "--request-rate" in load else "concurrency")
        for s in sweep["levels"]:
            assert s["completed"] == 2 and s["failed"] == 0
            # From the server's usage: 3 + 4 (the file's max_tokens), 2 x 4, or mixed's 2-3 each
            # (--output-tokens, not --max-tokens).
            if workload == "mixed":
                assert 4 <= s["output_tokens"] <= 6
            else:
                assert s["output_tokens"] == (7 if endpoint == "chat" else 8)
            assert s["total_tok_s"] > s["output_tok_s"] > 0 and s["ttft_p50_s"] <= s["e2e_p50_s"]
        assert sweep["knee"]["level"] in levels
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
