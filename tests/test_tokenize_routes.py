"""vLLM's /tokenize and /detokenize handlers (server/tokenize.py) over a stand-in tokenizer and
server state, no engine: text and chat bodies, special tokens, token strings, the model-name
check, out-of-vocabulary ids, and bodies too long for the event loop; and the served model's
default name (server/state.py)."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.server.errors import APIError
from kvshare.server.lora_routes import ServedAdapters
from kvshare.server.settings import ServerConfig
from kvshare.server.state import BUNDLED_MODEL_NAME, default_model_name
from kvshare.server.tokenize import LONG_BODY, TokenizeServing

BOS = 1


class ToyTokenizer:
    """Lowercase letters are ids 3..28; id 1 is BOS; the chat template writes '<role>content' lines."""

    vocab_size = 29

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        ids = [ord(c) - ord("a") + 3 for c in text if c.isalpha() and c.islower()]
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        return "".join("<s>" if i == BOS else chr(i - 3 + ord("a")) if i >= 3 else "?" for i in ids
                       if not (skip_special_tokens and i == BOS))

    def convert_ids_to_tokens(self, ids):
        return ["<s>" if i == BOS else chr(i - 3 + ord("a")) for i in ids]

    def apply_chat_template(self, conversation, tools=None, chat_template=None, render_timeout=None,
                            add_generation_prompt=True, continue_final_message=False, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


def serving(tokenizer=None, **config) -> TokenizeServing:
    state = SimpleNamespace(tokenizer=ToyTokenizer() if tokenizer is None else tokenizer, model_name="toy",
                            max_model_len=64, config=ServerConfig(**config), adapters=ServedAdapters())
    return TokenizeServing(state)


def tokenize(serve: TokenizeServing, body) -> dict:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(serve.tokenize(raw))


def detokenize(serve: TokenizeServing, body) -> dict:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(serve.detokenize(raw))


def test_text_is_tokenized_with_special_tokens_by_default():
    got = tokenize(serving(), {"prompt": "abc"})
    assert got == {"count": 4, "max_model_len": 64, "tokens": [BOS, 3, 4, 5], "token_strs": None}
    got = tokenize(serving(), {"prompt": "abc", "add_special_tokens": False, "return_token_strs": True})
    assert got["tokens"] == [3, 4, 5] and got["token_strs"] == ["a", "b", "c"] and got["count"] == 3


def test_chat_messages_render_through_the_template_without_extra_specials_by_default():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    serve = serving()
    got = tokenize(serve, body)
    rendered = "<user>hi<assistant>"
    assert got["tokens"] == ToyTokenizer().encode(rendered, add_special_tokens=False)
    with_specials = tokenize(serve, {**body, "add_special_tokens": True})
    assert with_specials["tokens"] == [BOS] + got["tokens"]
    no_prompt = tokenize(serve, {**body, "add_generation_prompt": False})
    assert no_prompt["count"] < got["count"]


def test_chat_bodies_keep_the_chat_checks():
    serve = serving()
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True,
                         "add_generation_prompt": True})
    assert err.value.param == "continue_final_message"
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"messages": [{"role": "tool", "content": "a"}]})
    assert err.value.param == "messages[0].tool_call_id"
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"messages": []})
    assert err.value.param == "messages"


def test_the_body_chooses_the_request_shape_and_each_refuses_the_others_fields():
    serve = serving()
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert err.value.param == "prompt"  # with messages it is a chat body, where prompt is unknown
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"prompt": "a", "add_generation_prompt": True})
    assert err.value.param == "add_generation_prompt"
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, {"text": "a"})
    assert err.value.param == "prompt" and "(and 1 more problem(s) in the request)" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        tokenize(serve, b"[]")
    assert "must be a JSON object" in str(err.value)


def test_another_models_name_is_a_404_naming_the_served_one():
    serve = serving()
    for call, body in ((tokenize, {"prompt": "a", "model": "gpt-4o"}), (detokenize, {"tokens": [3], "model": "x"})):
        with pytest.raises(APIError) as err:
            call(serve, body)
        e = err.value
        assert e.status == 404 and e.param == "model" and e.code == "model_not_found"
        assert "this server serves 'toy'" in e.message
    assert tokenize(serve, {"prompt": "a", "model": "toy"})["count"] == 2


def test_detokenize_keeps_special_tokens_and_refuses_ids_outside_the_vocabulary():
    serve = serving()
    assert detokenize(serve, {"tokens": [BOS, 3, 4]}) == {"prompt": "<s>ab"}
    assert detokenize(serve, {"tokens": []}) == {"prompt": ""}
    for tokens, index in (([3, 29], 1), ([-1], 0), ([3, 4, 10**9], 2)):
        with pytest.raises(InvalidRequestError) as err:
            detokenize(serve, {"tokens": tokens})
        assert err.value.param == "tokens"
        assert f"tokens[{index}] is {tokens[index]}: token ids must be integers in [0, 29)" == str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        detokenize(serve, {"tokens": ["a"]})
    assert err.value.param == "tokens[0]"


def test_a_model_without_a_tokenizer_says_so():
    serve = serving(tokenizer=False)
    serve.tok = None
    for call, body in ((tokenize, {"prompt": "a"}), (detokenize, {"tokens": [1]})):
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            call(serve, body)


def test_tokenizing_runs_off_the_event_loop_and_detokenizing_only_when_the_body_is_long():
    tok = ToyTokenizer()
    serve = serving(tokenizer=tok)

    async def main():
        loop_thread = threading.current_thread().name
        await serve.tokenize(b'{"prompt": "ab"}')
        await serve.detokenize(b'{"tokens": [3, 4]}')
        long_body = json.dumps({"tokens": [3] * (LONG_BODY // 3)}).encode()
        assert len(long_body) > LONG_BODY
        await serve.detokenize(long_body)
        return loop_thread

    loop_thread = asyncio.run(main())
    assert tok.threads[0] != loop_thread  # tokenize: always on a worker thread
    assert tok.threads[1] == loop_thread  # a short detokenize: on the loop
    assert tok.threads[2] != loop_thread  # a long one: off it


@pytest.mark.parametrize("model,name", [
    (None, BUNDLED_MODEL_NAME),
    ("/models/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct-Q4_K_M"),
    ("/models/llama-3.2-1b/", "llama-3.2-1b"),
    ("gemma3-270m", "gemma3-270m"),
    ("weights.GGUF", "weights.GGUF"),  # only the lowercase suffix is the format's
])
def test_the_served_model_name_defaults_to_the_files_name(model, name):
    assert default_model_name(model) == name
