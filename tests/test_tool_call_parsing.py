"""Tool calls without a model or a tokenizer: the growing-JSON scanner the parsers share
(json_scan.py), the snapshot contract every parser must keep (each later snapshot extends the
earlier one, and the last agrees with the whole-reply reading), the stream's fragment protocol
(tool_stream.py), and the plans' refusals and schemas (tool_calls.py)."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.server.protocol import ChatCompletionRequest
from kvshare.server.tool_calls import EMPTY_PARAMETERS, plan_tool_calls, required_schema
from kvshare.server.tool_parsers import TOOL_PARSERS
from kvshare.server.tool_parsers.base import PartialToolCall, Snapshot, ToolCall, hold_back
from kvshare.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from kvshare.server.tool_parsers.json_scan import (
    call_from_object,
    partial_call,
    partial_object,
    scan_string,
    scan_value,
    skip_ws,
)
from kvshare.server.tool_stream import ToolCallStream

# ---- json_scan -------------------------------------------------------------------------------


def test_skip_ws_skips_json_whitespace_only():
    assert skip_ws(" \t\r\n x", 0) == 5
    assert skip_ws("x", 0) == 0 and skip_ws("  ", 0) == 2
    assert skip_ws("\u00a0x", 0) == 0  # not JSON whitespace


@pytest.mark.parametrize("text,end", [
    ('"abc" tail', 5), ('"a\\"b"', 6), ('"a\\\\"x', 5), ('""', 2), ('"\\u00e9"', 8),
    ('"abc', None), ('"a\\"', None), ('"a\\', None),
])
def test_scan_string_finds_the_closing_quote_past_escapes(text, end):
    assert scan_string(text, 0) == end


@pytest.mark.parametrize("text,end", [
    ('{"a": [1, {"b": "}]"}]} rest', 23), ("[1, 2]x", 6), ('"s"', 3), ("true,", 4), ("-1.5e3}", 6),
    ("null]", 4), ("[[[]]]", 6),
    ("{", None), ('{"a": "}', None), ("[1, 2", None), ("12", None), ("tru", None), ("", None),
])
def test_scan_value_says_where_a_value_ends_or_that_it_has_not(text, end):
    assert scan_value(text, 0) == end


@pytest.mark.parametrize("text", ["}", ":x", ",", "]"])
def test_scan_value_refuses_what_cannot_start_a_value(text):
    with pytest.raises(ValueError):
        scan_value(text, 0)


def test_partial_object_reads_the_fields_written_so_far():
    text = '{"name": "f", "arguments": {"x": [1, 2]}, "n": 3}'
    fields, end = partial_object(text, 0)
    assert end == len(text)
    assert {k: text[a:b] for k, (a, b) in fields.items()} == {"name": '"f"', "arguments": '{"x": [1, 2]}', "n": "3"}
    for cut, expected in [(1, {}), (9, {}), (12, {"name": '"f"'}), (30, {"name": '"f"', "arguments": None})]:
        fields, end = partial_object(text[:cut], 0)
        assert end is None
        assert {k: (text[a:b] if b is not None else None) for k, (a, b) in fields.items()} == expected, cut
    # A number at the very end may still go on: its end is unknown.
    fields, end = partial_object('{"n": 12', 0)
    assert fields == {"n": (6, None)} and end is None


@pytest.mark.parametrize("text", ['[1]', '{1: 2}', '{"a" 1}', '{"a": }'])
def test_partial_object_refuses_text_that_is_not_an_object(text):
    with pytest.raises(ValueError):
        partial_object(text, 0)


def test_partial_call_takes_the_first_argument_key_present_and_a_prefix_while_unfinished():
    text = '{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}'
    fields, _ = partial_object(text, 0)
    assert partial_call(text, fields, ("arguments", "parameters")) == PartialToolCall("f", '{"b": 2}')
    assert partial_call(text, fields, ("parameters", "arguments")) == PartialToolCall("f", '{"a": 1}')
    cut = '{"name": "f", "arguments": {"b": [1, '
    fields, _ = partial_object(cut, 0)
    assert partial_call(cut, fields, ("arguments",)) == PartialToolCall("f", '{"b": [1, ')
    unnamed = '{"name": "get_wea'
    assert partial_call(unnamed, partial_object(unnamed, 0)[0], ("arguments",)) == PartialToolCall(None, "")
    bad = '{"name": 5}'
    with pytest.raises(ValueError):
        partial_call(bad, partial_object(bad, 0)[0], ("arguments",))


def test_call_from_object_reserialises_the_arguments_and_refuses_other_shapes():
    assert call_from_object({"name": "f", "arguments": {"é": 1}}, ("arguments",)) == ToolCall("f", '{"é": 1}')
    assert call_from_object({"name": "f"}, ("arguments",)) == ToolCall("f", "{}")
    assert call_from_object({"name": "f", "parameters": {"a": None}}, ("arguments", "parameters")).arguments == \
        '{"a": null}'
    for obj in ([], {"arguments": {}}, {"name": 3}, {"name": "f", "arguments": "{}"}, {"name": "f", "arguments": [1]}):
        with pytest.raises(ValueError):
            call_from_object(obj, ("arguments",))


def test_hold_back_keeps_only_a_trailing_proper_prefix_of_the_tag():
    tag = "<tool_call>"
    assert hold_back("text <", tag) == "text "
    assert hold_back("text <tool_cal", tag) == "text "
    assert hold_back("text <tool_call>", tag) == "text <tool_call>"  # the whole tag is not held here
    assert hold_back("a<t<", tag) == "a<t"
    assert hold_back("", tag) == "" and hold_back("plain", tag) == "plain"


# ---- the snapshot contract, for every parser, on every prefix ---------------------------------

def hermes(*calls, before=""):
    return before + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                            for n, a in calls)


ARGS = {"text": "a \"quote\", a } and ] and <tool_call>", "n": -12.5e2, "flags": [True, False, None],
        "nested": {"deep": [{"x": "é中"}]}}
REPLIES = [
    ("hermes", hermes(("lookup", ARGS), before="Checking.\n"), "Checking.\n", [("lookup", ARGS)]),
    ("hermes", hermes(("a", {}), ("b", {"k": 1})), None, [("a", {}), ("b", {"k": 1})]),
    ("hermes", '<tool_call>{"parameters": {"k": "v"}, "name": "p"}</tool_call>', None, [("p", {"k": "v"})]),
    ("hermes", "Use <tool_calls> like <tool_ sparingly", None, []),
    ("llama3_json", json.dumps({"name": "lookup", "parameters": ARGS}), None, [("lookup", ARGS)]),
    ("llama3_json", '  <|python_tag|> {"name": "a", "parameters": {}} ;\n{"name": "b", "arguments": {"k": [1]}}',
     None, [("a", {}), ("b", {"k": [1]})]),
    ("llama3_json", "<|python_tag|>plain words", None, []),
    ("pythonic", "[lookup(text='a \"quote\", a } and ] and <tool_call>', n=-1250.0, flags=[True, False, None], "
                 "nested={'deep': [{'x': 'é中'}]})]", None, [("lookup", ARGS)]),
    ("pythonic", "<|python_start|>[a(), b(k=[1, (2, 3)])]<|python_end|>", None, [("a", {}), ("b", {"k": [1, [2, 3]]})]),
    ("pythonic", "[]", None, []),
]


# Replies that start like calls and turn out not to be: read whole they are content, but a stream
# has announced the call before the text that spoils it arrives (it cannot take a fragment back).
# Only the snapshot contract holds for them.
SPOILED = [
    ("llama3_json", '{"name": "a", "parameters": {}} and more'),
    ("pythonic", "[f(1, 2)]"),  # positional arguments are not a call's shape here
    ("pythonic", "[f(**kw)]"),
]


def snapshots(parser, text):
    return [parser.snapshot(text[:i], final=False) for i in range(len(text) + 1)] + [parser.snapshot(text, True)]


@pytest.mark.parametrize("name,text", [r[:2] for r in REPLIES] + SPOILED)
def test_every_snapshot_extends_the_one_before(name, text):
    parser = TOOL_PARSERS[name]()
    previous = Snapshot("")
    for i, snap in enumerate(snapshots(parser, text)):
        where = f"prefix {i}: {text[:i]!r}"
        assert snap.content.startswith(previous.content), where
        assert len(snap.calls) >= len([c for c in previous.calls if c.name is not None]), where
        for old, new in zip(previous.calls, snap.calls):
            if old.name is not None:
                assert new.name == old.name, where
                assert new.arguments.startswith(old.arguments), where
        previous = snap


@pytest.mark.parametrize("name,text,content,calls", REPLIES)
def test_the_final_snapshot_agrees_with_the_whole_reply(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    whole = parser.extract_tool_calls(text)
    assert whole.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert whole.content == (content if calls else text)
    final = parser.snapshot(text, final=True)
    if calls:
        assert final.content == (content or "")
        assert [(c.name, json.loads(c.arguments)) for c in final.calls] == calls
    else:
        assert final.content == text


@pytest.mark.parametrize("name,text", SPOILED)
def test_a_spoiled_call_is_content_when_read_whole(name, text):
    whole = TOOL_PARSERS[name]().extract_tool_calls(text)
    assert not whole.tools_called and whole.content == text and whole.tool_calls == []


def stream(parser, pieces, parallel=True):
    ids = (f"id{i}" for i in itertools.count())
    s = ToolCallStream(parser, parallel, lambda: next(ids))
    content, calls, log = "", [], []
    for k, piece in enumerate(pieces):
        text, fragments = s.feed(piece, final=k == len(pieces) - 1)
        content += text
        log += fragments
        for f in fragments:
            if "id" in f:
                assert f["index"] == len(calls) and f["type"] == "function"
                calls.append([f["id"], f["function"]["name"], f["function"]["arguments"]])
            else:
                assert set(f) == {"index", "function"} and f["function"]["arguments"]
                calls[f["index"]][2] += f["function"]["arguments"]
    return content, calls, log, s


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name,text,content,calls", REPLIES)
def test_streamed_in_random_pieces_the_fragments_add_up_to_the_whole(name, text, content, calls, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got_content, got_calls, _, s = stream(TOOL_PARSERS[name](), pieces)
    assert got_content == ((content or "") if calls else text)
    assert [(n, json.loads(a)) for _, n, a in got_calls] == calls
    assert s.called == bool(calls)
    assert len({i for i, _, _ in got_calls}) == len(got_calls)  # one id per call


def test_a_call_is_announced_once_its_name_is_whole_and_later_calls_wait_for_it():
    parser = TOOL_PARSERS["hermes"]()
    s = ToolCallStream(parser, True, lambda: "x")
    assert s.feed('<tool_call>{"name": "get_') == ("", [])
    assert not s.called
    content, fragments = s.feed('weather", "arguments": {"c')
    assert fragments == [{"index": 0, "id": "x", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"c'}}]
    assert s.called
    assert s.feed('ity": 1}}</tool_call>')[1] == [{"index": 0, "function": {"arguments": 'ity": 1}'}}]
    assert s.feed("\n") == ("", [])  # nothing new: no empty fragment


def test_without_parallel_calls_a_second_call_is_never_announced():
    text = hermes(("a", {"k": 1}), ("b", {"k": 2}))
    _, calls, log, _ = stream(TOOL_PARSERS["hermes"](), list(text), parallel=False)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("a", {"k": 1})]
    assert all(f["index"] == 0 for f in log)


def test_the_constrained_readers_stream_and_read_whole():
    reply = json.dumps([{"name": "a", "parameters": {"k": [1, 2]}}, {"name": "b", "parameters": {}}])
    whole = RequiredToolParser().extract_tool_calls(reply)
    assert whole.tools_called and [c.name for c in whole.tool_calls] == ["a", "b"]
    _, calls, _, _ = stream(RequiredToolParser(), list(reply))
    assert [(n, json.loads(a)) for _, n, a in calls] == [("a", {"k": [1, 2]}), ("b", {})]
    for cut in ("[]", "{}", reply[:-1], '[{"name": 1}]'):
        assert not RequiredToolParser().extract_tool_calls(cut).tools_called
    assert RequiredToolParser().snapshot("garbage", True) == Snapshot("", [])
    named = NamedToolParser("f")
    assert named.snapshot('{"a":', False) == Snapshot("", [PartialToolCall("f", '{"a":')])
    assert named.extract_tool_calls("{}").tool_calls == [ToolCall("f", "{}")]


# ---- plans ------------------------------------------------------------------------------------

def tool(name, parameters=None):
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


def test_a_named_function_must_be_among_the_tools_and_the_error_lists_them():
    with pytest.raises(InvalidRequestError) as err:
        plan_tool_calls(req(tools=[tool("a"), tool("b")], tool_choice={"type": "function", "function": {"name": "c"}}),
                        None)
    assert err.value.param == "tool_choice" and "'c'" in str(err.value) and "(given: 'a', 'b')" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        plan_tool_calls(req(tool_choice={"type": "function", "function": {"name": "c"}}), None)
    assert "{function: c} needs `tools`" in str(err.value)


def test_a_named_function_plan_enforces_that_functions_parameters_and_names_them_in_errors():
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    plan = plan_tool_calls(req(tools=[tool("a"), tool("b", params)],
                               tool_choice={"type": "function", "function": {"name": "b"}}), None)
    assert plan.choice == "function" and plan.schema == params
    so = plan.structured_outputs()
    assert so.json == params and so.source_field == "tools[1].function.parameters"
    content, calls = plan.message('{"q": "x"}')
    assert content is None and len(calls) == 1 and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"] == {"name": "b", "arguments": '{"q": "x"}'} and calls[0]["type"] == "function"


def test_a_tool_without_parameters_gets_an_empty_object_schema():
    plan = plan_tool_calls(req(tools=[tool("a")], tool_choice={"type": "function", "function": {"name": "a"}}), None)
    assert plan.schema == EMPTY_PARAMETERS == {"type": "object", "properties": {}}
    assert plan.schema is not EMPTY_PARAMETERS
    empty = plan_tool_calls(req(tools=[tool("a", {})], tool_choice={"type": "function", "function": {"name": "a"}}),
                            None)
    assert empty.schema == EMPTY_PARAMETERS  # an empty parameters object is the same as none


def test_required_merges_defs_and_refuses_two_different_ones_of_one_name():
    p1 = {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "integer"}}}
    p2 = {"type": "object", "properties": {"y": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "integer"}}}
    schema = required_schema(req(tools=[tool("a", p1), tool("b", p2)]).tools, parallel=True)
    assert schema["$defs"] == {"X": {"type": "integer"}}
    assert all("$defs" not in item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    assert "maxItems" not in schema and schema["minItems"] == 1
    p3 = {"type": "object", "$defs": {"X": {"type": "string"}}}
    with pytest.raises(InvalidRequestError) as err:
        required_schema(req(tools=[tool("a", p1), tool("b", p3)]).tools, parallel=True)
    assert err.value.param == "tools" and "tools[1].function.parameters.$defs.X" in str(err.value)


def test_the_auto_plan_uses_the_servers_parser_and_ids_are_fresh():
    for name in TOOL_PARSERS:
        plan = plan_tool_calls(req(tools=[tool("a")]), name)
        assert plan.choice == "auto" and plan.parser.name == name and plan.schema is None
    plan = plan_tool_calls(req(tools=[tool("a")], parallel_tool_calls=False), "hermes")
    assert plan.parallel is False
    ids = {plan.message(hermes(("a", {})))[1][0]["id"] for _ in range(5)}
    assert len(ids) == 5
    assert plan.finish_reason(False, "length") == "length" and plan.finish_reason(True, None) is None
