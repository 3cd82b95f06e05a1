"""Tokenizer parity with transformers (the reference) for the bundled GGUF and for tokenizer.json."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers import hf_tokenizer
from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.loader import bundled_model_path, load_model
from kvshare.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 'quoted' and they'll, we've, I'm.",
    "12345 and 3.14, also 1,000,000 and 2024-01-31 and x2y3",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "if (a&&b) { c = d[0]->e; }  // C++ <template> std::vector<int>",
    "   leading spaces, trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows\n",
    "          ten spaces then text",
    "emoji 😀🎉👍🏽 and 🇫🇷 flags",
    "中文字符和日本語のテキスト、한국어",
    "Ünïcödé àccents, ß, Ωμέγα, Привет мир",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<|im_start|> not quite <|im_start",
    "",
    " ",
    "\n",
    "a",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with emoji 🎨 please."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write code:\n```py\nprint('x')\n```"},
    ],
]


@pytest.fixture(scope="module")
def gguf_metadata():
    return open_gguf_file(bundled_model_path()).metadata


@pytest.fixture(scope="module")
def ours(gguf_metadata):
    return Tokenizer.from_gguf_metadata(gguf_metadata)


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizer()  # built once per run, shared with the other modules


def _ids(result):
    """apply_chat_template(tokenize=True) returns a list or a BatchEncoding depending on version."""
    if hasattr(result, "keys") and "input_ids" in result:
        result = result["input_ids"]
    return list(result)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(ours, hf, add_special):
    mismatches = []
    for text in TEXTS:
        want = hf.encode(text, add_special_tokens=add_special)
        got = ours.encode(text, add_special_tokens=add_special)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, mismatches[:3]


def test_pretokenizer_splits_digits(ours):
    # SmolLM's vocabulary was trained on one digit per pre-token: no multi-digit pieces may appear.
    pieces = ours.convert_ids_to_tokens(ours.encode("12345 and 3.14"))
    assert pieces[:5] == ["1", "2", "3", "4", "5"]
    assert all(len(p.strip("Ġ")) <= 1 for p in pieces if any(c.isdigit() for c in p))


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, hf, skip):
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        if not skip:
            assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless
    # Arbitrary id sequences too, including specials and pieces of multi-byte characters.
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, ours.vocab_size, size=int(rng.integers(1, 30))).tolist()
        ids[0] = int(rng.integers(0, 17))  # a special token
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_tokens_and_special_ids_match_transformers(ours, hf):
    ids = hf.encode("Hello <|im_start|> wörld 😀 12")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert [ours.id_to_piece(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert set(hf.all_special_ids) <= ours.all_special_ids
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert ours.encode(special) == [hf.convert_tokens_to_ids(special)]
        assert ours.token_to_id(special) in ours.all_special_ids


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    want_ids = _ids(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True))
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == want_ids


def test_chat_template_default_system_prompt(ours):
    # The SmolLM2 template inserts its own system turn when the conversation has none.
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    text = ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nS<|im_end|>\n")


def test_template_features(gguf_metadata, hf):
    meta = dict(gguf_metadata)
    meta["tokenizer.chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{% generation %}{{ bos_token }}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    tok = Tokenizer.from_gguf_metadata(meta)
    messages = [{"role": "user", "content": "<b>ü"}, {"role": "assistant", "content": "  x\n"}]
    text = tok.apply_chat_template(messages)
    want = hf.apply_chat_template(messages, chat_template=meta["tokenizer.chat_template"], tokenize=False,
                                  add_generation_prompt=True)
    assert text == want
    assert '"<b>ü"' in text  # tojson escapes neither HTML nor non-ASCII
    with pytest.raises(Exception, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    # The sandbox refuses access to Python internals.
    meta["tokenizer.chat_template"] = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|not safely|SecurityError|access"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template_is_a_clear_error(gguf_metadata):
    meta = {k: v for k, v in gguf_metadata.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_add_bos_token_is_honored(gguf_metadata, ours):
    meta = dict(gguf_metadata, **{"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer.from_gguf_metadata(meta)
    plain = ours.encode("Hello world")
    assert ours.encode("Hello world", add_special_tokens=True) == plain  # this file says add_bos_token=False
    assert tok.encode("Hello world") == [tok.bos_token_id] + plain
    assert tok.encode("Hello world", add_special_tokens=False) == plain
    # The template already writes what it needs (here BOS *is* <|im_start|>); tokenizing the
    # rendered chat must not add another one.
    messages = [{"role": "user", "content": "x"}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id


def test_non_bpe_gguf_tokenizer_is_refused(gguf_metadata):
    meta = dict(gguf_metadata, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(NotImplementedError, match="'llama'"):
        Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf_saved_dir(hf, tmp_path_factory):
    """The transformers tokenizer written out as a Hugging Face model directory would have it."""
    path = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(path)
    return path


def test_tokenizer_json_matches_transformers(hf_saved_dir):
    assert (hf_saved_dir / "tokenizer.json").exists()
    ours = Tokenizer.from_file(hf_saved_dir / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(hf_saved_dir)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )


def test_tokenizer_json_post_processor_decides_bos(hf_saved_dir, tmp_path):
    """transformers 5 leaves BOS to tokenizer.json's post-processor (tokenizer_config's add_bos_token
    does not override it for a generic tokenizer.json); we must agree either way."""
    for name in os.listdir(hf_saved_dir):
        (tmp_path / name).write_bytes((hf_saved_dir / name).read_bytes())
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), add_bos_token=True)))
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    for with_bos in (False, True):
        single = [{"Sequence": {"id": "A", "type_id": 0}}]
        if with_bos:
            single = [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}] + single
        tj["post_processor"] = {
            "type": "TemplateProcessing", "single": single, "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
        }
        (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
        ours = Tokenizer.from_file(tmp_path / "tokenizer.json")
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
        for text in TEXTS[:5]:
            assert ours.encode(text) == hf.encode(text)
            assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
            assert (ours.encode(text)[:1] == [1]) == with_bos


def test_hf_model_directory_gets_its_tokenizer(hf_saved_dir, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    for name in os.listdir(hf_saved_dir):
        (tmp_path / name).write_bytes((hf_saved_dir / name).read_bytes())
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is not None
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.tokenizer.encode("<|im_start|>user\nhi 42") == hf.encode("<|im_start|>user\nhi 42")
    assert loaded.tokenizer.chat_template == hf.chat_template


def test_hf_call_surface_matches_transformers(ours, hf):
    """What vLLM code calls on a tokenizer: tok(text), tok([texts]), len(), get_vocab()."""
    for add_special in (True, False):
        got, want = ours(TEXTS[1], add_special_tokens=add_special), hf(TEXTS[1], add_special_tokens=add_special)
        assert got["input_ids"] == want["input_ids"] and got.attention_mask == want["attention_mask"]
    texts = [t for t in TEXTS[:6]]
    assert ours(texts)["input_ids"] == hf(texts)["input_ids"]
    assert ours(TEXTS[1], truncation=True, max_length=5).input_ids == hf(TEXTS[1], truncation=True,
                                                                         max_length=5)["input_ids"]
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.convert_tokens_to_ids(["<|im_end|>", "Hello"]) == hf.convert_tokens_to_ids(["<|im_end|>", "Hello"])


def test_long_text_takes_the_gil_free_path_with_the_same_ids(ours, hf):
    from kvshare.model.tokenizer import GIL_FREE_LENGTH

    text = " ".join(TEXTS) * (GIL_FREE_LENGTH // 200)
    assert len(text) > GIL_FREE_LENGTH
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert len(ids) > GIL_FREE_LENGTH and ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode_batch([text, "Hi"]) == [ids, hf.encode("Hi")]


@pytest.mark.parametrize("final", ["The answer is", "Sure:  \n"])
def test_continue_final_message_matches_transformers(ours, hf, final):
    messages = CONVERSATIONS[0] + [{"role": "assistant", "content": final}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, tokenize=False, **kw) == want
    assert not want.endswith("<|im_end|>\n")  # the message stays open
    assert ours.apply_chat_template(messages, tokenize=True, **kw) == _ids(hf.apply_chat_template(
        messages, tokenize=True, **kw))
    with pytest.raises(ValueError, match="cannot both"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_kwargs_and_template_override_reach_the_template(ours, hf):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    messages = CONVERSATIONS[0]
    got = ours.apply_chat_template(messages, chat_template=template, add_generation_prompt=False, shout=True)
    assert got == hf.apply_chat_template(messages, chat_template=template, tokenize=False, shout=True)
    assert got.endswith("!") and ours.chat_template != template
