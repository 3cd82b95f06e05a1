"""/v1/completions bodies and stream chunks (OpenAI's legacy text-completion shape)."""
from __future__ import annotations

from kvshare.outputs import CompletionOutput, Logprob, RequestOutput
from kvshare.server.formatting import BaseFormatter, clamp_logprob


class CompletionFormatter(BaseFormatter):
    chunk_object = "text_completion"

    def prompt_text(self, p: int) -> str:
        prompt = self.job.prompts[p]
        if prompt.text is not None:
            return prompt.text
        return self.tok.decode(prompt.token_ids, skip_special_tokens=False) if self.tok is not None else ""

    def _prompt_logprobs(self, p: int) -> list[tuple[int, dict[int, Logprob] | None]]:
        ids = self.job.prompts[p].token_ids
        plps = list(self.latest[p].prompt_logprobs or [])
        plps += [None] * (len(ids) - len(plps))
        return list(zip(ids, plps))

    def _logprobs(self, pairs: list[tuple[int, dict[int, Logprob] | None]], offset: int) -> tuple[dict, int]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, entries in pairs:
            chosen = entries.get(tid) if entries else None
            text = self.token_text(tid, chosen)
            tokens.append(text)
            token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
            # As vLLM: the sampled token plus the top-k, keyed by their text.
            top.append({self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in entries.items()}
                       if entries else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset

    def stream_choice(self, index: int, p: int, c: CompletionOutput, st, new_ids, new_lps, finish) -> dict:
        text = c.text_delta
        pairs = []
        if not st.started and self.job.echo:
            text = self.prompt_text(p) + text
            if self.job.logprobs is not None:
                pairs = self._prompt_logprobs(p)
        logprobs = None
        if self.job.logprobs is not None:
            logprobs, st.text_offset = self._logprobs(pairs + list(zip(new_ids, new_lps or [])), st.text_offset)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}

    def response(self, finals: list[RequestOutput]) -> dict:
        for out in finals:
            self.latest[self.job.prompt_index(out.request_id)] = out
        choices = []
        for index, p, c in self.ordered_choices(finals):
            text = (self.prompt_text(p) if self.job.echo else "") + c.text
            logprobs = None
            if self.job.logprobs is not None:
                pairs = self._prompt_logprobs(p) if self.job.echo else []
                logprobs, _ = self._logprobs(pairs + list(zip(c.token_ids, c.logprobs or [])), 0)
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                            "prompt_logprobs": self.prompt_logprobs_body(self.latest[p])})
        return {"id": self.job.id, "object": "text_completion", "created": self.job.created, "model": self.job.model,
                "choices": choices, "usage": self.usage(finals), "system_fingerprint": None}
