"""Readers of replies that structured outputs constrain (`tool_choice: "required"` or a named
function): they never have to guess whether the reply is a call."""
from __future__ import annotations

import json

from kvshare.server.tool_parsers.base import ExtractedToolCalls, PartialToolCall, Snapshot, ToolCall, ToolParser
from kvshare.server.tool_parsers.json_scan import call_from_object, partial_call, partial_object, skip_ws

ARGUMENT_KEYS = ("parameters",)


class RequiredToolParser(ToolParser):
    """The reply is the JSON array [{"name": ..., "parameters": {...}}, ...] of the required schema."""

    name = "required"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        try:
            items = json.loads(text)
            if not isinstance(items, list) or not items:
                raise ValueError("not a non-empty array")
            calls = [call_from_object(item, ARGUMENT_KEYS) for item in items]
        except ValueError:  # cut short (max_tokens) before the array closed
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_ws(text, 0)
        calls: list[PartialToolCall] = []
        if text.startswith("[", i):
            i = skip_ws(text, i + 1)
            try:
                while text.startswith("{", i):
                    fields, end = partial_object(text, i)
                    calls.append(partial_call(text, fields, ARGUMENT_KEYS))
                    if end is None:
                        break
                    i = skip_ws(text, end)
                    if not text.startswith(",", i):
                        break
                    i = skip_ws(text, i + 1)
            except ValueError:
                pass
        return Snapshot("", calls)


class NamedToolParser(ToolParser):
    """The reply is the arguments object of the one function tool_choice names."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(True, [ToolCall(self.function_name, text)], None)

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return Snapshot("", [PartialToolCall(self.function_name, text)])
