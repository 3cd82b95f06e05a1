"""vLLM's chat rendering options: add_generation_prompt, continue_final_message,
chat_template_kwargs, and what `echo` puts in front of the answer."""
from __future__ import annotations

from typing import Any

from kvshare.errors import InvalidRequestError

# Names the renderer sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize",
                                     "chat_template", "bos_token", "eos_token", "render_timeout"})


def template_options(req) -> dict[str, Any]:
    """Keyword arguments for Tokenizer.apply_chat_template from a chat (or tokenize) request."""
    extra = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_NAMES & set(extra))
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {clash[0]!r}: give it as a request field "
                                  f"or leave it to the server", "chat_template_kwargs")
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:
        if add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: send "
                                      "add_generation_prompt: false to continue the final message",
                                      "continue_final_message")
        add_generation_prompt = False  # the default true gives way, as an explicit one does not
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": req.continue_final_message,
            **extra}


def echo_text(req) -> str:
    """vLLM's chat echo: the answer's role is the assistant's after a generation prompt, else the
    last message's own; that message's content is echoed when its role is the answer's."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    role = "assistant" if template_options(req)["add_generation_prompt"] else last.role
    return (last.content or "") if last.role == role else ""
