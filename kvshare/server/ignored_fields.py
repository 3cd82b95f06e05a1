"""Fields the OpenAI chat API defines that mean nothing to kvshare: accepted, ignored, and logged
once per field name per server (the memory of what was logged lives in ServerState).

Fields no API defines stay errors naming the field (protocol.py forbids extras), so a typo is
still caught. OpenAI's deprecated `functions` / `function_call` are accepted only empty.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvshare.errors import InvalidRequestError

logger = logging.getLogger("kvshare.server")


class OpenAIIgnoredFields(BaseModel):
    """Mixed into the chat request model; the types are OpenAI's, so garbage is still a 400."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: str | None = None
    # Deprecated by OpenAI in favour of tools / tool_choice.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


IGNORED_FIELDS = ("metadata", "store", "service_tier", "reasoning_effort", "prediction", "modalities", "audio",
                  "web_search_options", "safety_identifier", "prompt_cache_key", "verbosity")


def check_ignored_fields(req: BaseModel, logged: set[str]) -> None:
    """400 for a non-empty deprecated function field; one log line for each ignored field name
    the first time this server sees it (`logged` is the server's memory of names already logged)."""
    if req.functions:
        raise InvalidRequestError("'functions' is deprecated by OpenAI and not supported: use 'tools'", "functions")
    if req.function_call not in (None, "none"):
        raise InvalidRequestError("'function_call' is deprecated by OpenAI and not supported: use 'tool_choice'",
                                  "function_call")
    for name in IGNORED_FIELDS + ("functions", "function_call"):
        if name not in logged and getattr(req, name) is not None:
            logged.add(name)
            logger.info("request field '%s' is accepted and ignored (it means nothing to kvshare); logged once",
                        name)
