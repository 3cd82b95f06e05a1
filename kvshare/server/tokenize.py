"""vLLM's /tokenize and /detokenize: request models and handlers.

/tokenize takes a `prompt` (text) or chat `messages` (rendered as /v1/chat/completions renders
them) and answers {count, max_model_len, tokens, token_strs}; /detokenize takes {tokens} and
answers {prompt}. Both check the model name like the /v1/ routes.
"""
from __future__ import annotations

import asyncio

from pydantic import Field

from kvshare.errors import InvalidRequestError
from kvshare.server.chat import render_chat_prompt
from kvshare.server.protocol import ChatMessage, _Strict, load_json_object, validate_body
from kvshare.server.state import ServerState

LONG_BODY = 64 * 1024  # bytes; parsing and tokenizing a body larger than this runs off the event loop


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False  # the template writes the specials it wants
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class TokenizeServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tok = state.tokenizer

    async def tokenize(self, raw: bytes) -> dict:
        # Off the loop whatever its size: a chat body's chat_template_kwargs can make rendering slow.
        return await asyncio.to_thread(self._tokenize, raw)

    async def detokenize(self, raw: bytes) -> dict:
        return await self._off_loop_if_long(raw, self._detokenize)

    async def _off_loop_if_long(self, raw: bytes, fn) -> dict:
        if len(raw) > LONG_BODY:
            return await asyncio.to_thread(fn, raw)
        return fn(raw)

    def _tokenizer(self):
        if self.tok is None:
            raise InvalidRequestError("this model has no tokenizer", None)
        return self.tok

    def _check_model(self, req) -> None:
        self.state.adapters.resolve(req.model, self.state.model_name)  # (an adapter tokenizes as its base)

    def _tokenize(self, raw: bytes) -> dict:
        obj = load_json_object(raw)
        req = validate_body(obj, TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest)
        self._check_model(req)
        tok = self._tokenizer()
        if isinstance(req, TokenizeChatRequest):
            rendered = render_chat_prompt(tok, req, self.state.config.chat_template, self.state.config)
            ids = tok.encode(rendered.text, add_special_tokens=True) if req.add_special_tokens else rendered.token_ids
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.state.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def _detokenize(self, raw: bytes) -> dict:
        req = validate_body(load_json_object(raw), DetokenizeRequest)
        self._check_model(req)
        tok = self._tokenizer()
        vocab = tok.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"tokens[{i}] is {t}: token ids must be integers in [0, {vocab})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
