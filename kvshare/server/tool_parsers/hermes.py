"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, one JSON object per block:
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
Text before the first block is the reply's content; the tags are matched as text, so the parser
works whether or not the tokenizer has them as single tokens."""
from __future__ import annotations

import json
import re

from kvshare.server.tool_parsers.base import ExtractedToolCalls, Snapshot, ToolParser, hold_back
from kvshare.server.tool_parsers.json_scan import call_from_object, partial_call, partial_object, skip_ws

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
ARGUMENT_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        first = text.find(START)
        if first < 0:
            return ExtractedToolCalls(False, [], text)
        try:
            calls = [call_from_object(json.loads(closed or unclosed), ARGUMENT_KEYS)
                     for closed, unclosed in _BLOCK.findall(text)]
        except ValueError:  # json.JSONDecodeError is one
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, text[:first] or None)

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(START)
        if first < 0:
            return Snapshot(text if final else hold_back(text, START))
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(START)
            end = text.find(END, body_start)
            if end >= 0:
                body = text[body_start:end]
            else:  # an unfinished block; a partial end tag is not part of its JSON
                body = text[body_start:] if final else hold_back(text[body_start:], END)
            j = skip_ws(body, 0)
            if j < len(body):
                try:
                    fields, _ = partial_object(body, j)
                    calls.append(partial_call(body, fields, ARGUMENT_KEYS))
                except ValueError:
                    break
            if end < 0:
                break
            pos = text.find(START, end + len(END))
        if final and not any(c.name for c in calls):
            return Snapshot(text)  # nothing was a call after all: the whole reply is content
        return Snapshot(text[:first], calls)
