"""Tool calling through the real server on loopback, driven by the official `openai` client: a
server with --enable-auto-tool-choice --tool-call-parser hermes --chat-template (a hermes-style
ChatML template in tests/templates). That "auto" is refused without the flag is shown on
test_server.py's plain server.

What is shown how:
- "auto" parses calls out of text the model really generates: the conversation holds three
  earlier turns whose assistant answer is the same <tool_call> block, and at temperature 0 the
  135M model copies it. The parser, not the model, is under test here (the parsers themselves are
  tested on crafted replies in test_tool_parsers.py).
- "required" and a named function are enforced by structured outputs, so every sampled reply
  (temperature 1, three choices) is a call whose arguments validate (jsonschema) against the
  tool's parameters, streamed or not.
- A follow-up turn with the assistant's tool_calls and a role "tool" message renders through the
  template: the server's prompt_tokens equal a local rendering that holds the tools, the call and
  the tool's answer.
"""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from kvshare.cli import main as kvshare_main
from kvshare.errors import InvalidRequestError
from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.loader import bundled_model_path
from kvshare.model.tokenizer import Tokenizer
from kvshare.server.chat import render_chat_prompt
from kvshare.server.cli import read_chat_template
from kvshare.server.protocol import ChatCompletionRequest
from kvshare.server.settings import ServerConfig
from kvshare.server.tool_calls import plan_tool_calls, required_schema
from server_proc import MODEL, ServerProcess

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "hermes_tools.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ASK = "What is the weather in Paris?"
# Three earlier turns answered with the same call: at temperature 0 the model copies it.
COPY = [m for _ in range(3) for m in ({"role": "user", "content": ASK}, {"role": "assistant", "content": CALL})]
COPY.append({"role": "user", "content": ASK})



# ---- no server: schemas, plans, configuration --------------------------------------------------

def _req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


def test_required_schema_is_the_array_of_calls_vllm_builds():
    tools = _req(tools=TOOLS).tools
    schema = required_schema(tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}},
          {"name": "get_time", "parameters": {"zone": "CET"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "CET"}}],
                [{"name": "nope", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema(tools, parallel=False)
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)
    # A tool's $defs move to the root, where its references resolve.
    ref = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    with_defs = required_schema(_req(tools=[ref]).tools, parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], with_defs)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], with_defs)


