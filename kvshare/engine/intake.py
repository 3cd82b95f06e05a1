"""Request intake: turning what a caller submitted (text, token ids, or one of vLLM's prompt
dicts, plus SamplingParams) into checked prompt token ids and the params the engine runs with.
Every refusal is an InvalidRequestError naming the offending field, raised before anything is
scheduled."""
from __future__ import annotations

from kvshare.engine.startup import KVLayout
from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import SamplingParams

# vLLM's TextPrompt / TokensPrompt keys that a text-only engine can honour, and the multimodal
# ones it must refuse by name.
PROMPT_DICT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
MULTIMODAL_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


def agreed_salt(from_prompt: str | None, from_params: str | None) -> str | None:
    """The request's tenant salt: given in the prompt dict, in SamplingParams, or in both alike."""
    if from_prompt is not None and from_params is not None and from_prompt != from_params:
        raise InvalidRequestError(
            f"cache_salt differs between the prompt dict ({from_prompt!r}) and SamplingParams "
            f"({from_params!r}): give it once, or the same in both", "cache_salt")
    return from_prompt if from_prompt is not None else from_params


class RequestIntake:
    """Checks prompts against the tokenizer, the vocabulary and the KV pool the engine was built with."""

    def __init__(self, tokenizer, vocab_size: int, layout: KVLayout, kv_policy,
                 max_num_batched_tokens: int, length_unbounded: bool, seq_blocks=None,
                 sink_max_tokens: int | None = None, scheduling_policy: str = "fcfs") -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        # KV cache groups: tokens -> most blocks one sequence holds across the groups (None: one group).
        self.seq_blocks = seq_blocks
        self.vocab_size = vocab_size
        self.layout = layout
        self.kv_policy = kv_policy
        self.max_num_batched_tokens = max_num_batched_tokens
        # Sink sequences keep cache positions below max_model_len whatever their length.
        self.length_unbounded = length_unbounded
        self.sink_max_tokens = sink_max_tokens  # the cap on max_tokens when length_unbounded

    def prepare(self, prompt, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text, prompt token ids, params): params is a copy when max_tokens or cache_salt
        had to be filled in, so the caller's object is never changed."""
        if params.priority != 0 and self.scheduling_policy != "priority":
            # As vLLM: a priority the scheduler would ignore is refused rather than dropped.
            raise InvalidRequestError(f"priority={params.priority} is set but the scheduling policy is "
                                      f"{self.scheduling_policy!r}: a priority other than 0 needs "
                                      "--scheduling-policy priority", "priority")
        text, token_ids, salt = self.resolve_prompt(prompt)
        salt = agreed_salt(salt, params.cache_salt)
        max_tokens = self.check_lengths(token_ids, params)
        if params.max_tokens != max_tokens or params.cache_salt != salt:
            params = params.clone()
            params.max_tokens = max_tokens
            params.cache_salt = salt
        return text, token_ids, params

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompt_token_ids", "prompt")
        return self.tokenizer.encode(prompt)

    def resolve_prompt(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache_salt from a prompt dict) for a string, a token list, or one of
        vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}, each with an optional
        "cache_salt". Any other key is an error naming it: a dropped key (a tenant's cache_salt
        above all) would silently change what the request may share."""
        salt = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_DICT_KEYS)
            if unknown:
                mm = [k for k in unknown if k in MULTIMODAL_PROMPT_KEYS]
                why = (f"{mm[0]!r} is not supported: kvshare serves text-only models" if mm
                       else f"unknown prompt key(s) {unknown}")
                raise InvalidRequestError(f"{why}; a prompt dict takes {sorted(PROMPT_DICT_KEYS)}",
                                          mm[0] if mm else unknown[0])
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or salt == ""):
                raise InvalidRequestError(f"cache_salt={salt!r} is invalid: must be a non-empty string",
                                          "cache_salt")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")  # vLLM's TokensPrompt may carry the text it came from
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}", "prompt")
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidRequestError(
                        f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}", "prompt_token_ids")
                return text, self.resolve_prompt(list(ids))[1], salt
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequestError(
                    f"a prompt dict's 'prompt' must be a string (token ids go in 'prompt_token_ids'), "
                    f"got {type(prompt).__name__}", "prompt")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty: give at least one token of text", "prompt")
            ids = self.tokenize(prompt)
            if not ids:
                raise InvalidRequestError("prompt is empty after tokenization", "prompt")
            return prompt, ids, salt
        if isinstance(prompt, (list, tuple)):
            if len(prompt) == 0:
                raise InvalidRequestError("prompt_token_ids is empty: give at least one token id", "prompt")
            vocab = self.vocab_size
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab):
                    raise InvalidRequestError(
                        f"prompt_token_ids contains {t!r}: token ids must be integers in [0, {vocab})", "prompt"
                    )
            return None, list(prompt), salt
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )

    def sink_cap(self) -> int:
        """sink_max_tokens, read only when length_unbounded: the engine always passes it then."""
        assert self.sink_max_tokens is not None, "a length-unbounded intake needs sink_max_tokens"
        return self.sink_max_tokens

    def check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        n = len(token_ids)
        limit = self.layout.max_model_len
        unbounded = self.length_unbounded
        if n >= limit and not unbounded:
            raise InvalidRequestError(
                f"prompt is {n} tokens, but max_model_len is {limit}: it must be at most {limit - 1} tokens "
                f"to leave room for one output token", "prompt"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            if n >= limit:
                raise InvalidRequestError(
                    f"prompt is {n} tokens, at least max_model_len={limit}: with kv_policy='sink' give max_tokens "
                    f"explicitly (there is no default length past max_model_len)", "max_tokens")
            max_tokens = limit - n if not unbounded else min(limit - n, self.sink_cap())
        if unbounded and max_tokens > self.sink_cap():
            raise InvalidRequestError(
                f"max_tokens={max_tokens} is more than one request may generate under kv_policy='sink': at most "
                f"{self.sink_max_tokens} (sink_max_tokens, --sink-max-tokens)", "max_tokens")
        if n + max_tokens > limit and not unbounded:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} plus the prompt's {n} tokens is {n + max_tokens}, beyond "
                f"max_model_len={limit}: lower max_tokens to at most {limit - n}", "max_tokens"
            )
        pool = self.layout.num_slots
        needed = n + max_tokens
        grouped = self.seq_blocks(needed) if self.seq_blocks is not None else None
        if grouped is not None:
            if grouped > self.layout.num_blocks:
                raise InvalidRequestError(
                    f"prompt ({n} tokens) plus max_tokens ({max_tokens}) needs up to {grouped} KV blocks across "
                    f"{self.layout.num_kv_groups} KV cache groups, but the whole KV pool holds "
                    f"{self.layout.num_blocks}: raise kv_cache_memory or lower max_tokens", "max_tokens")
            return max_tokens
        bound = self.kv_policy.max_blocks_per_seq(self.max_num_batched_tokens)
        if bound is not None and bound * self.layout.block_size < needed:
            # Windowed: blocks out of every window go back as the sequence grows.
            needed = bound * self.layout.block_size
            if needed > pool:
                raise InvalidRequestError(
                    f"one sequence's window plus a prefill chunk of up to max_num_batched_tokens="
                    f"{self.max_num_batched_tokens} needs up to {needed} KV slots, but the whole KV pool "
                    f"holds {pool}: raise kv_cache_memory or lower max_num_batched_tokens", "max_tokens")
        if needed > pool:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {n + max_tokens} KV slots, but the "
                f"whole KV pool holds {pool}: raise kv_cache_memory or lower max_tokens", "max_tokens"
            )
        return max_tokens
