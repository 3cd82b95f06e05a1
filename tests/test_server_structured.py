"""Structured outputs through the real server and the official openai client: response_format
(json_object, json_schema) and vLLM's structured_outputs extra (json, regex, choice, grammar)."""
from __future__ import annotations

import json
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server_proc import MODEL, ServerProcess
from kvshare.testing.json_schemas import PROMPTS, SCHEMAS


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess().wait_ready()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_ten_schemas_five_requests_each_all_validate(client):
    jobs = [(name, schema, i) for name, schema in SCHEMAS for i in range(5)]

    def ask(job):
        name, schema, i = job
        # One greedy request and four sampled ones with their own seeds per schema.
        sampling = {"temperature": 0} if i == 0 else {"temperature": 0.8, "seed": i}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}],
                                           max_tokens=200, response_format=_schema_format(name, schema), **sampling)
        return r.choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:  # all 50 in one batch
        choices = list(pool.map(ask, jobs))
    for (name, schema, i), choice in zip(jobs, choices):
        assert choice.finish_reason == "stop", (name, i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_grammar_and_json_object(client):
    def complete(spec, prompt="Answer: "):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                      extra_body={"structured_outputs": spec})
        return r.choices[0].text

    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", complete({"regex": r"[0-9]{3}-[0-9]{4}"}, "My phone number is "))
    assert complete({"choice": ["positive", "negative"]}, "Review: great food! Sentiment: ") in ("positive",
                                                                                                 "negative")
    assert re.fullmatch(r"[a-z]+, [a-z]+, [a-z]+", complete({"grammar": 'start: W ", " W ", " W\nW: /[a-z]{1,6}/'},
                                                           "Three fruits: "))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                       max_tokens=120, temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_streamed_and_whole_give_the_same_constrained_text(client):
    name, schema = SCHEMAS[6]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=200, temperature=0,
              response_format=_schema_format(name, schema))
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole and finish == "stop"
    jsonschema.validate(json.loads(whole), schema)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": _schema_format("bad", {"type": "objectx"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_specs_are_400s_naming_the_field_then_the_server_serves(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert r.choices[0].message.content


def _large_schema(tag: str, branches: int = 800) -> dict:
    """A valid schema that takes about a second to compile here (800 objects of 10 properties);
    `tag` keeps each one out of the compile cache."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}_{j}": {"type": "integer"} for j in range(10)},
                       "required": [f"{tag}{i}_0"]} for i in range(branches)]}


def test_grammar_compiles_leave_a_neighbours_token_gaps_within_2x(server):
    """Three clients sending large schemas back to back keep both compile threads busy; the threads
    run at the lowest CPU priority, so a streaming neighbour's median inter-token gap may not
    double (at the default priority it went from 4.2 to 23.3 ms on this 2-core machine)."""
    quiet = statistics.median(server.streamed_token_gaps(60))
    done = threading.Event()
    statuses = []

    def hostile(k: int) -> None:
        n = 0
        while not done.is_set():
            n += 1
            status, _ = server.post_json("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": _schema_format("big", _large_schema(f"h{k}_{n}_"))})
            statuses.append(status)

    threads = [threading.Thread(target=hostile, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    loud = statistics.median(server.streamed_token_gaps(60))
    done.set()
    for t in threads:
        t.join(120)
    print(f"neighbour's median gap: quiet {quiet * 1e3:.1f} ms, beside grammar compiles {loud * 1e3:.1f} ms")
    assert statuses and set(statuses) <= {200, 429}
    assert loud < 2 * quiet, (quiet, loud)
