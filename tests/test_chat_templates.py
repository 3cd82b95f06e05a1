"""The chat templates of the model families we load (issue 13 item 4), rendered from a GGUF file's
``tokenizer.chat_template`` by our sandbox and by transformers' renderer, which must agree.

The templates in tests/templates/ are the models' own (Qwen3-0.6B, gemma-2-2b-it, Phi-3.5-mini-
instruct as llama.cpp's models/templates keeps them; Gemma 3's from its tokenizer_config.json).
Qwen3's uses namespaces, reverse iteration over the messages, string methods (startswith,
endswith, split, rstrip, lstrip), tool JSON and reasoning content; Gemma's raise_exception for
role order, content parts and the trim filter; Phi-3's a plain loop.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from helpers import bundled_path
from kvshare.model.gguf_header import open_gguf_file
from kvshare.model.loader import packaged_model_path
from kvshare.model.tokenizer import Tokenizer

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hello there"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Name a colour.  "},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                   {"type": "text", "text": "this."}]}],
}

# Qwen3 alone: tool calls and results, and a thinking reply whose reasoning the template strips.
QWEN3_CONVERSATIONS = {
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": json.dumps({"celsius": 11})},
        {"role": "user", "content": "And Rome?"},
    ],
    "thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ],
}


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def tokenizers_with_templates(path: str, families: list[str]) -> dict[str, Tokenizer]:
    """Per family, the tokenizer the GGUF at ``path`` loads to with that family's template as its
    tokenizer.chat_template (built once: the vocabulary takes seconds; the others are copies
    holding another file's template)."""
    first = template(families[0])
    tok = Tokenizer.from_gguf_metadata(dict(open_gguf_file(path).metadata, **{"tokenizer.chat_template": first}))
    assert tok.chat_template == first
    out = {families[0]: tok}
    for family in families[1:]:
        out[family] = copy.copy(tok)
        out[family].chat_template = template(family)
    return out


@pytest.fixture(scope="module")
def gemma_tokenizers():
    return tokenizers_with_templates(packaged_model_path("gemma3-270m"), ["gemma3", "gemma2"])


@pytest.fixture(scope="module")
def bundled_tokenizers():
    return tokenizers_with_templates(bundled_path(), ["qwen3", "phi3"])


def hf_render(tokenizer: Tokenizer, source: str, messages, **kwargs) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=source, bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token, **kwargs)
    return rendered[0]


def check_agrees(tokenizer: Tokenizer, source: str, messages, **kwargs) -> str:
    ours = tokenizer.apply_chat_template(messages, **kwargs)
    want = hf_render(tokenizer, source, messages, **kwargs)
    assert ours == want
    return ours


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_gemma_templates_from_the_gguf_render_as_transformers(family, conversation, gemma_tokenizers):
    source = template(family)
    tok = gemma_tokenizers[family]
    messages = CONVERSATIONS[conversation]
    if family == "gemma2" and messages[0]["role"] == "system":
        # Gemma 2's template refuses a system turn; ours must refuse it the same way.
        with pytest.raises(Exception, match="System role not supported"):
            tok.apply_chat_template(messages, add_generation_prompt=True)
        return
    text = check_agrees(tok, source, messages, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    # The turn markers are single control tokens of the 262k vocabulary, and the template's own
    # <bos> is the only one: tokenizing the rendered text adds none.
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    start = tok.convert_tokens_to_ids("<start_of_turn>")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(start) == text.count("<start_of_turn>")


def test_gemma3_template_role_order_error(gemma_tokenizers):
    tok = gemma_tokenizers["gemma3"]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# Qwen3's and Phi-3's templates take string content only.
STRING_CONVERSATIONS = sorted(c for c in CONVERSATIONS if c != "content_parts")


@pytest.mark.parametrize("conversation", STRING_CONVERSATIONS + sorted(QWEN3_CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [None, False])
def test_qwen3_template_renders_as_transformers(conversation, enable_thinking, bundled_tokenizers):
    source = template("qwen3")
    tok = bundled_tokenizers["qwen3"]
    messages = {**CONVERSATIONS, **QWEN3_CONVERSATIONS}[conversation]
    kwargs = {"add_generation_prompt": True}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    tools = [WEATHER_TOOL] if conversation == "tools" else None
    text = check_agrees(tok, source, messages, tools=tools, **kwargs)
    assert text.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False else ""))
    if conversation == "tools":
        assert '"name": "get_weather"' in text and "<tool_response>" in text
    if conversation == "thinking":
        # Past turns' reasoning is dropped before the last user query.
        assert "small sum" not in text and "<|im_start|>assistant\n4<|im_end|>" in text


