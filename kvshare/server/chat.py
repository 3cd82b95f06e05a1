"""/v1/chat/completions: the chat template, and chat bodies and stream chunks."""
from __future__ import annotations

from kvshare.errors import InvalidRequestError
from kvshare.outputs import CompletionOutput, Logprob, RequestOutput
from kvshare.server.chat_options import template_options
from kvshare.server.formatting import MIN_LOGPROB, BaseFormatter, PromptInput, clamp_logprob, ranked
from kvshare.server.protocol import ChatCompletionRequest


def render_chat_prompt(tokenizer, req: ChatCompletionRequest) -> PromptInput:
    """The same rendering as LLM.chat: the model's template, then tokens without extra specials."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so chat messages cannot be rendered", "messages")
    conversation = []
    for m in req.messages:
        if m.role != "assistant" and m.content is None:
            raise InvalidRequestError(f"a '{m.role}' message needs 'content'", "messages")
        if m.tool_calls:
            raise InvalidRequestError("tool calls are not supported by kvshare yet", "messages")
        # 'developer' is OpenAI's newer name for the system role; chat templates know 'system'.
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.name is not None:
            msg["name"] = m.name
        conversation.append(msg)
    options = template_options(req)
    try:
        text = tokenizer.apply_chat_template(conversation, **options)
    except Exception as e:  # templates raise their own errors (e.g. "roles must alternate")
        raise InvalidRequestError(f"the model's chat template rejected these messages: {e}", "messages") from None
    return PromptInput(text=text, token_ids=tokenizer.encode(text, add_special_tokens=False))


class ChatFormatter(BaseFormatter):
    chunk_object = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict]:
        # Every choice announces its role first, as OpenAI's stream does.
        choices = range(len(self.job.prompts) * self.job.n)
        opening = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]) for i in choices]
        if self.job.echo_text:  # as vLLM: the echoed content in a chunk of its own per choice
            opening += [self.chunk([{"index": i, "delta": {"content": self.job.echo_text}, "logprobs": None,
                                     "finish_reason": None}]) for i in choices]
        return opening

    def _entry(self, token_id: int, lp: Logprob | None) -> dict:
        text = self.token_text(token_id, lp)
        return {"token": text, "logprob": clamp_logprob(lp.logprob) if lp is not None else MIN_LOGPROB,
                "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, ids: list[int], lps) -> dict:
        content = []
        for tid, entries in zip(ids, lps or []):
            entry = self._entry(tid, entries.get(tid))
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in ranked(entries, self.job.logprobs)]
            content.append(entry)
        return {"content": content}

    def stream_choice(self, index: int, p: int, c: CompletionOutput, st, new_ids, new_lps, finish) -> dict:
        delta = {"content": c.text_delta} if c.text_delta or finish is None else {}
        logprobs = self._logprobs(new_ids, new_lps) if self.job.logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for index, _, c in self.ordered_choices(finals):
            logprobs = self._logprobs(c.token_ids, c.logprobs) if self.job.logprobs is not None else None
            choices.append({"index": index, "message": {"role": "assistant", "content": self.job.echo_text + c.text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.job.id, "object": "chat.completion", "created": self.job.created, "model": self.job.model,
                "choices": choices, "usage": self.usage(finals), "system_fingerprint": None,
                "prompt_logprobs": self.prompt_logprobs_body(finals[0] if finals else None)}
