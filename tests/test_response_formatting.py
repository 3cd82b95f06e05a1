"""OpenAI response bodies and stream chunks from engine outputs, with no engine: hand-made
RequestOutputs through the completions and chat formatters (server/formatting.py, completions.py,
chat.py) and a toy tokenizer (one character per token id). Choice numbering over prompts and n,
each token sent once, usage, logprob clamping and ranking, echo, tool-call deltas; and the
chat prompt's own checks before any template runs (roles, tool messages, sizes, template errors)."""
from __future__ import annotations

import json
import math

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.model.template_sandbox import TemplateLimitError
from kvshare.outputs import CompletionOutput, Logprob, RequestOutput
from kvshare.server.chat import ChatFormatter, render_chat_prompt, renders_off_loop
from kvshare.server.completions import CompletionFormatter
from kvshare.server.formatting import MIN_LOGPROB, Job, PromptInput, clamp_logprob, ranked
from kvshare.server.protocol import ChatCompletionRequest
from kvshare.server.settings import ServerConfig
from kvshare.server.tool_calls import plan_tool_calls


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


TOK = CharTokenizer()


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def job(n=1, prompts=("Hi",), **fields) -> Job:
    return Job(id="cmpl-1", created=7, model="toy", prompts=[PromptInput(p, ids(p)) for p in prompts], n=n, **fields)


def output(prompt_index: int, choices: list[tuple[str, str | None]], delta: bool = True, logprobs=False,
           cached: int = 0, prompt="Hi", prompt_logprobs=None) -> RequestOutput:
    """choices: (text so far, finish reason) per choice index."""
    outs = []
    for i, (text, finish) in enumerate(choices):
        lps = [{ord(c): Logprob(-0.5, 1, None), ord("z"): Logprob(float("-inf"), 2, None)} for c in text] \
            if logprobs else None
        outs.append(CompletionOutput(i, text, ids(text), None, lps, finish, None, text if delta else ""))
    return RequestOutput(f"cmpl-1-{prompt_index}", prompt, ids(prompt or ""), prompt_logprobs, outs, all(f for _, f in choices),
                         num_cached_tokens=cached)


# ---- shared helpers -------------------------------------------------------------------------------

def test_logprobs_are_clamped_to_a_json_number():
    assert clamp_logprob(None) is None
    assert clamp_logprob(float("-inf")) == MIN_LOGPROB == -9999.0
    assert clamp_logprob(float("nan")) == MIN_LOGPROB
    assert clamp_logprob(-1e6) == MIN_LOGPROB
    assert clamp_logprob(-0.25) == -0.25 and isinstance(clamp_logprob(-1), float)
    assert not math.isinf(clamp_logprob(-math.inf))


def test_ranked_keeps_the_top_k_in_rank_order_and_the_chosen_token_only_if_in_it():
    entries = {5: Logprob(-3.0, 4), 1: Logprob(-0.1, 1), 2: Logprob(-0.9, 2), 9: Logprob(-1.0, None)}
    assert [t for t, _ in ranked(entries, 2)] == [1, 2]
    assert [t for t, _ in ranked(entries, 4)] == [1, 2, 5]
    assert ranked(entries, 0) == []


def test_engine_ids_carry_the_prompt_index():
    j = job(prompts=("a", "b", "c"))
    assert [j.engine_id(i) for i in range(3)] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert j.prompt_index("cmpl-1-2") == 2
    assert Job(id="a-b-c", created=0, model="m", prompts=[], n=1).prompt_index("a-b-c-11") == 11


# ---- completions ------------------------------------------------------------------------------------

