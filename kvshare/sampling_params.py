"""Per-request generation settings, named and validated as vLLM names them."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from kvshare.engine.detokenizer import StopStrings
from kvshare.errors import InvalidRequestError

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrained decoding, as vLLM names it: exactly one of json (a JSON schema, as a dict or
    its JSON text), regex, choice (a list of strings), grammar (Lark or GBNF/EBNF text) or
    json_object (any JSON object). The whitespace options apply to json and json_object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The request field the spec came from (e.g. "response_format.json_schema.schema"), for errors.
    source_field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        where = self.source_field
        if len(given) != 1:
            raise InvalidRequestError(
                f"{where} must set exactly one of {', '.join(_STRUCTURED_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", where)
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (dict, str)), "regex": isinstance(value, str) and value != "",
              "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
              "grammar": isinstance(value, str) and value.strip() != "", "json_object": value is True}[kind]
        if not ok:
            allowed = {"json": "a JSON schema (an object, or its JSON text)", "regex": "a non-empty regex string",
                       "choice": "a non-empty list of strings", "grammar": "non-empty Lark or GBNF grammar text",
                       "json_object": "true"}[kind]
            raise InvalidRequestError(f"{where}.{kind} must be {allowed}; got {value!r:.80}",
                                      f"{where}.{kind}" if where == "structured_outputs" else where)
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InvalidRequestError(f"{where}.whitespace_pattern must be a string", f"{where}.whitespace_pattern")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """(kind, spec, options): equal keys compile to the same grammar."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:  # a schema sent as text caches with the same schema sent as an object
                value = json.loads(value)
            except ValueError:
                pass  # refused when compiled
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return (self.kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


def check_priority_and_timeout(owner: str, priority, timeout) -> None:
    """A request's scheduling fields (SamplingParams, BeamSearchParams): an int priority and a
    finite timeout > 0 seconds (or None)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"{owner}.priority={priority!r} is invalid: must be an integer "
                                  "(lower is scheduled first)", "priority")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise InvalidRequestError(f"{owner}.timeout={timeout!r} is invalid: must be a number of seconds > 0, "
                                  "or None for no deadline", "timeout")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Tenant key for prefix caching: requests with different salts never share KV blocks.
    cache_salt: str | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar); None = unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # Under --scheduling-policy priority: lower is scheduled first (vLLM's convention); under fcfs
    # only 0 is accepted (the engine refuses others, naming the policy).
    priority: int = 0
    # Seconds from arrival after which the engine ends the request with finish_reason "timeout"
    # (checked between steps); None: no deadline.
    timeout: float | None = None
    stop_list: list[str] = field(init=False, default_factory=list)
    # stop_token_ids for the per-token membership test (the list keeps the caller's order)
    stop_token_id_set: frozenset[int] = field(init=False, default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == 0:
            self.top_k = -1
        self.validate()
        # Deduplicated once here: the sampler masks these ids at every step while min_tokens holds.
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        self.stop_token_id_set = frozenset(self.stop_token_ids)

    def validate(self) -> None:
        def bad(field_name: str, value, allowed: str) -> InvalidRequestError:
            # InvalidRequestError is a ValueError that also names the field (the server's 400 `param`).
            return InvalidRequestError(f"SamplingParams.{field_name}={value!r} is invalid: must be {allowed}",
                                       field_name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= 1, or -1/0 to disable")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not (self.repetition_penalty > 0):
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None for up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "an integer >= 0 or None")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0 or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop_list):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer or None")
        check_priority_and_timeout("SamplingParams", self.priority, self.timeout)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @functools.cached_property
    def stop_strings(self) -> StopStrings:
        """The automaton the detokenizer matches stop_list with: built on first use (O(total
        length); the server builds long ones off its event loop) and shared by every sequence
        of the request."""
        return StopStrings(self.stop_list)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
