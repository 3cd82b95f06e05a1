"""`llama3_json`: Llama 3.1/3.2 JSON calls, the reply being only calls, separated by ';' and
optionally after <|python_tag|>:  {"name": "get_weather", "parameters": {"city": "Paris"}}
A reply that does not start with '{' (or the tag) is plain content."""
from __future__ import annotations

import json

from kvshare.server.tool_parsers.base import ExtractedToolCalls, Snapshot, ToolParser, hold_back
from kvshare.server.tool_parsers.json_scan import call_from_object, partial_call, partial_object, skip_ws

BOT = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


def _body_start(text: str) -> int:
    i = skip_ws(text, 0)
    if text.startswith(BOT, i):
        i = skip_ws(text, i + len(BOT))
    return i


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        i = _body_start(text)
        if not text.startswith("{", i):
            return ExtractedToolCalls(False, [], text)
        decoder = json.JSONDecoder()
        calls = []
        try:
            while True:
                obj, i = decoder.raw_decode(text, i)
                calls.append(call_from_object(obj, ARGUMENT_KEYS))
                i = skip_ws(text, i)
                if i == len(text):
                    break
                if text[i] != ";":
                    raise ValueError("calls must be separated by ';'")
                i = skip_ws(text, i + 1)
        except ValueError:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = _body_start(text)
        if i == len(text) or (not final and hold_back(text[i:], BOT) == ""):
            return Snapshot(text if final else "")  # nothing yet, or the tag still arriving
        if text[i] != "{":
            return Snapshot(text)
        calls = []
        try:
            while i < len(text) and text[i] == "{":
                fields, end = partial_object(text, i)
                calls.append(partial_call(text, fields, ARGUMENT_KEYS))
                if end is None:
                    break
                i = skip_ws(text, end)
                if not text.startswith(";", i):
                    break
                i = skip_ws(text, i + 1)
        except ValueError:
            pass
        if final and not any(c.name for c in calls):
            return Snapshot(text)
        return Snapshot("", calls)