def test_choices_are_numbered_over_prompts_then_n_and_each_token_is_sent_once():
    f = CompletionFormatter(job(n=2, prompts=("Hi", "Yo")), TOK)
    first = f.chunks(output(1, [("a", None), ("", None)], prompt="Yo"))
    assert [c["choices"][0]["index"] for c in first] == [2]  # prompt 1, choice 0; choice 1 has nothing yet
    chunk = first[0]
    assert chunk["object"] == "text_completion" and chunk["id"] == "cmpl-1" and chunk["model"] == "toy"
    assert "usage" not in chunk
    out = output(1, [("ab", "stop"), ("x", None)], prompt="Yo")
    out.outputs[0].text_delta = "b"
    out.outputs[0].stop_reason = "\n"
    second = f.chunks(out)
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in second] == \
        [(2, "b", "stop"), (3, "x", None)]
    assert second[0]["choices"][0]["stop_reason"] == "\n"
    # A finished choice is never sent again, and an output with nothing new sends nothing.
    again = output(1, [("ab", "stop"), ("x", None)], prompt="Yo")
    again.outputs[1].text_delta = ""
    assert f.chunks(again) == []


def test_usage_counts_every_prompt_and_every_choice_and_cached_tokens():
    f = CompletionFormatter(job(n=2, prompts=("Hi", "Yo!"), include_usage=True), TOK)
    finals = [output(0, [("abc", "length"), ("d", "stop")], cached=16), output(1, [("", "stop"), ("ef", "stop")],
                                                                                prompt="Yo!", cached=0)]
    usage = f.usage(finals)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                     "prompt_tokens_details": {"cached_tokens": 16}}
    chunk = f.chunks(finals[0])[0]
    assert chunk["usage"] is None  # null on every chunk but the last, as OpenAI
    last = f.usage_chunk()
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 5


def test_the_whole_response_orders_choices_and_echoes_the_prompt():
    f = CompletionFormatter(job(n=2, prompts=("Hi", "Yo"), echo=True), TOK)
    body = f.response([output(1, [("c", "stop"), ("d", "length")], prompt="Yo"),
                       output(0, [("a", "stop"), ("b", "stop")])])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "Hia", "stop"), (1, "Hib", "stop"), (2, "Yoc", "stop"), (3, "Yod", "length")]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["prompt_logprobs"] is None


def test_an_echoed_token_id_prompt_is_decoded_and_streamed_once_in_the_first_chunk():
    j = Job(id="cmpl-1", created=0, model="toy", prompts=[PromptInput(None, ids("Hey"))], n=1, echo=True)
    f = CompletionFormatter(j, TOK)
    first = f.chunks(output(0, [("a", None)], prompt=None))
    later = output(0, [("ab", "stop")], prompt=None)
    later.outputs[0].text_delta = "b"
    second = f.chunks(later)
    assert first[0]["choices"][0]["text"] == "Heya"
    assert second[0]["choices"][0]["text"] == "b"


def test_completion_logprobs_key_alternatives_by_text_with_offsets_across_chunks():
    f = CompletionFormatter(job(logprobs=1), TOK)
    first = f.chunks(output(0, [("ab", None)], logprobs=True))[0]["choices"][0]["logprobs"]
    assert first["tokens"] == ["a", "b"] and first["token_logprobs"] == [-0.5, -0.5]
    assert first["top_logprobs"] == [{"a": -0.5, "z": MIN_LOGPROB}, {"b": -0.5, "z": MIN_LOGPROB}]
    assert first["text_offset"] == [0, 1]
    out = output(0, [("abcd", "stop")], logprobs=True)
    out.outputs[0].text_delta = "cd"
    second = f.chunks(out)[0]["choices"][0]["logprobs"]
    assert second["tokens"] == ["c", "d"] and second["text_offset"] == [2, 3]
    json.dumps(second, allow_nan=False)  # no -inf reaches the body


def test_echo_with_logprobs_gives_the_prompt_tokens_first_with_null_where_unknown():
    f = CompletionFormatter(job(logprobs=0, echo=True), TOK)
    plps = [None, {ord("i"): Logprob(-2.0, 3, "i")}]
    body = f.response([output(0, [("!", "stop")], logprobs=True, prompt_logprobs=plps)])
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "i", "!"]
    assert lp["token_logprobs"] == [None, -2.0, -0.5]
    assert lp["top_logprobs"][0] is None and lp["text_offset"] == [0, 1, 2]
    assert body["choices"][0]["prompt_logprobs"] == [None, {str(ord("i")): {"logprob": -2.0, "rank": 3,
                                                                             "decoded_token": "i"}}]