def test_plans_follow_vllm_defaults_and_refusals():
    assert plan_tool_calls(_req(), None) is None
    assert plan_tool_calls(_req(tools=TOOLS, tool_choice="none"), None) is None
    assert plan_tool_calls(_req(tools=[], tool_choice="required"), None) is None  # vLLM: behaves as "none"
    assert plan_tool_calls(_req(tools=TOOLS), "hermes").choice == "auto"  # tools without tool_choice: "auto"
    named = plan_tool_calls(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                            None)
    assert named.choice == "function" and named.schema == SCHEMAS["get_time"]
    for body, param, phrase in [
        (dict(tools=TOOLS), "tool_choice", "--enable-auto-tool-choice"),
        (dict(tool_choice="required"), "tool_choice", "needs `tools`"),
        (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools[1].function.name", "unique"),
    ]:
        with pytest.raises(InvalidRequestError, match=phrase) as e:
            plan_tool_calls(_req(**body), None)
        assert e.value.param == param


def test_plans_turn_replies_into_messages_and_finish_reasons():
    two = CALL + "\n" + CALL.replace("Paris", "Tokyo")
    auto = plan_tool_calls(_req(tools=TOOLS), "hermes")
    content, calls = auto.message(two)
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Tokyo"]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    single = plan_tool_calls(_req(tools=TOOLS, parallel_tool_calls=False), "hermes")
    assert [json.loads(c["function"]["arguments"])["city"] for c in single.message(two)[1]] == ["Paris"]
    assert auto.message("It is sunny.") == ("It is sunny.", [])
    assert (auto.finish_reason(True, "stop"), auto.finish_reason(False, "stop")) == ("tool_calls", "stop")
    assert auto.finish_reason(True, "length") == "length"
    named = plan_tool_calls(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                            None)
    assert named.finish_reason(True, "stop") == "stop"  # OpenAI's and vLLM's answer to a forced function


def test_server_options_are_checked_before_any_model_loads(tmp_path, capsys):
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown: choose from hermes, llama3_json, pythonic"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="--chat-template.*line 1"):
        ServerConfig(chat_template="{% if %}")
    with pytest.raises(ValueError, match="cannot read the template file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    # The `kvshare` entry point itself (in-process: a subprocess would only add the imports).
    with pytest.raises(SystemExit) as e:
        kvshare_main(["serve", "--tool-call-parser", "nope"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kvshare serve: error: argument --tool-call-parser: invalid choice: 'nope' (choose from 'hermes', "
        "'llama3_json', 'pythonic')")
    assert kvshare_main(["serve", "--enable-auto-tool-choice"]) == 2  # before the model loads
    assert "requires --tool-call-parser" in capsys.readouterr().err


# ---- servers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", TEMPLATE)
    try:
        yield srv.wait_ready()
    finally:
        srv.proc.kill()  # graceful shutdown is tested elsewhere; here it would only cost seconds
        srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf_metadata(open_gguf_file(bundled_model_path()).metadata)


def _streamed(stream) -> dict[int, dict]:
    """Per choice: content, the calls assembled from delta.tool_calls, finish reasons."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"content": "", "calls": [], "finish": []})
            o["content"] += ch.delta.content or ""
            for f in ch.delta.tool_calls or []:
                if f.id is not None:  # a call's first fragment: index, id, type, name
                    assert f.index == len(o["calls"]) and f.type == "function" and f.function.name
                    o["calls"].append({"id": f.id, "name": f.function.name, "arguments": f.function.arguments or ""})
                else:
                    assert f.function.name is None
                    o["calls"][f.index]["arguments"] += f.function.arguments
            if ch.finish_reason is not None:
                o["finish"].append(ch.finish_reason)
    return out


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.fixture(scope="module")
def auto_reply(client):
    return client.chat.completions.create(model=MODEL, messages=COPY, tools=TOOLS, tool_choice="auto",
                                          max_tokens=48, temperature=0)


def test_auto_parses_the_hermes_call_the_model_writes(client, auto_reply):
    c = auto_reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    assert _check_call("get_weather", call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    s = _streamed(client.chat.completions.create(model=MODEL, messages=COPY, tools=TOOLS, max_tokens=48,
                                                 temperature=0, stream=True))[0]
    assert s["finish"] == ["tool_calls"] and s["content"] == ""
    [streamed] = s["calls"]
    assert streamed["name"] == "get_weather"
    assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)


def test_follow_up_turn_with_the_tool_result_renders_and_answers(client, tokenizer, auto_reply):
    assistant = auto_reply.choices[0].message  # sent back as the client returned it
    call_id = assistant.tool_calls[0].id
    messages = [{"role": "user", "content": ASK}, assistant,
                {"role": "tool", "tool_call_id": call_id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls
    # The server rendered exactly what the template makes of tools, call and result.
    body = {"messages": [messages[0], assistant.model_dump(exclude_none=True), messages[2]], "tools": TOOLS}
    local = render_chat_prompt(tokenizer, ChatCompletionRequest.model_validate(body), read_chat_template(TEMPLATE))
    assert r.usage.prompt_tokens == len(local.token_ids)
    assert json.dumps(WEATHER) in local.text  # the tools
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in local.text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in local.text
    # tool_choice "none": the tools are still rendered, the reply is plain text.
    r = client.chat.completions.create(model=MODEL, messages=COPY, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_gives_valid_calls(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS, tool_choice="required",
              max_tokens=96, temperature=1.0, seed=7, n=3)
    if stream:
        choices = [(o["finish"][0], o["content"] or None, o["calls"])
                   for _, o in sorted(_streamed(client.chat.completions.create(**kw, stream=True)).items())]
    else:
        r = client.chat.completions.create(**kw)
        choices = [(c.finish_reason, c.message.content, [{"name": t.function.name, "arguments": t.function.arguments}
                                                         for t in c.message.tool_calls]) for c in r.choices]
    assert len(choices) == 3
    for finish, content, calls in choices:
        assert finish == "tool_calls" and content is None and calls
        for call in calls:
            _check_call(call["name"], call["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_always_gives_that_call(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS, max_tokens=64,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=5, n=3)
    if stream:
        choices = [(o["finish"][0], o["calls"]) for _, o in
                   sorted(_streamed(client.chat.completions.create(**kw, stream=True)).items())]
    else:
        r = client.chat.completions.create(**kw)
        choices = [(c.finish_reason, [{"name": t.function.name, "arguments": t.function.arguments}
                                      for t in c.message.tool_calls]) for c in r.choices]
    for finish, calls in choices:
        assert finish == "stop"  # as OpenAI and vLLM answer a forced function
        [call] = calls
        assert call["name"] == "get_weather"
        _check_call("get_weather", call["arguments"])


def _bad(client, param: str, phrase: str, **kw) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, **{"messages": COPY[-1:], **kw})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and phrase in e.value.body["message"], e.value.body


def test_bad_tool_requests_are_400s_naming_the_field(client):
    _bad(client, "tools[0].function.name", "required", tools=[{"type": "function", "function": {"parameters": {}}}])
    _bad(client, "tool_choice", "'nope', which is not in `tools` (given: 'get_weather', 'get_time')",
         tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    _bad(client, "tool_choice", "needs `tools`", tool_choice="auto")
    _bad(client, "tool_choice", 'must be "none", "auto", "required"', tools=TOOLS, tool_choice="always")
    _bad(client, "messages[1].tool_call_id", "needs tool_call_id",
         messages=[{"role": "user", "content": ASK}, {"role": "tool", "content": "18"}])
    _bad(client, "messages[1].tool_calls[0].function.arguments", "not JSON",
         messages=[{"role": "user", "content": ASK}, {"role": "assistant", "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}])
    _bad(client, "tool_choice", "enforced through structured outputs", tools=TOOLS, tool_choice="required",
         response_format={"type": "json_object"})
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    _bad(client, "tools[1].function.parameters", "does not compile", tools=[WEATHER, broken],
         tool_choice={"type": "function", "function": {"name": "f"}})
    _bad(client, "tools", "does not compile", tools=[WEATHER, broken], tool_choice="required")
    r = client.chat.completions.create(model=MODEL, messages=COPY[-1:], max_tokens=4, temperature=0)
    assert r.choices[0].message.content  # and it serves on
