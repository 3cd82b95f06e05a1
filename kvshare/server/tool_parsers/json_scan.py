"""Reading JSON that may still be growing: where a value ends (None while it has not ended),
and the fields of an object written so far with the text span of each value."""
from __future__ import annotations

import json
import re

from kvshare.server.tool_parsers.base import PartialToolCall, ToolCall

_WS = " \t\n\r"
_LITERAL = re.compile(r"[A-Za-z0-9.+\-]+")


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at s[i] == '"', or None if it is unfinished."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def scan_value(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at s[i], or None if the text ends inside it.
    Raises ValueError where no JSON value can start."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = scan_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _LITERAL.match(s, i)
    if m is None:
        raise ValueError(f"no JSON value starts with {c!r}")
    return None if m.end() == len(s) else m.end()  # a number or literal may go on


def partial_object(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Fields of the JSON object opening at s[i] == '{': key -> (value start, value end or None),
    and the object's end (None while unfinished). Raises ValueError on text that is not JSON."""
    if s[i] != "{":
        raise ValueError("not a JSON object")
    fields: dict[str, tuple[int, int | None]] = {}
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return fields, None
        if s[j] == "}":
            return fields, j + 1
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            raise ValueError(f"expected a key, got {s[j]!r}")
        end = scan_string(s, j)
        if end is None:
            return fields, None
        key = json.loads(s[j:end])
        j = skip_ws(s, end)
        if j >= len(s):
            return fields, None
        if s[j] != ":":
            raise ValueError(f"expected ':', got {s[j]!r}")
        start = skip_ws(s, j + 1)
        if start >= len(s):
            return fields, None
        value_end = scan_value(s, start)
        fields[key] = (start, value_end)
        if value_end is None:
            return fields, None
        j = value_end


def partial_call(s: str, fields: dict[str, tuple[int, int | None]], argument_keys: tuple[str, ...]) -> PartialToolCall:
    """A call object {"name": ..., <argument key>: {...}} read so far; its arguments are the raw
    text of the argument value (a growing prefix of it while unfinished)."""
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, end = fields["name"]
        value = json.loads(s[start:end])
        if not isinstance(value, str):
            raise ValueError("the call's name is not a string")
        name = value
    arguments = ""
    for key in argument_keys:
        if key in fields:
            start, end = fields[key]
            arguments = s[start:end] if end is not None else s[start:]
            break
    return PartialToolCall(name, arguments)


def call_from_object(obj, argument_keys: tuple[str, ...]) -> ToolCall:
    """A ToolCall from a parsed call object (arguments re-serialised), or ValueError."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call must be an object with a string 'name'")
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if not isinstance(args, dict):
        raise ValueError("a tool call's arguments must be an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
