"""What `kvshare doctor` drives: a Target, something that serves requests. The doctor submits,
aborts and waits for requests through it, in the Target's own ticks (an engine step for the
in-process engine), and asks it to start every run from the same clean state. The in-process
engine is the one Target today; it uses only the engine's API (kvshare.engine.llm_engine)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from kvshare.config import EngineConfig
from kvshare.sampling_params import SamplingParams


class DoctorUsageError(ValueError):
    """A doctor run that cannot be made as asked (a workload or target it cannot use)."""


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token (empty when the target returned none)


@dataclass
class Finished:
    request_id: str
    choices: list[Choice]


class Target(Protocol):
    def reset(self, sharing: bool, audit: bool) -> None:
        """Start a run: nothing cached, no KV left from earlier runs; `sharing`: prefix caching as
        configured (else off); `audit`: the KV audit on, when the target has one."""

    def tokenize(self, text: str) -> list[int] | None:
        """Token ids of `text` (None: the target has no tokenizer)."""

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_request(self, request_id: str) -> bool:
        """Submitted and not yet returned as finished."""

    def busy(self) -> bool:
        """Some submitted request has not been returned as finished yet."""

    def advance(self) -> list[Finished]:
        """One tick (the doctor's unit of delays and aborts); the requests that finished in it."""

    def transparency(self) -> tuple[str, ...] | None:
        """Why sharing may show in a request's bits (empty: it cannot, and the doctor demands exact
        equality; None: the target does not know). Optional: a target without it is compared
        within a tolerance."""


class InProcessTarget:
    """LLMEngines in this process, one per prefix-caching setting, with `faults` planted
    (kvshare.testing.faults)."""

    def __init__(self, config: EngineConfig, faults: list[str] | None = None) -> None:
        if config.tensor_parallel_size != 1:
            # Resetting an engine's KV clears this process's: worker ranks' shards would keep theirs.
            raise DoctorUsageError(f"--tensor-parallel-size {config.tensor_parallel_size} is not supported by "
                             "kvshare doctor: it runs its engines in one process (use 1)")
        self.config = config
        self.faults = faults or []
        self._engines: dict[bool, object] = {}  # by prefix caching on/off
        self._engine = None  # the current run's

    def engine(self, prefix_caching: bool, audit: bool = False):
        from kvshare.engine.llm_engine import LLMEngine
        from kvshare.testing.faults import plant

        eng = self._engines.get(prefix_caching)
        if eng is not None and not eng.is_idle():
            eng = None  # a run that crashed leaves a broken pool behind: start over
        if eng is None:
            cfg = dataclasses.replace(self.config, enable_prefix_caching=prefix_caching, audit=False, kv_event_log=None)
            eng = LLMEngine(cfg)
            for f in self.faults:
                plant(eng, f)
            self._engines[prefix_caching] = eng
        # Every run starts from the same state: nothing cached, every slot zero.
        eng.set_audit(audit)
        eng.reset_prefix_cache()
        eng.zero_kv_cache()
        self._engine = eng
        return eng

    def reset(self, sharing: bool, audit: bool) -> None:
        self.engine(self.config.enable_prefix_caching if sharing else False, audit)

    def transparency(self) -> tuple[str, ...]:
        # The engine that serves as configured: the one whose sharing is on trial.
        return tuple(self.engine(self.config.enable_prefix_caching).transparency)

    def tokenize(self, text: str) -> list[int] | None:
        eng = self.engine(False)
        return eng.tokenize(text) if eng.tokenizer is not None else None

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self._engine.add_request(request_id, {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt,
                                 params)

    def abort(self, request_id: str) -> None:
        self._engine.abort_request(request_id)

    def has_request(self, request_id: str) -> bool:
        return self._engine.has_request(request_id)

    def busy(self) -> bool:
        return self._engine.has_unfinished_requests()

    def advance(self) -> list[Finished]:
        done = []
        for out in self._engine.step():
            if out.finished:
                done.append(Finished(out.request_id, [
                    Choice(c.index, list(c.token_ids),
                           [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)] if c.logprobs else [])
                    for c in out.outputs]))
        return done
