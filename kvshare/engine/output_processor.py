"""The output side of a step: appending sampled tokens, detokenizing, stop checks, logprob
dicts, finishing sequences and requests, and building the RequestOutputs callers see."""
from __future__ import annotations

import logging
import time

from kvshare.engine.beam_search import BeamRequest
from kvshare.engine.model_runner import StepLogits
from kvshare.engine.request import RequestState, Sequence
from kvshare.engine.scheduler import Scheduler
from kvshare.model.sampler import logprobs_of
from kvshare.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("kvshare")


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, eos_token_ids: list[int], max_model_len: int,
                 length_unbounded: bool) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # Sink sequences keep cache positions below max_model_len: the length limit does not stop them.
        self.length_unbounded = length_unbounded

    # ---- logprobs ------------------------------------------------------------------------
    def record_prompt_logprobs(self, step: StepLogits) -> None:
        for chunk, first, logits in step.prompt_logits:
            seq = self.scheduler.scheduled_seqs[chunk.seq_id]
            k = seq.params.prompt_logprobs
            # The scheduler asks for prompt logits only for a sequence that collects prompt logprobs.
            assert k is not None and seq.prompt_logprobs is not None
            targets = seq.token_ids[first + 1:first + 1 + logits.shape[0]]
            for res in logprobs_of(logits, targets, k):
                seq.prompt_logprobs.append(self.logprob_dict(res, k))

    def logprob_dict(self, res, k: int) -> dict[int, Logprob]:
        d = {res.token_id: Logprob(res.logprob, res.rank, self.piece(res.token_id))}
        for rank, (tid, lp) in enumerate(zip(res.top_ids[:k], res.top_logprobs[:k]), start=1):
            if tid not in d:
                d[tid] = Logprob(lp, rank, self.piece(tid))
        return d

    def piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- tokens and stop checks ----------------------------------------------------------
    def append_token(self, st: RequestState, seq: Sequence, res) -> None:
        params = seq.params
        seq.token_ids.append(res.token_id)
        if params.logprobs is not None:
            seq.output_logprobs.append(self.logprob_dict(res, params.logprobs))
            seq.cumulative_logprob += res.logprob
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        grammar_done = False
        if seq.grammar is not None:
            if not seq.grammar.accept(res.token_id):
                # The mask allows only tokens the matcher accepts, so this is a bug, not bad input.
                logger.error("sequence %s: the grammar refused token %d (%s); aborting it", seq.seq_id,
                             res.token_id, seq.grammar.error)
                self.finish_seq(seq, "abort")
                self.maybe_finish_request(st)
                return
            grammar_done = seq.grammar.is_stopped  # complete: nothing but end-of-sequence can follow
        if n_out >= params.min_tokens:
            if not params.ignore_eos and res.token_id in self.eos_token_ids:
                reason = "stop"
            elif res.token_id in params.stop_token_id_set:
                reason, stop_reason = "stop", res.token_id
        # A terminating token stays out of the text unless asked for, as in vLLM.
        if seq.detokenizer is not None and (reason is None or params.include_stop_str_in_output):
            seq.text_delta += seq.detokenizer.add(res.token_id)
            if reason is None:
                hit = seq.detokenizer.check_stop()
                if hit is not None:
                    reason, stop_reason = "stop", hit
        if reason is None and grammar_done:
            reason = "stop"
        assert params.max_tokens is not None  # RequestIntake.prepare fills it in before scheduling
        if reason is None and n_out >= params.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len and not self.length_unbounded:
            reason = "length"
        if reason is not None:
            self.finish_seq(seq, reason, stop_reason)
            self.maybe_finish_request(st)

    # ---- finishing -----------------------------------------------------------------------
    def finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason, stop_reason)
        seq.grammar = None  # finished or aborted: its matcher goes with it
        if seq.detokenizer is not None:
            seq.text_delta += seq.detokenizer.flush()

    def end_request(self, st: RequestState, reason: str) -> None:
        """End a request from outside a step (an abort, a deadline): each sequence goes through
        finish_seq, the one release path, as when it stops by itself."""
        for seq in st.seqs:
            if not seq.is_finished:
                self.scheduler.manager.events.record("abort", seq=seq.seq_id, reason=reason)
            self.finish_seq(seq, reason)
        st.ended_by = reason
        self.maybe_finish_request(st)

    def maybe_finish_request(self, st: RequestState) -> None:
        if all(s.is_finished for s in st.seqs) and not st.finished:
            st.finished = True
            st.metrics.finished_time = time.monotonic()

    # ---- outputs -------------------------------------------------------------------------
    def make_output(self, st: RequestState, beam: BeamRequest | None = None) -> RequestOutput:
        """The request's output so far; `beam`: the beam driver's state for a beam-search request."""
        if beam is not None:
            return self.make_beam_output(st, beam)
        outs = []
        for seq in st.seqs:
            text = ""
            if seq.detokenizer is not None:
                text = seq.detokenizer.text
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, text_delta=seq.text_delta,
            ))
            seq.text_delta = ""
        m = st.metrics
        m.num_output_tokens = sum(len(o.token_ids) for o in outs)
        m.num_cached_tokens = max((s.num_cached_tokens for s in st.seqs), default=0)
        m.num_preemptions = sum(s.num_preemptions for s in st.seqs)
        owner = st.prompt_logprobs_owner
        prompt_logprobs = None
        if owner is not None:
            assert owner.prompt_logprobs is not None  # set together in LLMEngine.add_request
            prompt_logprobs = list(owner.prompt_logprobs)
        return RequestOutput(
            request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outs, finished=st.finished, metrics=m, num_cached_tokens=m.num_cached_tokens,
        )

    def make_beam_output(self, st: RequestState, beam: BeamRequest) -> RequestOutput:
        hyps = beam.hypotheses(st.seqs, st.finished)
        outs = []
        for i, (ids, cum, reason, score) in enumerate(hyps):
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(ids), cumulative_logprob=cum,
                                         logprobs=None, finish_reason=reason or ((st.ended_by or "abort") if st.finished else None)))
        m = st.metrics
        m.num_output_tokens = len(outs[0].token_ids) if outs else 0
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             prompt_logprobs=None, outputs=outs, finished=st.finished, metrics=m,
                             extra={"beam_scores": [h[3] for h in hyps]})