@pytest.mark.parametrize("conversation", STRING_CONVERSATIONS)
def test_phi3_template_renders_as_transformers(conversation, bundled_tokenizers):
    source = template("phi3")
    tok = bundled_tokenizers["phi3"]
    text = check_agrees(tok, source, CONVERSATIONS[conversation], add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")


# ---- the render budget (kvshare.model.template_sandbox) -----------------------------------------

ONE_TURN = [{"role": "user", "content": "Hi"}]


def test_a_render_stops_at_its_deadline(bundled_tokenizers):
    import time

    from kvshare.model.template_sandbox import TemplateLimitError

    tok = next(iter(bundled_tokenizers.values()))
    source = template("kwarg_loops")
    assert "<|im_start|>user\nHi<|im_end|>" in tok.apply_chat_template(ONE_TURN, chat_template=source, passes=3)
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as e:  # 9 million loop steps: seconds without the deadline
        tok.apply_chat_template(ONE_TURN, chat_template=source, render_timeout=0.05, passes=3000)
    assert e.value.timed_out and "0.05 s" in str(e.value)
    assert time.monotonic() - start < 1.0


# Each builds 2**27 characters (or a 2**27-digit power), over the sandbox's cap of 2**26: built
# in full without the budget.
BIG = 2**27
BOMBS = {
    "repeat": ("{{ 'x' * n }}", {"n": BIG}),
    "replace": ("{{ s.replace('', s) }}", {"s": "y" * 2**14}),
    "join": ("{{ s.join(range(9000)|list) }}", {"s": "z" * 2**14}),
    "center_filter": ("{{ 'a'|center(n) }}", {"n": BIG}),
    "format_width": ("{{ f.format(1) }}", {"f": "{:>%d}" % BIG}),
    "percent_width": ("{{ '%*d' % (n, 1) }}", {"n": BIG}),
    "power": ("{{ (10 ** n) % 7 }}", {"n": 2**17}),
    "namespace_doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s|length }}", {}),
    # Doubling through a macro's arguments, by ~ and by +: nothing is stored or written until the
    # innermost call (the review's bomb: 2**29 characters, ~1.25 GB, rendered within the deadline).
    "macro_argument_concat": ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}"
                              "{% endif %}{% endmacro %}{{ f('x', 28) }}", {}),
    "macro_argument_plus": ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s + s, n - 1) }}{% else %}{{ s|length }}"
                            "{% endif %}{% endmacro %}{{ f('x', 28) }}", {}),
    "filter_argument": ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1)|replace('q', s ~ s) }}"
                        "{% endif %}{% endmacro %}{{ f('x', 28) }}", {}),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_template_cannot_build_without_bound(name, bundled_tokenizers):
    from kvshare.model.template_sandbox import MAX_TEMPLATE_BUILD, TemplateLimitError

    tok = next(iter(bundled_tokenizers.values()))
    source, kwargs = BOMBS[name]
    with pytest.raises(TemplateLimitError) as e:
        tok.apply_chat_template(ONE_TURN, chat_template=source, **kwargs)
    assert not e.value.timed_out and (str(MAX_TEMPLATE_BUILD) in str(e.value) or "bits" in str(e.value))


def test_a_template_cannot_reach_python_internals(bundled_tokenizers):
    import jinja2.exceptions

    tok = next(iter(bundled_tokenizers.values()))
    for source in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.__class__.__base__ }}",
                   "{{ ('{0.__class__}'|attr('format'))(1) }}", "{{ '{0.__class__}'.format(1) }}",
                   "{{ cycler.__init__.__globals__ }}"):
        try:
            text = tok.apply_chat_template(ONE_TURN, chat_template=source)
        except jinja2.exceptions.SecurityError:
            continue
        assert text == ""  # an undefined value, never the object
