"""Request state: one Sequence per generated stream (a request with n > 1 has n of them), and
the RequestState that groups a request's sequences. Beam-search state is the beam driver's own
(kvshare.engine.beam_search)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvshare.engine.detokenizer import IncrementalDetokenizer
from kvshare.engine.structured_output import GrammarMatcher
from kvshare.kvcache.cache_key import CacheNamespace
from kvshare.outputs import Logprob, RequestMetrics
from kvshare.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    request_id: str
    index: int  # choice index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    admitted_once: bool = False
    # n > 1: siblings still to be forked off this sequence once its prompt is computed.
    pending_forks: int = 0
    text_delta: str = ""  # stream-safe text produced since the last output was taken
    # Constrained decoding: this sequence's own matcher (kvshare.engine.structured_output), or None.
    grammar: GrammarMatcher | None = None
    # The prefix cache's namespace: the request's cache_salt as the intake agreed it on params
    # (the one place the wire's salt becomes the cache key), fixed for the sequence's life.
    namespace: CacheNamespace = field(init=False)
    # The LoRA adapter's cache key (kvshare.model.lora.LoRAAdapter.key) the sequence runs under.
    adapter: str | None = None

    def __post_init__(self) -> None:
        self.namespace = CacheNamespace(salt=self.params.cache_salt, adapter=self.adapter)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) >= self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1


@dataclass
class RequestState:
    """One submitted request: its sequences, its metrics, and how far its outputs have been handed out."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    finished: bool = False
    prompt_logprobs_owner: Sequence | None = None
    reported_final: bool = False
    ended_by: str | None = None  # "abort" or "timeout" when ended from outside a step
    adapter: str | None = None  # the LoRA adapter's cache key (every sequence of the request runs under it)

    @property
    def deadline(self) -> float | None:
        """When the engine ends it with finish_reason "timeout" (the engine's monotonic clock)."""
        timeout = self.params.timeout
        return None if timeout is None else self.metrics.arrival_time + timeout
