"""/v1/chat/completions: the chat template, and chat bodies and stream chunks."""
from __future__ import annotations

import json

from kvshare.errors import InvalidRequestError
from kvshare.model.template_sandbox import TemplateLimitError
from kvshare.outputs import CompletionOutput, Logprob, RequestOutput
from kvshare.server.chat_options import template_options
from kvshare.server.formatting import MIN_LOGPROB, BaseFormatter, PromptInput, clamp_logprob, ranked
from kvshare.server.protocol import ChatCompletionRequest
from kvshare.server.settings import ServerConfig
from kvshare.server.tool_calls import ToolPlan
from kvshare.server.tool_stream import ToolCallStream


def _conversation(req: ChatCompletionRequest) -> list[dict]:
    """The messages as chat templates read them (HF's convention, which vLLM follows)."""
    conversation = []
    for i, m in enumerate(req.messages):
        if m.role != "assistant" and m.content is None:
            raise InvalidRequestError(f"a '{m.role}' message needs 'content'", f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"only assistant messages carry tool_calls, not '{m.role}' ones",
                                      f"messages[{i}].tool_calls")
        if (m.role == "tool") != (m.tool_call_id is not None):
            raise InvalidRequestError("a 'tool' message needs tool_call_id (the id of the call it answers)"
                                      if m.role == "tool" else f"only 'tool' messages carry tool_call_id, not "
                                      f"'{m.role}' ones", f"messages[{i}].tool_call_id")
        # 'developer' is OpenAI's newer name for the system role; chat templates know 'system'.
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        conversation.append(msg)
    return conversation


def _template_call(call, where: str) -> dict:
    # Templates expect the arguments as a mapping, not OpenAI's JSON text (vLLM parses them too).
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as e:
        raise InvalidRequestError(f"{where}.function.arguments is not JSON text: {e}", f"{where}.function.arguments") \
            from None
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def render_chat_prompt(tokenizer, req: ChatCompletionRequest, chat_template: str | None = None,
                       config: ServerConfig | None = None) -> PromptInput:
    """The same rendering as LLM.chat: the model's template (or --chat-template), given the request's
    tools, then tokens without extra specials. `config` gives the limits on what the template is
    given and how long it may run (ServerConfig's defaults when None)."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so chat messages cannot be rendered", "messages")
    limits = config if config is not None else ServerConfig()
    conversation = _conversation(req)
    req_tools = getattr(req, "tools", None)  # /tokenize's chat requests render without tools
    tools = [t.model_dump(exclude_none=True) for t in req_tools] if req_tools else None
    _check_json_size(tools, "tools", limits.max_tools_bytes, "--max-tools-bytes")
    _check_json_size(req.chat_template_kwargs, "chat_template_kwargs", limits.max_chat_template_kwargs_bytes,
                     "--max-chat-template-kwargs-bytes")
    options = template_options(req)  # its own 400s, naming their fields
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template,
                                             render_timeout=limits.chat_template_timeout, **options)
    except TemplateLimitError as e:
        # The template's input is what the client controls; kwargs are the usual lever.
        param = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
        limit = (f"--chat-template-timeout {limits.chat_template_timeout:g}" if e.timed_out
                 else "a fixed cap of the template sandbox")
        raise InvalidRequestError(f"the chat template stopped: {e} ({limit}); check {param}", param) from None
    except Exception as e:  # templates raise their own errors (e.g. "roles must alternate")
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", "messages") from None
    return PromptInput(text=text, token_ids=tokenizer.encode(text, add_special_tokens=False))


def renders_off_loop(req: ChatCompletionRequest, long_text: int) -> bool:
    """Whether rendering may take long enough to keep off the event loop: long messages, or any
    tools or chat_template_kwargs (small kwargs can still drive a template's loops)."""
    return bool(getattr(req, "tools", None) or req.chat_template_kwargs
                or sum(len(m.content or "") for m in req.messages) > long_text)


def _check_json_size(value, field: str, limit: int, flag: str) -> None:
    if value is None:
        return
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    if size > limit:
        raise InvalidRequestError(f"{field} is {size} bytes as JSON: the chat template is given at most {limit} "
                                  f"bytes of it ({flag})", field)


class ChatFormatter(BaseFormatter):
    chunk_object = "chat.completion.chunk"

    def __init__(self, job, tokenizer, tools: ToolPlan | None = None) -> None:
        super().__init__(job, tokenizer)
        self.tools = tools
        self.tool_streams: dict[int, ToolCallStream] = {}  # per choice index

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

    def _tool_delta(self, index: int, c: CompletionOutput, finish) -> tuple[dict, str | None]:
        stream = self.tool_streams.get(index)
        if stream is None:
            stream = self.tool_streams[index] = self.tools.stream()
        content, fragments = stream.feed(c.text_delta, final=finish is not None)
        delta = {}
        if content:
            delta["content"] = content
        if fragments:
            delta["tool_calls"] = fragments
        return delta, self.tools.finish_reason(stream.called, finish)

    def stream_choice(self, index: int, p: int, c: CompletionOutput, st, new_ids, new_lps, finish) -> dict:
        if self.tools is not None:
            delta, finish = self._tool_delta(index, c, finish)
        else:
            delta = {"content": c.text_delta} if c.text_delta or finish is None else {}
        logprobs = self._logprobs(new_ids, new_lps) if self.job.logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}

    def _message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": self.job.echo_text + c.text}, c.finish_reason
        content, calls = self.tools.message(c.text)
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                self.tools.finish_reason(bool(calls), c.finish_reason))

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for index, _, c in self.ordered_choices(finals):
            logprobs = self._logprobs(c.token_ids, c.logprobs) if self.job.logprobs is not None else None
            message, finish = self._message(c)
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {"id": self.job.id, "object": "chat.completion", "created": self.job.created, "model": self.job.model,
                "choices": choices, "usage": self.usage(finals), "system_fingerprint": None,
                "prompt_logprobs": self.prompt_logprobs_body(finals[0] if finals else None)}
