"""Request bodies of the OpenAI API (with vLLM's extra sampling fields), validated strictly.

Unknown fields and wrong JSON types are errors rather than silently ignored or coerced: a client
that misspells `max_tokens` should learn it from the answer. Union-typed fields (prompt, stop,
message content) have their own validators so the error names what is allowed in one sentence.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from kvshare.errors import InvalidRequestError
from kvshare.server.ignored_fields import OpenAIIgnoredFields

INT64 = 2**63


def _describe(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt(value: Any, info: ValidationInfo) -> list[str | list[int]]:
    """One prompt or several: text, token ids, or a list of either (each is its own request)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if not value:
            raise PydanticCustomError("prompt_empty", "'prompt' is an empty list: give at least one prompt")
        limit = (info.context or {}).get("max_prompts")
        if limit is not None and len(value) > limit and isinstance(value[0], (str, list)):
            # Before the per-prompt checks: a body of ~10^6 prompts costs seconds to validate.
            raise PydanticCustomError(
                "prompt_count", "'prompt' holds {count} prompts, more than one request may ask for: at most {limit} "
                                "(--max-sequences-per-request)", {"count": len(value), "limit": limit})
        if all(isinstance(x, str) for x in value):
            return list(value)
        if _is_ids(value):
            return [list(value)]
        if all(_is_ids(x) for x in value):
            return [list(x) for x in value]
    raise PydanticCustomError(
        "prompt_type", "'prompt' must be a string, a list of strings, a list of token ids (integers) or a list "
                       "of token-id lists; got {got}", {"got": _describe(value)})


def _stop(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise PydanticCustomError("stop_type", "'stop' must be a string or a list of strings; got {got}",
                              {"got": _describe(value)})


def _content(value: Any) -> str | None:
    """Message content: a string, or a list of text parts (joined with newlines, as vLLM does)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                raise PydanticCustomError(
                    "content_part", "content parts must be {\"type\": \"text\", \"text\": <string>} (kvshare "
                                    "serves a text-only model); got {got}", {"got": _describe(part)})
            texts.append(part["text"])
        return "\n".join(texts)
    raise PydanticCustomError("content_type", "message content must be a string or a list of text parts; got {got}",
                              {"got": _describe(value)})


def _tool_choice(value: Any) -> Any:
    """"none", "auto", "required", or {"type": "function", "function": {"name": ...}} (OpenAI's shapes)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if (isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}
            and isinstance(value["function"], dict) and set(value["function"]) == {"name"}
            and isinstance(value["function"]["name"], str) and value["function"]["name"]):
        return value
    raise PydanticCustomError(
        "tool_choice_type", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                            '<a tool\'s name>}}; got {got}', {"got": _describe(value)})


Prompt = Annotated[Any, BeforeValidator(_prompt)]
Stop = Annotated[Any, BeforeValidator(_stop)]
Content = Annotated[Any, BeforeValidator(_content)]
ToolChoice = Annotated[Any, BeforeValidator(_tool_choice)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted for vLLM clients; usage comes once, at the end


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request extra (one of json, regex, choice, grammar, json_object)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class _Sampling(_Strict):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None  # as in vLLM: optional, the served model when absent
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # only {} is accepted: kvshare has no logit bias
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None  # vLLM takes it on completions too
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # not with stream: true (as vLLM)
    priority: int = Field(0, ge=-INT64, lt=INT64)  # vLLM's; other than 0 only with --scheduling-policy priority
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds from arrival: then finish_reason "timeout"


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)  # accepted only equal to n
    suffix: str | None = None  # not supported: only null is accepted


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI returns it


class ChatCompletionMessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # role "tool": the call this message answers
    # Fields a client echoes back from an earlier assistant message; only their empty values.
    refusal: str | None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(_Sampling, OpenAIIgnoredFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's deprecated name for max_completion_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    # vLLM's chat extras
    continue_final_message: bool = False  # excludes an explicit add_generation_prompt: true
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    echo: bool = False  # the last message's content opens the answer when its role is the answer's


# ---- turning bytes and pydantic errors into one clear sentence ---------------------------

def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    param = _param(loc) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unknown field '{param}'"
        if len(loc) == 1:
            msg += f"; allowed fields: {', '.join(sorted(model.model_fields))}"
    elif kind == "missing":
        msg = f"'{param}' is required"
    elif kind in ("prompt_empty", "prompt_type", "prompt_count", "stop_type", "content_part", "content_type", "tool_choice_type"):
        msg = err["msg"] if kind.startswith(("prompt", "stop")) else f"'{param}': {err['msg']}"
    else:
        msg = f"'{param}' is invalid: {err['msg'].rstrip('.')} (got {_describe(err.get('input'))})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s) in the request)"
    return InvalidRequestError(msg, param)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(value: Any) -> None:
    """Lone UTF-16 surrogates ('\\ud800') parse as JSON but are not text any tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"a string in the request holds an unpaired surrogate escape ({value[e.start]!r}); strings "
                f"must be valid Unicode text", None) from None
    elif isinstance(value, list):
        for v in value:
            _check_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            _check_text(v)


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes, model: type[BaseModel], context: dict | None = None) -> BaseModel:
    """``context``: the server's limits the validators check ({"max_prompts": N})."""
    return validate_body(load_json_object(raw), model, context)


def load_json_object(raw: bytes) -> dict:
    """The body as a JSON object of valid Unicode text, or one clear 400."""
    if not raw:
        raise InvalidRequestError("the request body is empty: send a JSON object", None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(
            f"the request body is not valid UTF-8 (invalid byte {raw[e.start:e.start + 1]!r} at offset {e.start}); "
            f"send JSON encoded as UTF-8", None) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None) from None
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got a JSON {type(obj).__name__}", None)
    try:
        if _ESCAPED_SURROGATE.search(text):  # (strict UTF-8 decoding lets no other surrogate in)
            _check_text(obj)
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply", None) from None
    return obj


def validate_body(obj: dict, model: type[BaseModel], context: dict | None = None) -> BaseModel:
    try:
        return model.model_validate(obj, context=context)
    except ValidationError as e:
        raise describe_validation_error(e, model) from None
