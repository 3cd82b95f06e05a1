"""What every tool-call parser returns, and the two things it must do.

A parser reads the model's reply text. `extract_tool_calls` reads a finished reply (a
non-streamed answer). `snapshot` reads the text produced so far and says which part of it is
plain content and which tool calls have started; it must be monotonic (each later snapshot's
content and each call's arguments extend the earlier ones), which is what lets
`ToolCallStream` turn successive snapshots into OpenAI's `delta.tool_calls` fragments.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass(frozen=True)
class PartialToolCall:
    name: str | None  # None until the whole name has been generated
    arguments: str = ""  # the arguments text so far (a prefix of the final JSON text)


@dataclass(frozen=True)
class Snapshot:
    content: str  # plain text that is safe to send (never part of a tool call)
    calls: list[PartialToolCall] = field(default_factory=list)


def hold_back(text: str, tag: str) -> str:
    """`text` without a trailing proper prefix of `tag` (it may yet become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


class ToolParser:
    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def snapshot(self, text: str, final: bool) -> Snapshot:
        raise NotImplementedError
