"""The request path shared by completions and chat: checks, SamplingParams, submission to the
engine thread, then either a server-sent-event stream or one JSON body.

Every way a request can end early goes through AsyncEngine.abort (the engine's one release
path): the client disconnecting (streaming or not), --request-timeout, and shutdown. A timed-out
request ends like any other, with the text so far and finish_reason "abort".
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from kvshare.errors import InvalidRequestError
from kvshare.outputs import RequestOutput
from kvshare.sampling_params import SamplingParams
from kvshare.server.async_engine import EngineRequest, RequestStream
from kvshare.server.chat import ChatFormatter, render_chat_prompt, renders_off_loop
from kvshare.server.chat_options import echo_text
from kvshare.server.completions import CompletionFormatter
from kvshare.server.errors import APIError
from kvshare.server.formatting import BaseFormatter, Job, PromptInput
from kvshare.server.ignored_fields import check_ignored_fields
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest
from kvshare.server.state import ServerState
from kvshare.server.structured import structured_params
from kvshare.server.tenants import effective_cache_salt
from kvshare.server.tool_calls import plan_tool_calls

logger = logging.getLogger("kvshare.server")

LONG_TEXT = 4096  # characters; tokenizing or rendering more than this moves off the event loop


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClosingSSEResponse(StreamingResponse):
    """An SSE response that calls on_close however it ends (client gone, error, or done): a
    completion stream aborts its engine requests, a KV view stream lets go of its queue."""

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self.tok = state.tokenizer

    # ---- endpoints ------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        arrival = time.monotonic()
        self._check_common(req)
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError(f"best_of={req.best_of} is not supported: kvshare returns every choice it "
                                      f"samples, so best_of must be omitted or equal n ({req.n})", "best_of")
        if req.suffix is not None:
            raise InvalidRequestError("suffix is not supported by kvshare (no fill-in-the-middle); omit it", "suffix")
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs  # echoed prompt tokens carry their logprobs
        params = self._params(req, req.max_tokens, req.logprobs, prompt_logprobs, {}, raw)
        if sum(len(p) for p in req.prompt if isinstance(p, str)) > LONG_TEXT:
            prompts = await asyncio.to_thread(lambda: [self._tokenize(p) for p in req.prompt])
        else:
            prompts = [self._tokenize(p) for p in req.prompt]
        job = self._job("cmpl", req, prompts, echo=req.echo, logprobs=req.logprobs)
        fmt = CompletionFormatter(job, self.tok)
        return await self._run(job, params, fmt, arrival, raw, {})

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        arrival = time.monotonic()
        self._check_common(req)
        check_ignored_fields(req, self.state.ignored_fields_logged)
        cfg = self.state.config
        tools = plan_tool_calls(req, cfg.tool_call_parser if cfg.enable_auto_tool_choice else None)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rename = {"max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages"}
        params = self._params(req, max_tokens, logprobs, req.prompt_logprobs, rename, raw)
        if tools is not None and tools.schema is not None:  # required / named: the call is enforced
            if params.structured_outputs is not None:
                raise InvalidRequestError(f"tool_choice {json.dumps(req.tool_choice)} is enforced through "
                                          f"structured outputs, so response_format / structured_outputs cannot "
                                          f"constrain the reply too", "tool_choice")
            params = dataclasses.replace(params, structured_outputs=tools.structured_outputs())
        if renders_off_loop(req, LONG_TEXT):
            prompt = await asyncio.to_thread(render_chat_prompt, self.tok, req, cfg.chat_template, cfg)
        else:
            prompt = render_chat_prompt(self.tok, req, cfg.chat_template, cfg)
        job = self._job("chatcmpl", req, [prompt], logprobs=logprobs)
        job.echo_text = echo_text(req)
        fmt = ChatFormatter(job, self.tok, tools)
        return await self._run(job, params, fmt, arrival, raw, rename)

    # ---- checks and conversions -----------------------------------------------------------
    def _check_common(self, req) -> None:
        st = self.state
        st.adapters.resolve(req.model, st.model_name)  # 404 for a model this server does not serve
        if req.n > st.max_num_seqs:
            raise InvalidRequestError(f"n={req.n} is more than the {st.max_num_seqs} sequences this server runs at "
                                      f"once (--max-num-seqs): ask for at most {st.max_num_seqs}", "n")
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", "stream_options")
        if req.logit_bias:
            raise InvalidRequestError("logit_bias is not supported by kvshare; omit it", "logit_bias")
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequestError("prompt_logprobs are not available with stream: true (as in vLLM)",
                                      "prompt_logprobs")
        self._check_limits(req)

    def _check_limits(self, req) -> None:
        """The work one request may ask for (ServerConfig), checked before anything is tokenized."""
        cfg = self.state.config
        prompts = len(req.prompt) if isinstance(req, CompletionRequest) else 1
        if prompts * req.n > cfg.max_sequences_per_request:
            what = f"{prompts} prompts x n={req.n} is {prompts * req.n} sequences" if prompts > 1 else f"n={req.n}"
            raise InvalidRequestError(
                f"{what}, more than one request may ask for: at most {cfg.max_sequences_per_request} "
                f"(--max-sequences-per-request)", "prompt" if prompts > 1 else "n")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > cfg.max_stop_strings:
            raise InvalidRequestError(f"'stop' has {len(stops)} strings: at most {cfg.max_stop_strings} are "
                                      f"allowed (--max-stop-strings)", "stop")
        longest = max(map(len, stops), default=0)
        if longest > cfg.max_stop_string_length:
            raise InvalidRequestError(f"a stop string is {longest} characters long: at most "
                                      f"{cfg.max_stop_string_length} are allowed (--max-stop-string-length)", "stop")
        if req.stop_token_ids is not None and len(req.stop_token_ids) > cfg.max_stop_token_ids:
            raise InvalidRequestError(f"'stop_token_ids' has {len(req.stop_token_ids)} ids: at most "
                                      f"{cfg.max_stop_token_ids} are allowed (--max-stop-token-ids)", "stop_token_ids")

    def _params(self, req, max_tokens, logprobs, prompt_logprobs, rename: dict, raw: Request) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        try:
            return SamplingParams(
                n=req.n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
                top_k=pick(req.top_k, -1), min_p=pick(req.min_p, 0.0),
                presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0), seed=req.seed, max_tokens=max_tokens,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                cache_salt=effective_cache_salt(self.state.config, raw.scope, req.cache_salt),
                structured_outputs=structured_params(req), priority=req.priority,
                timeout=request_timeout(req.timeout, self.state.config.request_timeout),
            )
        except InvalidRequestError as e:
            param = rename.get(e.param, e.param)
            raise InvalidRequestError(str(e).replace("SamplingParams.", "", 1), param) from None

    def _tokenize(self, prompt: str | list[int]) -> PromptInput:
        if not isinstance(prompt, str):
            return PromptInput(None, prompt)
        if prompt == "":
            raise InvalidRequestError("'prompt' is empty: give at least one character of text", "prompt")
        if self.tok is None:
            raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
        return PromptInput(prompt, self.tok.encode(prompt))

    def _job(self, prefix: str, req, prompts: list[PromptInput], echo: bool = False,
             logprobs: int | None = None) -> Job:
        opts = req.stream_options
        lora = self.state.adapters.resolve(req.model, self.state.model_name)
        return Job(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                   model=self.state.model_name if lora is None else lora.lora_name,
                   prompts=prompts, n=req.n, stream=bool(req.stream),
                   include_usage=bool(req.stream and opts is not None and opts.include_usage),
                   echo=echo, logprobs=logprobs, lora_request=lora)

    # ---- running ----------------------------------------------------------------------------
    async def _run(self, job: Job, params: SamplingParams, fmt: BaseFormatter, arrival: float, raw: Request,
                   rename: dict):
        self._log(job, params)
        if sum(map(len, params.stop_list)) > LONG_TEXT:
            await asyncio.to_thread(lambda: params.stop_strings)  # built once, here, not on the engine thread
        if params.structured_outputs is not None:
            await self.state.grammar_compiles.compile(self.engine.engine.compile_grammar, params.structured_outputs)
        requests = [EngineRequest(job.engine_id(i), p.token_ids, params, job.lora_request)
                    for i, p in enumerate(job.prompts)]
        try:
            stream = await self.engine.submit(requests, arrival)
        except InvalidRequestError as e:
            param = rename.get(e.param, e.param)
            where = getattr(e, "prompt_index", None)
            msg = f"prompt {where}: {e}" if where is not None and len(job.prompts) > 1 else str(e)
            if rename.get("prompt") == "messages":
                msg = msg.replace("prompt", "the rendered chat prompt", 1)
            raise InvalidRequestError(msg, param) from None
        # A deadline (params.timeout) is the engine's: it ends the request with finish_reason "timeout".
        if job.stream:
            # on_close: a no-op when the requests finished; an abort when the client left
            return ClosingSSEResponse(self._events(job, stream, fmt),
                                      on_close=lambda: self.engine.abort(stream, "client_disconnect"))
        finals = await self._collect(stream, raw)
        outs = [finals[job.engine_id(i)] for i in range(len(job.prompts))]
        if all(c.finish_reason == "timeout" and not c.token_ids for o in outs for c in o.outputs):
            raise APIError(408, f"the request reached its deadline ({params.timeout:g}s after arrival) before it "
                                "produced a token", param="timeout", code="request_timeout")
        return JSONResponse(fmt.response(outs))

    async def _outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        remaining = set(stream.request_ids)
        while remaining:
            out = await stream.get()
            if out.finished:
                remaining.discard(out.request_id)
            yield out

    async def _events(self, job: Job, stream: RequestStream, fmt: BaseFormatter) -> AsyncIterator[str]:
        try:
            for chunk in fmt.opening_chunks():
                yield sse(chunk)
            async for out in self._outputs(stream):
                for chunk in fmt.chunks(out):
                    yield sse(chunk)
            if job.include_usage:
                yield sse(fmt.usage_chunk())
        except APIError as e:  # the engine died mid-stream: the status line is long gone
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    async def _collect(self, stream: RequestStream, raw: Request) -> dict:
        watcher = asyncio.create_task(self._watch_disconnect(stream, raw))
        try:
            finals = {}
            async for out in self._outputs(stream):
                if out.finished:
                    finals[out.request_id] = out
            return finals
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, stream: RequestStream, raw: Request) -> None:
        # The body is read, so the next ASGI message is http.disconnect: no polling needed.
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                self.engine.abort(stream, "client_disconnect")
                return

    def _log(self, job: Job, params: SamplingParams) -> None:
        n_tokens = sum(len(p.token_ids) for p in job.prompts)
        if self.state.config.log_prompts:
            prompts = [p.text if p.text is not None else p.token_ids for p in job.prompts]
            logger.info("request %s: prompts=%r params=%s", job.id, prompts, params)
        else:
            logger.info("request %s: %d prompt(s), %d prompt tokens, max_tokens=%s, n=%d, stream=%s", job.id,
                        len(job.prompts), n_tokens, params.max_tokens, params.n, job.stream)


def request_timeout(body: float | None, server: float | None) -> float | None:
    """A request's deadline in seconds: its own `timeout`, bounded by the server's --request-timeout
    (an operator's limit a client cannot lift); either alone when the other is absent."""
    given = [t for t in (body, server) if t is not None]
    return min(given) if given else None
