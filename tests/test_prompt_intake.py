"""Request intake: vLLM's prompt dicts, with cache_salt honoured wherever it is given.

A salt dropped on the way in is a tenant reading another tenant's cached blocks, so each way of
giving it is checked by whether the second tenant's run reuses any of the first one's blocks.
"""
from __future__ import annotations

import pytest

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.errors import InvalidRequestError

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="32MiB", enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def _fresh(llm):
    llm.engine.manager.pool.reset_prefix_cache()
    yield
    llm.engine.manager.assert_idle_whole()


def _text() -> str:
    return ENGLISH_TEXT[:400]


def _one(llm, prompt, params=PARAMS):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def _salted(prompt: dict | str, salt: str | None, where: str):
    """The same request with its salt in the prompt dict or in SamplingParams."""
    as_dict = dict(prompt) if isinstance(prompt, dict) else {"prompt": prompt}
    if salt is None:
        return as_dict, PARAMS
    if where == "prompt":
        return {**as_dict, "cache_salt": salt}, PARAMS
    params = PARAMS.clone()
    params.cache_salt = salt
    return as_dict, params


@pytest.mark.parametrize("kind", ["text", "token_ids"])
@pytest.mark.parametrize("first_where,second_where", [("prompt", "prompt"), ("prompt", "params"),
                                                      ("params", "prompt")])
def test_tenants_with_different_salts_share_no_block(llm, kind, first_where, second_where):
    text = _text()
    prompt = {"prompt": text} if kind == "text" else {"prompt_token_ids": llm.get_tokenizer().encode(text)}
    # Tenant A computes the prompt and publishes its blocks.
    a1 = _one(llm, *_salted(prompt, "tenant-a", first_where))
    assert a1.num_cached_tokens == 0
    # Tenant B and an unsalted caller send the very same tokens: nothing of A's may be reused.
    b = _one(llm, *_salted(prompt, "tenant-b", second_where))
    assert b.num_cached_tokens == 0
    plain = _one(llm, *_salted(prompt, None, second_where))
    assert plain.num_cached_tokens == 0
    # A again, with its salt given the other way: the same tenant does share with itself.
    a2 = _one(llm, *_salted(prompt, "tenant-a", second_where))
    assert a2.num_cached_tokens > 0
    assert a2.outputs[0].token_ids == a1.outputs[0].token_ids


def test_unsalted_caller_does_not_read_salted_blocks_and_vice_versa(llm):
    ids = llm.get_tokenizer().encode(_text())
    plain = _one(llm, ids)
    assert plain.num_cached_tokens == 0
    salted = _one(llm, {"prompt_token_ids": ids, "cache_salt": "tenant-a"})
    assert salted.num_cached_tokens == 0
    assert _one(llm, ids).num_cached_tokens > 0


def test_salt_given_twice_must_agree(llm):
    params = PARAMS.clone()
    params.cache_salt = "tenant-a"
    same = _one(llm, {"prompt": _text(), "cache_salt": "tenant-a"}, params)
    assert same.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="cache_salt differs") as e:
        _one(llm, {"prompt": _text(), "cache_salt": "tenant-b"}, params)
    assert e.value.param == "cache_salt"


@pytest.mark.parametrize("prompt,param,message", [
    ({"prompt": "Hello", "multi_modal_data": {"image": None}}, "multi_modal_data", "text-only"),
    ({"prompt": "Hello", "mm_processor_kwargs": {}}, "mm_processor_kwargs", "text-only"),
    ({"prompt": "Hello", "cache_sault": "x"}, "cache_sault", "unknown prompt key"),
    ({"prompt_token_ids": [1, 2], "salt": "x"}, "salt", "unknown prompt key"),
    ({"prompt": "Hello", "cache_salt": ""}, "cache_salt", "non-empty string"),
    ({"prompt": "Hello", "cache_salt": 7}, "cache_salt", "non-empty string"),
    ({"prompt": [1, 2, 3]}, "prompt", "prompt_token_ids"),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids", "list of token ids"),
    ({"cache_salt": "x"}, "prompt", "needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompt_dicts_are_errors_naming_the_key(llm, prompt, param, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        _one(llm, prompt)
    assert e.value.param == param
    # Nothing was admitted, and the engine keeps serving.
    assert not llm.engine.has_unfinished_requests()
    assert _one(llm, "Hello there").outputs[0].token_ids


def test_token_prompt_may_carry_its_text(llm):
    ids = llm.get_tokenizer().encode("Hello there, how are you?")
    out = _one(llm, {"prompt_token_ids": ids, "prompt": "Hello there, how are you?"})
    assert out.prompt == "Hello there, how are you?"
    assert list(out.prompt_token_ids) == ids


def test_get_tokenizer_works_as_vllm_code_uses_it(llm):
    tok = llm.get_tokenizer()
    text = "Hello there, how are you?"
    ids = tok(text)["input_ids"]
    assert ids == tok.encode(text) and tok([text, text]).input_ids == [ids, ids]
    assert tok.decode(ids) == text and len(tok) == tok.vocab_size == len(tok.get_vocab())
    assert tok.convert_ids_to_tokens(ids)[1].startswith("Ġ") and tok.eos_token_id is not None
    chat = [{"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert chat_ids == tok.encode(rendered, add_special_tokens=False)
    # What vLLM code does with it: tokenize, generate from the ids, decode.
    out = _one(llm, {"prompt_token_ids": chat_ids})
    assert out.prompt_token_ids == chat_ids and llm.chat(chat, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == \
        out.outputs[0].token_ids
