"""`pythonic`: calls as a Python list of keyword-argument calls (Llama 3.2 / Llama 4 style):
[get_weather(city="Paris"), get_time(zone="CET")]
optionally inside <|python_start|> ... <|python_end|>. Values are Python literals; arguments come
out as JSON objects. A reply that does not start with '[' is plain content."""
from __future__ import annotations

import ast
import json
import re

from kvshare.server.tool_parsers.base import ExtractedToolCalls, PartialToolCall, Snapshot, ToolCall, ToolParser
from kvshare.server.tool_parsers.base import hold_back

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_]\w*")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=\s*")


def _strip_tags(text: str) -> str:
    s = text.strip()
    if s.startswith(START):
        s = s[len(START):]
    if s.endswith(END):
        s = s[:-len(END)]
    return s.strip()


def _json_arguments(pairs: list[tuple[str, object]], closed: bool) -> str:
    # json.dumps of the same dict gives the same text, so streamed and whole replies agree.
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


def _call(node: ast.expr) -> ToolCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise ValueError("each element must be a call f(key=value, ...)")
    pairs = [(kw.arg, ast.literal_eval(kw.value)) for kw in node.keywords]
    if any(k is None for k, _ in pairs):
        raise ValueError("**kwargs are not arguments")
    return ToolCall(node.func.id, _json_arguments(pairs, True))


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    quote, j = s[i], i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == quote:
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Index of the ',' or ')' that ends the argument value starting at s[i]; None if unfinished."""
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c in "'\"":
            end = _scan_string(s, j)
            if end is None:
                return None
            j = end
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j
            depth -= 1
        elif c == "," and depth == 0:
            return j
        j += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        s = _strip_tags(text)
        if not s.startswith("["):
            return ExtractedToolCalls(False, [], text)
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            calls = [_call(e) for e in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    def snapshot(self, text: str, final: bool) -> Snapshot:
        s = text.lstrip()
        if s.startswith(START):
            s = s[len(START):].lstrip()
        if not s or (not final and hold_back(s, START) == ""):
            return Snapshot(text if final else "")
        if s[0] != "[":
            return Snapshot(text)
        calls = []
        try:
            self._calls(s, calls)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            pass  # the calls read so far stand; nothing more will be streamed
        if final and not calls:
            return Snapshot(text)
        return Snapshot("", calls)

    def _calls(self, s: str, calls: list[PartialToolCall]) -> None:
        i = 1
        while True:
            i = _skip(s, i)
            m = _NAME.match(s, i)
            if m is None:
                return
            i = _skip(s, m.end())
            if i >= len(s) or s[i] != "(":
                return  # the name may not be finished yet
            name, i = m.group(0), i + 1
            pairs: list[tuple[str, object]] = []
            closed = False
            while True:
                i = _skip(s, i)
                if s.startswith(")", i):
                    closed, i = True, i + 1
                    break
                kw = _KEYWORD.match(s, i)
                if kw is None:
                    break
                end = _value_end(s, kw.end())
                if end is None:
                    break
                pairs.append((kw.group(1), ast.literal_eval(s[kw.end():end].strip())))
                i = end + 1 if s[end] == "," else end
            calls.append(PartialToolCall(name, _json_arguments(pairs, closed)))
            if not closed:
                return
            i = _skip(s, i)
            if not s.startswith(",", i):
                return
            i += 1