def test_token_text_prefers_the_decoded_token_and_needs_no_tokenizer_for_it():
    f = CompletionFormatter(job(), None)
    assert f.token_text(65, Logprob(-1.0, 1, "<A>")) == "<A>"
    assert f.token_text(65) == ""
    assert CompletionFormatter(job(), TOK).token_text(65) == "A"


# ---- chat -----------------------------------------------------------------------------------------

def test_every_chat_choice_opens_with_its_role_then_its_echo():
    f = ChatFormatter(job(n=2, echo_text="Sure: "), TOK)
    opening = f.opening_chunks()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1, 0, 1]
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * 2 + \
        [{"content": "Sure: "}] * 2
    assert all(c["object"] == "chat.completion.chunk" for c in opening)
    body = f.response([output(0, [("yes", "stop"), ("no", "stop")])])
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "Sure: yes"},
                                                       {"role": "assistant", "content": "Sure: no"}]


def test_a_chat_delta_is_empty_on_a_bare_finish_and_carries_text_otherwise():
    f = ChatFormatter(job(), TOK)
    assert f.chunks(output(0, [("a", None)]))[0]["choices"][0]["delta"] == {"content": "a"}
    done = output(0, [("a", "length")])
    done.outputs[0].token_ids = ids("ab")
    done.outputs[0].text_delta = ""
    choice = f.chunks(done)[0]["choices"][0]
    assert choice["delta"] == {} and choice["finish_reason"] == "length"


def test_chat_logprobs_list_the_chosen_token_with_its_bytes_and_the_ranked_alternatives():
    f = ChatFormatter(job(logprobs=1), TOK)
    body = f.response([output(0, [("é", "stop")], logprobs=True)])
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "é" and entry["bytes"] == [0xC3, 0xA9] and entry["logprob"] == -0.5
    assert [t["token"] for t in entry["top_logprobs"]] == ["é"]  # rank 1 only
    assert body["prompt_logprobs"] is None


def tools_request(**fields) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                                 **fields})


def test_a_streamed_tool_call_arrives_as_tool_call_deltas_and_finishes_as_tool_calls():
    plan = plan_tool_calls(tools_request(), "hermes")
    f = ChatFormatter(job(), TOK, plan)
    reply = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    deltas, finish = [], None
    for k in range(1, len(reply) + 1, 7):
        end = min(k + 6, len(reply))
        out = output(0, [(reply[:end], "stop" if end == len(reply) else None)])
        out.outputs[0].text_delta = reply[k - 1:end]
        for c in f.chunks(out):
            deltas.append(c["choices"][0]["delta"])
            finish = c["choices"][0]["finish_reason"] or finish
    content = "".join(d.get("content", "") for d in deltas)
    fragments = [t for d in deltas for t in d.get("tool_calls", [])]
    assert content == "Checking. "
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["type"] == "function"
    assert json.loads("".join(t["function"]["arguments"] for t in fragments)) == {"city": "Oslo"}
    assert finish == "tool_calls"


