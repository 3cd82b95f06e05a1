"""The tool-call parsers (--tool-call-parser) and the readers of constrained replies, on crafted
replies: whole, and streamed through ToolCallStream one character, one real SmolLM2 token piece,
or random chunks at a time. Streamed pieces must add up to what the whole reply gives."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.loader import bundled_model_path
from kvshare.model.tokenizer import Tokenizer
from kvshare.server.tool_parsers import TOOL_PARSERS
from kvshare.server.tool_parsers.base import hold_back
from kvshare.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from kvshare.server.tool_stream import ToolCallStream

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
SEARCH = ("search", {"query": "a \"quoted\" <tool_call> {brace}", "tags": ["x", "y"], "exact": True, "limit": None})

# (parser, reply, expected content, expected calls); [] calls = plain text, all of it content.
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me check.\n", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n' + json.dumps({"name": SEARCH[0], "arguments": SEARCH[1]}) + '\n</tool_call>',
     None, [WEATHER, SEARCH]),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}</tool_call>',
     None, [WEATHER]),  # name after the arguments
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    + json.dumps({"name": SEARCH[0], "parameters": SEARCH[1]}), None, [WEATHER, SEARCH]),
    ("llama3_json", "The weather is fine {really}.", "The weather is fine {really}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("pythonic", '[get_weather(city="Paris", days=3)]', None, [WEATHER]),
    ("pythonic", "<|python_start|>[get_weather(city='Paris', days=3), search(query='a \"quoted\" <tool_call> "
                 "{brace}', tags=['x', 'y'], exact=True, limit=None)]<|python_end|>", None, [WEATHER, SEARCH]),
    ("pythonic", "Sure, [1, 2] is a list.", "Sure, [1, 2] is a list.", []),
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf_metadata(open_gguf_file(bundled_model_path()).metadata)


def _stream(parser, pieces: list[str], parallel: bool = True):
    ids = (f"call-{i}" for i in itertools.count())
    s = ToolCallStream(parser, parallel, lambda: next(ids))
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, fragments = s.feed(piece, final=k == len(pieces) - 1)
        content += text
        for f in fragments:
            if "id" in f:  # the first fragment of a call: index, id, type, name
                assert f["index"] == len(calls) and f["type"] == "function" and f["id"].startswith("call-")
                calls[f["index"]] = [f["function"]["name"], f["function"]["arguments"]]
            else:
                assert set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
                assert f["function"]["arguments"]
                calls[f["index"]][1] += f["function"]["arguments"]
    return content, [(name, json.loads(args)) for name, args in calls.values()], s.called


def _splits(text: str, tokenizer) -> dict[str, list[str]]:
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert "".join(pieces) == text
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return {"chars": list(text), "tokens": pieces,
            "random": [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], "whole": [text]}


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_whole_and_streamed(name, text, content, calls, tokenizer):
    parser = TOOL_PARSERS[name]()
    got = parser.extract_tool_calls(text)
    assert got.tools_called == bool(calls)
    assert got.content == (content if calls else text)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    for how, pieces in _splits(text, tokenizer).items():
        s_content, s_calls, called = _stream(TOOL_PARSERS[name](), pieces)
        assert s_content == (got.content or ""), how
        assert s_calls == calls and called == bool(calls), how


def test_content_is_held_back_only_while_it_may_become_a_tag():
    assert hold_back("Hi <tool_", "<tool_call>") == "Hi "
    assert hold_back("Hi <b", "<tool_call>") == "Hi <b"
    s = ToolCallStream(TOOL_PARSERS["hermes"](), True, lambda: "id")
    assert s.feed("Hi <") == ("Hi ", [])
    assert s.feed("tool") == ("", [])
    assert s.feed("box> ok") == ("<toolbox> ok", [])  # it was not a tag after all
    s = ToolCallStream(TOOL_PARSERS["hermes"](), True, lambda: "id")
    assert s.feed("Hi <tool", final=True) == ("Hi <tool", [])  # the end releases what was held


def test_unfinished_call_streams_a_prefix_and_a_cut_reply_is_not_a_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    s = ToolCallStream(TOOL_PARSERS["hermes"](), True, lambda: "id")
    content, fragments = s.feed(text)
    assert content == "" and fragments == [{"index": 0, "id": "id", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Par'}}]
    got = TOOL_PARSERS["hermes"]().extract_tool_calls(text)
    assert not got.tools_called and got.content == text


def test_without_parallel_calls_only_the_first_is_streamed():
    text = CASES[1][1]
    _, calls, _ = _stream(TOOL_PARSERS["hermes"](), list(text), parallel=False)
    assert calls == [WEATHER]


def test_required_and_named_readers():
    reply = json.dumps([{"name": WEATHER[0], "parameters": WEATHER[1]}, {"name": SEARCH[0], "parameters": SEARCH[1]}])
    got = RequiredToolParser().extract_tool_calls(reply)
    assert got.tools_called and got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [WEATHER, SEARCH]
    assert _stream(RequiredToolParser(), list(reply)) == ("", [WEATHER, SEARCH], True)
    cut = RequiredToolParser().extract_tool_calls(reply[:30])  # max_tokens ran out
    assert not cut.tools_called and cut.content == reply[:30]
    args = json.dumps(WEATHER[1])
    got = NamedToolParser("get_weather").extract_tool_calls(args)
    assert got.tools_called and [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", args)]
    assert _stream(NamedToolParser("get_weather"), list(args)) == ("", [WEATHER], True)
