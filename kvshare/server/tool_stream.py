"""One streamed choice's tool calls: successive parser snapshots of the growing reply -> OpenAI's
`delta.content` and `delta.tool_calls` fragments (the first fragment of a call carries its index,
id, type and name; later ones only argument text)."""
from __future__ import annotations

from collections.abc import Callable

from kvshare.server.tool_parsers.base import ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser, parallel: bool, new_id: Callable[[], str]) -> None:
        self.parser = parser
        self.parallel = parallel
        self.new_id = new_id
        self.text = ""
        self.sent_content = ""
        self.sent_arguments: list[str] = []  # per call announced so far

    @property
    def called(self) -> bool:
        return bool(self.sent_arguments)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """(new content, new tool-call fragments) once `delta` is added to the reply."""
        self.text += delta
        snap = self.parser.snapshot(self.text, final)
        content = ""
        if snap.content.startswith(self.sent_content):  # a parser never takes text back
            content = snap.content[len(self.sent_content):]
            self.sent_content = snap.content
        fragments = []
        for i, call in enumerate(snap.calls):
            if call.name is None or (i > 0 and not self.parallel):
                break  # later calls wait until this one is named
            if i == len(self.sent_arguments):
                self.sent_arguments.append(call.arguments)
                fragments.append({"index": i, "id": self.new_id(), "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.sent_arguments[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                fragments.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
                self.sent_arguments[i] = call.arguments
        return content, fragments
