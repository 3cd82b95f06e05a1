"""Constrained decoding on llguidance: grammars compiled once per (kind, spec) and cached, one
matcher per sequence, and the batch's token bitmask.

Why llguidance (docs/benchmarks.md, "Issue 12: grammar engine"): no dependencies beyond its own
wheel (xgrammar pulls triton and transformers), compiles a schema in about a millisecond and
fills a 49k-vocabulary mask in tens of microseconds on this CPU.

Isolation: a matcher belongs to exactly one sequence. A fork gets a deep copy (never a shared
object), the mask for a row is computed from that row's matcher only, and a matcher's state is a
function of the sequence's output tokens: `GrammarMatcher.sync` rebuilds it from the tokens if
the two ever disagree (a recompute after preemption keeps the tokens, so the state stays valid).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING
import torch

from kvshare.errors import InvalidRequestError
from kvshare.model.sampler import TokenBitmask
from kvshare.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # imported on the first grammar, not at engine start
    import llguidance

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


class CompiledGrammar:
    """A compiled grammar: a matcher that never advances, copied for each new sequence."""

    def __init__(self, template, key: tuple) -> None:
        self._template = template
        self.key = key

    def new_matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._template.deep_copy())

    def __deepcopy__(self, memo) -> "CompiledGrammar":
        return self  # immutable: SamplingParams.clone() may share it


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher) -> None:
        self._m = matcher
        self.num_tokens = 0  # output tokens consumed

    def copy(self) -> "GrammarMatcher":
        twin = GrammarMatcher(self._m.deep_copy())
        twin.num_tokens = self.num_tokens
        return twin

    def accept(self, token_id: int) -> bool:
        ok = self._m.consume_token(token_id)
        self.num_tokens += 1
        return ok

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the state in line with the sequence's output tokens, rebuilding from them if needed."""
        if self.num_tokens == len(output_token_ids):
            return
        self._m.reset()
        self.num_tokens = 0
        for t in output_token_ids:
            self.accept(t)

    @property
    def is_stopped(self) -> bool:
        """No token but end-of-sequence can follow (the grammar is complete)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    @property
    def raw(self):
        return self._m


class StructuredOutputs:
    """Compiles StructuredOutputsParams into grammars for one tokenizer, and fills batch masks.

    Thread-safe: the server compiles on worker threads while the engine thread takes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size) if tokenizer is not None else vocab_size
        self._eos = list(eos_token_ids)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._lltok = None
        self._executor: llguidance.LLExecutor | None = None
        self.stats = {"compiled": 0, "cache_hits": 0}

    def _llg(self):
        """llguidance's tokenizer view: built on first use (about 0.4 s), not at engine start."""
        import llguidance

        with self._lock:
            if self._lltok is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer, so structured outputs are not "
                                              "available", "structured_outputs")
                self._lltok = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
                self._executor = llguidance.LLExecutor(num_threads=max(1, min(2, torch.get_num_threads())))
        return llguidance, self._lltok

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return hit
        llguidance, lltok = self._llg()
        text = self._grammar_text(llguidance, spec)
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.source_field}: the {_WHAT[spec.kind]} does not compile: "
                                      f"{_first_lines(matcher.get_error())}", _param(spec))
        compiled = CompiledGrammar(matcher, key)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.stats["compiled"] += 1
        return compiled

    @staticmethod
    def _grammar_text(llguidance, spec: StructuredOutputsParams) -> str:
        import json

        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if kind == "json" else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                # json.dumps' spacing by default, not any whitespace anywhere (vLLM's default):
                # free whitespace lets a small model loop on newlines until max_tokens.
                options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                if spec.disable_any_whitespace:
                    options.update(item_separator=",", key_separator=":")
                if spec.whitespace_pattern is not None:
                    options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
                if spec.disable_additional_properties:
                    schema = _no_additional_properties(schema)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", spec.choice)
            return llguidance.grammar_from("grammar", spec.grammar)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{spec.source_field}: the {_WHAT[kind]} is invalid: {_first_lines(str(e))}",
                                      _param(spec)) from None

    def fill_bitmask(self, matchers: list[GrammarMatcher], rows: list[int]) -> TokenBitmask:
        """The allowed-token bitmask of each matcher, for the batch rows it stands for."""
        import llguidance.torch as llt

        self._llg()
        assert self._executor is not None  # _llg() builds it with the tokenizer view
        bits = torch.full(((len(matchers)), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        if len(matchers) == 1:  # the executor's thread hand-off costs more than one mask
            llt.fill_next_token_bitmask(matchers[0].raw, bits, 0)
        else:
            llt.fill_next_token_bitmask_par(self._executor, [(m.raw, i) for i, m in enumerate(matchers)], bits)
        return TokenBitmask(list(rows), bits)


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "grammar"}


def _param(spec: StructuredOutputsParams) -> str:
    return f"structured_outputs.{spec.kind}" if spec.source_field == "structured_outputs" else spec.source_field


def _first_lines(message: str, limit: int = 4) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return " | ".join(lines[:limit])


def _no_additional_properties(schema):
    """Every object in the schema closed to properties it does not name (vLLM's option)."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema
