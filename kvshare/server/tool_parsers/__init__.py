"""Tool-call parsers for `tool_choice: "auto"`, by their vLLM names (--tool-call-parser)."""
from __future__ import annotations

from types import MappingProxyType

from kvshare.server.tool_parsers.base import ExtractedToolCalls, PartialToolCall, Snapshot, ToolCall, ToolParser
from kvshare.server.tool_parsers.hermes import HermesToolParser
from kvshare.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvshare.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS = MappingProxyType({p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)})

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "PartialToolCall", "Snapshot", "ToolCall", "ToolParser"]
