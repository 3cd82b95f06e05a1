"""Structured outputs as clients ask for them: OpenAI's `response_format` and vLLM's
`structured_outputs` extra, turned into one StructuredOutputsParams and compiled off the event
loop and off the engine thread, within a time limit."""
from __future__ import annotations

import asyncio

from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import StructuredOutputsParams


def structured_params(req) -> StructuredOutputsParams | None:
    """The request's constraint, or None; a 400 naming the field when it is malformed."""
    so, rf = req.structured_outputs, req.response_format
    if so is not None and rf is not None and rf.type != "text":
        raise InvalidRequestError("give either response_format or structured_outputs, not both", "structured_outputs")
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise InvalidRequestError("response_format.json_schema is only allowed with type 'json_schema'",
                                      "response_format.json_schema")
        return None
    if rf.type == "json_object":
        if rf.json_schema is not None:
            raise InvalidRequestError("response_format.json_schema is only allowed with type 'json_schema'",
                                      "response_format.json_schema")
        return StructuredOutputsParams(json_object=True, source_field="response_format")
    if rf.json_schema is None:
        raise InvalidRequestError("response_format of type 'json_schema' needs 'json_schema' "
                                  "({\"name\": ..., \"schema\": {...}})", "response_format.json_schema")
    schema = rf.json_schema.schema_
    if schema is None:
        raise InvalidRequestError("response_format.json_schema needs 'schema' (a JSON schema object)",
                                  "response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema, source_field="response_format.json_schema.schema")


async def compile_off_loop(structured, spec: StructuredOutputsParams, timeout: float) -> None:
    """Compile (or find cached) on a worker thread, so neither the event loop nor the engine
    waits on it; the engine then finds the grammar in the cache."""
    try:
        await asyncio.wait_for(asyncio.to_thread(structured.compile, spec), timeout)
    except TimeoutError:
        # The worker finishes in the background (its result is cached); this request is refused.
        raise InvalidRequestError(f"{spec.source_field}: the {spec.kind} grammar took longer than "
                                  f"{timeout:g} s to compile; simplify it", spec.source_field) from None
