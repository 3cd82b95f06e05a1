"""The sampling side of a step: a step's sampling rows' logits become tokens. Forks (n > 1) draw
their first tokens from their parent's row, constrained rows are masked by their grammars, and
beam-search requests hand their rows to the beam driver instead. Also where sequences are made,
each with its own random generator."""
from __future__ import annotations

import time
from typing import Callable

import torch

from kvshare.engine.beam_search import BeamSearchDriver
from kvshare.engine.detokenizer import IncrementalDetokenizer
from kvshare.engine.model_runner import StepLogits
from kvshare.engine.request import RequestState, Sequence
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.structured_output import StructuredOutputs
from kvshare.model.sampler import Sampler, SamplingRow, apply_token_bitmask
from kvshare.sampling_params import SamplingParams


class StepSampler:
    def __init__(self, tokenizer, scheduler: Scheduler, structured: StructuredOutputs,
                 requests: dict[str, RequestState], eos_token_ids: list[int], seed: int,
                 append_token: Callable[[Sequence, object, float], None]) -> None:
        self.sampler = Sampler()
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.structured = structured
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self._rng = torch.Generator().manual_seed(seed)
        self.append_token = append_token
        self._beams: BeamSearchDriver | None = None

    @property
    def beams(self) -> BeamSearchDriver:
        assert self._beams is not None, "the engine sets its beam driver right after building this"
        return self._beams

    @beams.setter
    def beams(self, driver: BeamSearchDriver) -> None:
        self._beams = driver

    def sample(self, step: StepLogits) -> None:
        if not step.sample_chunks:
            return
        sample_logits = step.sample_logits
        assert sample_logits is not None  # sampling chunks always come with their rows' logits
        seqs: list[Sequence] = []
        row_of: list[int] = []
        beam_requests: dict[str, RequestState] = {}
        sampling = [self.scheduler.scheduled_seqs[c.seq_id] for c in step.sample_chunks]
        for r, seq in enumerate(sampling):
            if self.beams.drives(seq.request_id):
                self.beams.take_logits(seq, sample_logits[r])
                beam_requests[seq.request_id] = self.requests[seq.request_id]
                continue
            seqs.append(seq)
            row_of.append(r)
            if seq.pending_forks:
                # The prompt is computed once; each fork draws its own first token from it.
                for child in self.fork(seq):
                    seqs.append(child)
                    row_of.append(r)
        now = time.monotonic()
        # Time to first token, recorded here only: the first step that samples for a request. For
        # beam search that is also the step its beams first advance (it starts with a single beam,
        # so there is no sibling to wait for).
        for seq in sampling:
            m = self.requests[seq.request_id].metrics
            if m.first_token_time is None:
                m.first_token_time = now
                m.time_to_first_token = now - m.arrival_time
        if seqs:
            logits = sample_logits
            if row_of != list(range(logits.shape[0])):
                logits = logits[torch.tensor(row_of)]
            rows = [
                SamplingRow(s.params, s.generator, s.token_ids[:s.num_prompt_tokens], s.output_token_ids,
                            self.eos_token_ids)
                for s in seqs
            ]
            for seq, res in zip(seqs, self.sampler(logits, rows, self.token_bitmask(seqs))):
                self.append_token(seq, res, now)
        for st in beam_requests.values():
            self.beams.step(st)

    def token_bitmask(self, seqs: list[Sequence]):
        """The allowed tokens of this step's constrained rows (None when no row has a grammar)."""
        matchers = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        if not matchers:
            return None
        for i, grammar in matchers:
            grammar.sync(seqs[i].output_token_ids)
        return self.structured.fill_bitmask([g for _, g in matchers], [i for i, _ in matchers])

    def constrain_beam(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        if seq.grammar is None:
            return logits
        seq.grammar.sync(seq.output_token_ids)
        return apply_token_bitmask(logits.unsqueeze(0), self.structured.fill_bitmask([seq.grammar], [0]))[0]

    def fork(self, parent: Sequence) -> list[Sequence]:
        state = self.requests[parent.request_id]
        children = []
        for _ in range(parent.pending_forks):
            child = self.new_seq(state, len(state.seqs), list(parent.token_ids), parent.arrival_time)
            if parent.grammar is not None:
                child.grammar = parent.grammar.copy()  # its own matcher, never the parent's
            state.seqs.append(child)
            self.scheduler.add_forked(parent, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def new_seq(self, state: RequestState, index: int, token_ids: list[int], now: float) -> Sequence:
        params = state.params
        several = params.n > 1 or self.beams.drives(state.request_id)  # then each seq id names its index
        seq = Sequence(
            seq_id=f"{state.request_id}#{index}" if several else state.request_id,
            request_id=state.request_id, index=index, token_ids=token_ids,
            num_prompt_tokens=len(state.prompt_token_ids), params=params, arrival_time=now, adapter=state.adapter,
        )
        seq.generator = self._generator_for(params, index)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, state.prompt_token_ids, params)
        return seq

    def _generator_for(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is not None:
            seed = params.seed + index
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)