def test_a_whole_tool_call_reply_is_a_message_with_tool_calls():
    plan = plan_tool_calls(tools_request(), "hermes")
    body = ChatFormatter(job(), TOK, plan).response(
        [output(0, [('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "stop")])])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    plain = ChatFormatter(job(), TOK, plan).response([output(0, [("It is sunny.", "stop")])])["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["tool_calls"] == []


# ---- the chat prompt's own checks -------------------------------------------------------------------

class TemplateTokenizer(CharTokenizer):
    """Renders 'role: content' lines; records what the template was given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.given: dict = {}

    def apply_chat_template(self, conversation, tools=None, chat_template=None, render_timeout=None, **options):
        self.given = {"conversation": conversation, "tools": tools, "chat_template": chat_template,
                      "render_timeout": render_timeout, **options}
        if self.error is not None:
            raise self.error
        return "".join(f"{m['role']}: {m['content']}\n" for m in conversation)


def chat_req(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_the_rendered_prompt_is_encoded_without_extra_specials():
    tok = TemplateTokenizer()
    prompt = render_chat_prompt(tok, chat_req([{"role": "developer", "content": "Be kind."},
                                               {"role": "user", "content": "Hi", "name": "ann"}]))
    assert prompt.text == "system: Be kind.\nuser: Hi\n"  # developer is the templates' system role
    assert prompt.token_ids == ids(prompt.text)
    assert tok.given["conversation"][1] == {"role": "user", "content": "Hi", "name": "ann"}
    assert tok.given["add_generation_prompt"] is True and tok.given["render_timeout"] == 10.0
    assert tok.given["tools"] is None


def test_assistant_tool_calls_reach_the_template_with_parsed_arguments():
    tok = TemplateTokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    render_chat_prompt(tok, chat_req([{"role": "user", "content": "q"},
                                      {"role": "assistant", "tool_calls": [call]},
                                      {"role": "tool", "content": "42", "tool_call_id": "c1"}]))
    assistant, tool = tok.given["conversation"][1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}


@pytest.mark.parametrize("messages,param,words", [
    ([{"role": "user"}], "messages[0].content", "a 'user' message needs 'content'"),
    ([{"role": "user", "content": "q", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls", "only assistant messages carry tool_calls"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", "needs tool_call_id"),
    ([{"role": "user", "content": "q", "tool_call_id": "c"}], "messages[0].tool_call_id",
     "only 'tool' messages carry tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments", "is not JSON text"),
])
def test_malformed_conversations_are_refused_before_the_template_runs(messages, param, words):
    tok = TemplateTokenizer()
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(tok, chat_req(messages))
    assert err.value.param == param and words in str(err.value)
    assert tok.given == {}


def test_tools_and_template_kwargs_are_size_capped_as_json():
    tok = TemplateTokenizer()
    config = ServerConfig(max_tools_bytes=200, max_chat_template_kwargs_bytes=30)
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 300}}
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(tok, chat_req([{"role": "user", "content": "q"}], tools=[tool]), config=config)
    assert err.value.param == "tools" and "(--max-tools-bytes)" in str(err.value) and "at most 200" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(tok, chat_req([{"role": "user", "content": "q"}], chat_template_kwargs={"k": "v" * 40}),
                           config=config)
    assert err.value.param == "chat_template_kwargs" and "--max-chat-template-kwargs-bytes" in str(err.value)
    small = render_chat_prompt(tok, chat_req([{"role": "user", "content": "q"}], chat_template_kwargs={"k": 1}),
                               config=config)
    assert small.text == "user: q\n" and tok.given["k"] == 1


def test_template_failures_become_400s_naming_what_the_client_controls():
    timed_out = TemplateTokenizer(TemplateLimitError("rendering took too long", True))
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(timed_out, chat_req([{"role": "user", "content": "q"}]),
                           config=ServerConfig(chat_template_timeout=2.5))
    assert err.value.param == "messages" and "--chat-template-timeout 2.5" in str(err.value)
    capped = TemplateTokenizer(TemplateLimitError("built too much", False))
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(capped, chat_req([{"role": "user", "content": "q"}], chat_template_kwargs={"n": 9}))
    assert err.value.param == "chat_template_kwargs" and "a fixed cap of the template sandbox" in str(err.value)
    rejecting = TemplateTokenizer(ValueError("roles must alternate"))
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(rejecting, chat_req([{"role": "user", "content": "q"}]))
    assert err.value.param == "messages" and "rejected these messages: roles must alternate" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        render_chat_prompt(None, chat_req([{"role": "user", "content": "q"}]))
    assert "no tokenizer" in str(err.value)


def test_what_renders_off_the_event_loop():
    short = chat_req([{"role": "user", "content": "q" * 10}])
    assert not renders_off_loop(short, 100)
    assert renders_off_loop(chat_req([{"role": "user", "content": "q" * 101}]), 100)
    assert renders_off_loop(tools_request(), 10**6)
    assert renders_off_loop(chat_req([{"role": "user", "content": "q"}], chat_template_kwargs={"a": 1}), 10**6)
