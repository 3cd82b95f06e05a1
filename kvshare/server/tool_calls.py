"""Tool calling for one chat request: `tools` + `tool_choice` + `parallel_tool_calls` -> a ToolPlan
(how the reply is read, and for `required` or a named function the JSON schema structured outputs
enforce, as vLLM builds it), and the reply -> OpenAI's `tool_calls`, whole or streamed."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import StructuredOutputsParams
from kvshare.server.tool_parsers import TOOL_PARSERS, ToolParser
from kvshare.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from kvshare.server.tool_stream import ToolCallStream

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parameters_schema(tool) -> dict:
    return tool.function.parameters if tool.function.parameters else dict(EMPTY_PARAMETERS)


def required_schema(tools: list, parallel: bool) -> dict:
    """At least one call (exactly one without parallel calls), each {"name": <a tool's name>,
    "parameters": <that tool's parameters>}. Each tool's $defs move to the root, where its
    "#/$defs/..." references now resolve."""
    defs: dict = {}
    items = []
    for i, tool in enumerate(tools):
        params = dict(parameters_schema(tool))
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise InvalidRequestError(f"tools[{i}].function.parameters.$defs.{key} differs from another tool's "
                                          f"'{key}' definition; with tool_choice \"required\" all tools share one "
                                          f"$defs, so give the definitions different names", "tools")
            defs[key] = value
        items.append({"type": "object", "properties": {"name": {"type": "string", "const": tool.function.name},
                                                        "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolPlan:
    choice: str  # "auto", "required" or "function" (a named function)
    parser: ToolParser
    parallel: bool = True
    schema: dict | None = None  # what structured outputs enforce (required and named)
    schema_field: str = "tools"  # where the schema came from, for compile errors

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        # vLLM's rule: a named function keeps "stop", as OpenAI does for a forced function.
        if called and reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """A finished reply's (content, tool_calls)."""
        found = self.parser.extract_tool_calls(text)
        if not found.tools_called:
            return text, []
        calls = found.tool_calls if self.parallel else found.tool_calls[:1]
        return found.content, [{"id": tool_call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in calls]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parser, self.parallel, tool_call_id)

    def structured_outputs(self) -> StructuredOutputsParams:
        """What makes the model write `schema` (required and named); compile errors name the tools."""
        return StructuredOutputsParams(json=self.schema, source_field=self.schema_field)


def plan_tool_calls(req, auto_parser: str | None) -> ToolPlan | None:
    """The plan for a request, or None when the reply is plain text (no tools, or tool_choice
    "none": the template still gets the tools, as in vLLM). `auto_parser` is the
    --tool-call-parser when --enable-auto-tool-choice is set, else None."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's and vLLM's default
    if choice == "none":
        return None
    if req.tools is None:
        raise InvalidRequestError(f"tool_choice {_show(choice)} needs `tools`: give the functions the model may "
                                  f"call", "tool_choice")
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise InvalidRequestError(f"tools[{i}].function.name '{tool.function.name}' is also the name of "
                                      f"tools[{names[tool.function.name]}]: tool names must be unique",
                                      f"tools[{i}].function.name")
        names[tool.function.name] = i
    parallel = req.parallel_tool_calls is not False
    if choice == "auto":
        if auto_parser is None:
            raise InvalidRequestError(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", TOOL_PARSERS[auto_parser](), parallel)
    if choice == "required":
        if not tools:
            return None  # vLLM: "required" with an empty list behaves as "none"
        return ToolPlan("required", RequiredToolParser(), parallel, required_schema(tools, parallel))
    name = choice["function"]["name"]
    if name not in names:
        listed = ", ".join(f"'{n}'" for n in names) or "none"
        raise InvalidRequestError(f"tool_choice names the function '{name}', which is not in `tools` (given: "
                                  f"{listed})", "tool_choice")
    i = names[name]
    return ToolPlan("function", NamedToolParser(name), parallel, parameters_schema(tools[i]),
                    f"tools[{i}].function.parameters")


def _show(choice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"{{function: {choice['function']['name']}}}"
