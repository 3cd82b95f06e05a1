"""LoRA adapters through `kvshare serve` (issue 32 part 1, the server): --lora-modules, a request's
`model` naming an adapter, /v1/models, and /v1/load_lora_adapter / unload_lora_adapter behind the
API key and --allow-runtime-lora-updating; the official openai client against a real server."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from server_proc import ServerProcess
from test_lora import bundled  # noqa: F401  (the module fixture the adapters come from)

from kvshare.server.lora_routes import parse_lora_modules

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is a city that"


@pytest.fixture(scope="module")
def adapters(bundled):
    """test_lora's two random adapters on the bundled model, A (q/k/v/o and MLP) and B (attention only)."""
    return {"a": bundled["a"], "b": bundled["b"]}


@pytest.fixture(scope="module")
def server(adapters):
    srv = ServerProcess("--api-key", KEY, "--enable-lora", "--max-loras", "2", "--lora-modules",
                        f"sql={adapters['a']}", "--allow-runtime-lora-updating").wait_ready()
    yield srv
    srv.close()


def complete(client, model: str) -> tuple[tuple, str]:
    """(the greedy answer's text and chosen-token logprobs, the model the response names)."""
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    return (c.text, tuple(c.logprobs.token_logprobs)), out.model


def test_an_adapter_is_a_model_and_its_answers_are_its_own(server, adapters):
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"SmolLM2-135M-Instruct", "sql"}
    assert cards["sql"].parent == "SmolLM2-135M-Instruct" and cards["sql"].root == adapters["a"]
    base, base_model = complete(client, "SmolLM2-135M-Instruct")
    sql, sql_model = complete(client, "sql")
    assert (base_model, sql_model) == ("SmolLM2-135M-Instruct", "sql")
    assert sql != base  # the adapter changes the answer
    assert complete(client, "SmolLM2-135M-Instruct")[0] == base  # and the base model's stays its own (cached prompt)
    assert complete(client, "sql")[0] == sql
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        complete(client, "nope")

    # Loaded at run time under another name: its own answers; unloaded: gone (404), the others stay.
    status, _, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["b"]},
                                     AUTH)
    assert status == 200 and b"chat" in body
    chat, _ = complete(client, "chat")
    assert chat not in (base, sql)
    assert {m.id for m in client.models.list().data} == {"SmolLM2-135M-Instruct", "sql", "chat"}
    status, _, _ = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["b"]},
                                  AUTH)
    assert status == 400  # already loaded
    status, _, body = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}, AUTH)
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "chat")
    assert complete(client, "sql")[0] == sql


def test_the_adapter_routes_refuse_what_they_cannot_take(server, adapters, tmp_path):
    status, _, _ = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["b"]})
    assert status == 401  # behind the API key
    cases = [
        ({"lora_name": "x", "lora_path": adapters["b"], "scale": 2}, "scale"),  # a key no API defines
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "lora_path"),  # no adapter there
        ({"lora_name": "SmolLM2-135M-Instruct", "lora_path": adapters["b"]}, "lora_name"),
    ]
    for body, param in cases:
        status, _, data = server.request("POST", "/v1/load_lora_adapter", body, AUTH)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == param, (body, err)
    status, _, data = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "never"}, AUTH)
    assert status == 404 and json.loads(data)["error"]["param"] == "lora_name"
    # The server kept serving through all of it.
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY)
    assert complete(client, "sql")[1] == "sql"


def test_without_the_flag_there_are_no_adapter_routes_and_flags_are_checked(adapters):
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    for bad, why in (("a", "NAME=PATH"), ("=p", "must not be empty"), ('{"name": "a"}', "JSON form"),
                     ('{"name": "a", "path": "/p", "rank": 8}', "unknown keys: rank")):
        with pytest.raises(ValueError, match=why):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    # --lora-modules without --enable-lora: one clear line before the model loads.
    done = subprocess.run([sys.executable, "-m", "kvshare.cli", "serve", "--lora-modules", f"a={adapters['a']}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--lora-modules needs --enable-lora" in done.stderr
    srv = ServerProcess("--enable-lora", "--lora-modules", f"sql={adapters['a']}").wait_ready()
    try:
        status, _, _ = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["b"]})
        assert status == 404  # not offered without --allow-runtime-lora-updating
    finally:
        srv.close()


def test_the_data_parallel_front_end_serves_the_lora_modules_on_every_replica(adapters):
    """--data-parallel-size 2 with --lora-modules: /v1/models lists the adapter, a request naming
    it answers as the adapter on either replica (round robin: one request each), the base model's
    answer stays its own; run-time loading is refused, saying why."""
    from kvshare.server.routing import Router

    router = Router(2, "prefix_aware", block_size=16, hash_seed="s")
    ids = list(range(100, 164))
    assert not set(router.prompt_hashes(ids, None, "sql")) & set(router.prompt_hashes(ids, None))
    srv = ServerProcess("--data-parallel-size", "2", "--routing-policy", "round_robin", "--api-key", KEY,
                        "--enable-lora", "--lora-modules", f"sql={adapters['a']}").wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key=KEY)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"SmolLM2-135M-Instruct", "sql"} and cards["sql"].parent == "SmolLM2-135M-Instruct"
        body = {"model": "sql", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answers = {}
        for _ in range(2):
            status, headers, data = srv.request("POST", "/v1/completions", body, AUTH)
            assert status == 200 and json.loads(data)["model"] == "sql", data
            answers[headers["x-kvshare-engine"]] = json.loads(data)["choices"][0]["text"]
        assert len(answers) == 2 and len(set(answers.values())) == 1  # both replicas, the same answer
        base, base_model = complete(client, "SmolLM2-135M-Instruct")
        assert base_model == "SmolLM2-135M-Instruct" and base[0] != answers["0"]
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            complete(client, "nope")
        status, _, data = srv.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["b"]},
                                      AUTH)
        assert status == 404 and "--data-parallel-size > 1" in json.loads(data)["error"]["message"]
    finally:
        srv.close()
