"""Turning RequestOutputs into OpenAI response bodies and stream chunks: the parts completions and
chat share (choice bookkeeping, usage, logprob values). The endpoint-specific shapes live in
completions.py and chat.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvshare.outputs import CompletionOutput, Logprob, RequestOutput

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps to the same floor


@dataclass
class PromptInput:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


@dataclass
class Job:
    """One HTTP request: its prompts become engine requests `<id>-<i>`; choice = i * n + choice index."""

    id: str
    created: int
    model: str
    prompts: list[PromptInput]
    n: int
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-k to report, None = no logprobs
    echo_text: str = ""  # chat: what `echo` puts in front of every choice's answer
    lora_request: object = None  # the LoRARequest `model` named (None: the base model)

    def engine_id(self, i: int) -> str:
        return f"{self.id}-{i}"

    def prompt_index(self, engine_id: str) -> int:
        return int(engine_id.rsplit("-", 1)[1])


@dataclass
class _ChoiceState:
    sent_tokens: int = 0
    text_offset: int = 0  # completions' text_offset runs on across chunks
    started: bool = False
    finished: bool = False


def clamp_logprob(x: float | None) -> float | None:
    if x is None:
        return None
    return MIN_LOGPROB if math.isnan(x) or x < MIN_LOGPROB else float(x)


def ranked(entries: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    """The top-`limit` alternatives by rank (the chosen token only if it is among them)."""
    top = [(t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= limit]
    return sorted(top, key=lambda x: x[1].rank)


class BaseFormatter:
    chunk_object = ""

    def __init__(self, job: Job, tokenizer) -> None:
        self.job = job
        self.tok = tokenizer
        self.states: dict[int, _ChoiceState] = {}
        self.latest: dict[int, RequestOutput] = {}

    # ---- per endpoint ---------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        return []

    def stream_choice(self, index: int, prompt_index: int, c: CompletionOutput, st: _ChoiceState,
                      new_ids: list[int], new_lps, finish: str | None) -> dict:
        raise NotImplementedError

    def response(self, finals: list[RequestOutput]) -> dict:
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------
    def token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tok is None:
            return ""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs_body(self, out: RequestOutput | None) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} for the prompt's own token and the top-k alternatives."""
        if out is None or out.prompt_logprobs is None:
            return None
        return [None if entries is None else {
            str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": self.token_text(t, lp)}
            for t, lp in entries.items()} for entries in out.prompt_logprobs]

    def chunks(self, out: RequestOutput) -> list[dict]:
        p = self.job.prompt_index(out.request_id)
        self.latest[p] = out
        res = []
        for c in out.outputs:
            index = p * self.job.n + c.index
            st = self.states.setdefault(index, _ChoiceState())
            if st.finished:
                continue
            new_ids = c.token_ids[st.sent_tokens:]
            new_lps = c.logprobs[st.sent_tokens:] if c.logprobs is not None else None
            finish = c.finish_reason
            if not new_ids and not c.text_delta and finish is None:
                continue
            res.append(self.chunk([self.stream_choice(index, p, c, st, new_ids, new_lps, finish)]))
            st.sent_tokens = len(c.token_ids)
            st.started = True
            st.finished = finish is not None
        return res

    def chunk(self, choices: list[dict]) -> dict:
        body = {"id": self.job.id, "object": self.chunk_object, "created": self.job.created,
                "model": self.job.model, "choices": choices}
        if self.job.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def usage(self, outs: list[RequestOutput] | None = None) -> dict:
        outs = list(self.latest.values()) if outs is None else outs
        prompt = sum(len(p.token_ids) for p in self.job.prompts)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self) -> dict:
        return {"id": self.job.id, "object": self.chunk_object, "created": self.job.created,
                "model": self.job.model, "choices": [], "usage": self.usage()}

    def ordered_choices(self, finals: list[RequestOutput]):
        """(global index, prompt index, choice) over all prompts' final outputs, in index order."""
        items = []
        for out in finals:
            p = self.job.prompt_index(out.request_id)
            for c in out.outputs:
                items.append((p * self.job.n + c.index, p, c))
        return sorted(items, key=lambda x: x[0])
