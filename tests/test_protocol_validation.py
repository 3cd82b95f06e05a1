"""The OpenAI request bodies, validated without a model: every malformed field is a 400 that names
the field (`param`) and says what is allowed; the body's bytes (empty, not UTF-8, not JSON, not an
object, lone surrogates, NaN) are refused before any field is read; vLLM's chat rendering options
and OpenAI's accepted-but-ignored fields behave as documented (kvshare/server/protocol.py,
chat_options.py, ignored_fields.py)."""
from __future__ import annotations

import json
import logging

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.server.chat_options import RESERVED_TEMPLATE_NAMES, echo_text, template_options
from kvshare.server.ignored_fields import IGNORED_FIELDS, check_ignored_fields
from kvshare.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    load_json_object,
    parse_body,
    validate_body,
)

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields) -> CompletionRequest:
    return validate_body({"prompt": "Hello", **fields}, CompletionRequest)


def chat(**fields) -> ChatCompletionRequest:
    return validate_body({"messages": USER, **fields}, ChatCompletionRequest)


def refused(body: dict, model=CompletionRequest, context: dict | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        validate_body(body, model, context)
    return err.value


# ---- the body's bytes --------------------------------------------------------------------------

@pytest.mark.parametrize("raw,words", [
    (b"", "empty"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"prompt": "a"', "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got a JSON list"),
    (b'"text"', "must be a JSON object, got a JSON str"),
    (b"42", "must be a JSON object, got a JSON int"),
    (b'{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "a", "temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{"prompt": "a", "temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "\\ud800"}', "unpaired surrogate"),
    (b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', "unpaired surrogate"),
    (b'{"\\ud83d": 1}', "unpaired surrogate"),  # in a key, too
])
def test_a_body_that_is_not_a_json_object_of_text_is_one_clear_400(raw, words):
    with pytest.raises(InvalidRequestError) as err:
        load_json_object(raw)
    assert words in str(err.value)
    assert err.value.param is None  # the body as a whole, no field


def test_the_offset_of_a_bad_byte_and_the_place_of_a_json_error_are_given():
    raw = b'{"prompt": "ab\xc3"}'
    with pytest.raises(InvalidRequestError) as err:
        load_json_object(raw)
    assert f"offset {raw.index(0xC3)}" in str(err.value) and "b'\\xc3'" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        load_json_object(b'{\n  "prompt": "a",\n  "n": }')
    assert "line 3 column" in str(err.value)


def test_a_deeply_nested_body_is_refused_not_a_crash():
    with pytest.raises(InvalidRequestError) as err:
        load_json_object(b"[" * 100_000 + b"]" * 100_000)
    assert "not valid JSON" in str(err.value) or "nested too deeply" in str(err.value)


def test_paired_surrogate_escapes_are_text_and_parse():
    obj = load_json_object(b'{"prompt": "\\ud83d\\ude00 ok"}')
    assert obj["prompt"] == "\U0001F600 ok"
    req = parse_body(b'{"prompt": "\\ud83d\\ude00"}', CompletionRequest)
    assert req.prompt == ["\U0001F600"]


# ---- fields: unknown, missing, wrong type, out of range -----------------------------------------

def test_an_unknown_top_level_field_is_named_with_the_allowed_ones():
    err = refused({"prompt": "a", "max_token": 5})
    assert err.param == "max_token"
    message = str(err)
    assert "unknown field 'max_token'" in message
    allowed = message.split("allowed fields: ")[1].split(", ")
    assert "max_tokens" in allowed and allowed == sorted(allowed)


def test_an_unknown_nested_field_is_named_by_its_path_without_the_list():
    err = refused({"messages": [{"role": "user", "content": "a", "mood": "happy"}]}, ChatCompletionRequest)
    assert err.param == "messages[0].mood"
    assert "unknown field 'messages[0].mood'" in str(err) and "allowed fields" not in str(err)
    err = refused({"prompt": "a", "stream_options": {"include_usage": True, "extra": 1}})
    assert err.param == "stream_options.extra"


def test_a_missing_required_field_is_named():
    assert refused({"max_tokens": 3}).param == "prompt"
    err = refused({"model": "m"}, ChatCompletionRequest)
    assert err.param == "messages" and "'messages' is required" in str(err)
    assert refused({"messages": [{"content": "a"}]}, ChatCompletionRequest).param == "messages[0].role"


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 129), ("n", 1.5), ("n", "2"), ("n", True),
    ("temperature", -0.1), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01),
    ("seed", 2**63), ("seed", -(2**63) - 1),
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("min_tokens", -1), ("max_tokens", 0), ("logprobs", 21), ("logprobs", -1),
    ("prompt_logprobs", 21), ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]),
    ("cache_salt", ""), ("stream", "yes"), ("echo", 1), ("best_of", 0), ("ignore_eos", "false"),
    ("skip_special_tokens", None), ("logit_bias", {"5": "up"}), ("user", 7),
])
def test_a_wrong_value_is_a_400_naming_the_field_and_showing_the_value(field, value):
    err = refused({"prompt": "a", field: value})
    # A bad element of a list or a map is named down to the element.
    param = {"stop_token_ids": "stop_token_ids[0]", "logit_bias": "logit_bias.5"}.get(field, field)
    assert err.param == param
    message = str(err)
    assert f"'{param}' is invalid" in message
    shown = value[0] if field == "stop_token_ids" else value["5"] if field == "logit_bias" else value
    assert f"(got {json.dumps(shown)})" in message


@pytest.mark.parametrize("field,value", [
    ("max_completion_tokens", 0), ("max_tokens", 0), ("top_logprobs", 21), ("logprobs", 3),
    ("parallel_tool_calls", "no"), ("add_generation_prompt", 1), ("continue_final_message", "yes"),
    ("chat_template_kwargs", ["a"]), ("echo", "no"),
])
def test_chat_fields_name_themselves_too(field, value):
    err = refused({"messages": USER, field: value}, ChatCompletionRequest)
    assert err.param == field and f"'{field}' is invalid" in str(err)


def test_strict_types_do_not_coerce():
    # JSON numbers stay numbers and strings stay strings: "1" is not 1, 1.0 is not an int.
    assert refused({"prompt": "a", "max_tokens": "16"}).param == "max_tokens"
    assert refused({"prompt": "a", "max_tokens": 16.0}).param == "max_tokens"
    assert refused({"prompt": "a", "temperature": True}).param == "temperature"
    assert completion(temperature=1).temperature == 1.0  # an int is a float, as in JSON


def test_the_boundaries_themselves_are_accepted():
    req = completion(n=128, top_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, seed=-(2**63), top_k=-1,
                     min_p=1.0, logprobs=20, prompt_logprobs=0, stop_token_ids=[0, 2**31 - 1], best_of=128,
                     temperature=0.0, max_tokens=1)
    assert (req.n, req.seed, req.stop_token_ids) == (128, -(2**63), [0, 2**31 - 1])
    assert completion(seed=2**63 - 1).seed == 2**63 - 1


def test_several_problems_are_counted_after_the_first():
    err = refused({"prompt": "a", "n": 0, "top_p": 5, "min_p": 9})
    assert err.param == "n"
    assert "(and 2 more problem(s) in the request)" in str(err)
    assert "more problem" not in str(refused({"prompt": "a", "n": 0}))


def test_a_long_value_is_shown_shortened():
    err = refused({"prompt": "a", "user": ["x" * 500]})
    shown = str(err).split("(got ", 1)[1]
    assert shown.endswith('...)') and len(shown) <= 82


def test_defaults_follow_openai_and_vllm():
    req = completion()
    assert (req.n, req.max_tokens, req.stream, req.echo, req.min_tokens) == (1, 16, False, False, 0)
    assert req.temperature is None and req.top_p is None and req.stop is None and req.skip_special_tokens
    c = chat()
    assert c.max_tokens is None and c.max_completion_tokens is None and c.add_generation_prompt
    assert c.parallel_tool_calls is True and c.tool_choice is None and c.logprobs is False


# ---- union-typed fields: prompt, stop, content, tool_choice ------------------------------------

@pytest.mark.parametrize("prompt,expected", [
    ("one", ["one"]),
    (["one", "two"], ["one", "two"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ("", [""]),  # an empty text is refused later, by the engine, which knows the tokenizer
])
def test_every_prompt_shape_becomes_a_list_of_prompts(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [
    7, None, {"text": "a"}, ["a", 1], [1, "a"], [[1], "a"], [True, False], [[1, 2.5]], [["a"]], [[[1]]],
])
def test_a_prompt_of_no_allowed_shape_lists_the_shapes(prompt):
    err = refused({"prompt": prompt})
    assert err.param == "prompt"
    assert str(err).startswith("'prompt' must be a string, a list of strings, a list of token ids")
    assert f"got {json.dumps(prompt)}" in str(err)


def test_an_empty_prompt_list_is_its_own_message():
    err = refused({"prompt": []})
    assert err.param == "prompt" and "empty list" in str(err)


def test_the_prompt_count_limit_is_checked_before_each_prompt():
    context = {"max_prompts": 3}
    assert len(validate_body({"prompt": ["a", "b", "c"]}, CompletionRequest, context).prompt) == 3
    err = refused({"prompt": ["a", "b", "c", "d"]}, context=context)
    assert err.param == "prompt" and "holds 4 prompts" in str(err) and "at most 3" in str(err)
    assert "--max-sequences-per-request" in str(err)
    # Many prompts with a bad one among them: the count is reported, not the bad element.
    err = refused({"prompt": ["a"] * 10 + [5]}, context=context)
    assert "holds 11 prompts" in str(err)
    # One prompt of many token ids is one prompt, whatever its length.
    assert validate_body({"prompt": list(range(100))}, CompletionRequest, context).prompt == [list(range(100))]


@pytest.mark.parametrize("stop,expected", [("END", "END"), (["a", "b"], ["a", "b"]), (None, None), ([], [])])
def test_stop_is_a_string_or_a_list_of_strings(stop, expected):
    assert completion(stop=stop).stop == expected


@pytest.mark.parametrize("stop", [5, ["a", 5], {"s": 1}, [["a"]]])
def test_a_bad_stop_names_the_field(stop):
    err = refused({"prompt": "a", "stop": stop})
    assert err.param == "stop" and str(err).startswith("'stop' must be a string or a list of strings; got")


def test_text_parts_are_joined_with_newlines_and_other_parts_are_refused():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "one"},
                                                      {"type": "text", "text": "two"}]}])
    assert req.messages[0].content == "one\ntwo"
    assert chat(messages=[{"role": "user", "content": []}]).messages[0].content == ""
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    err = refused({"messages": [{"role": "user", "content": [image]}]}, ChatCompletionRequest)
    assert err.param == "messages[0].content"
    assert "text-only model" in str(err) and "image_url" in str(err)
    err = refused({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
                  ChatCompletionRequest)
    assert err.param == "messages[0].content"
    err = refused({"messages": USER + [{"role": "user", "content": 42}]}, ChatCompletionRequest)
    assert err.param == "messages[1].content" and "must be a string or a list of text parts" in str(err)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_every_openai_role_is_accepted(role):
    assert chat(messages=[{"role": role, "content": "x"}]).messages[0].role == role


def test_an_unknown_role_and_an_empty_message_list_are_refused():
    assert refused({"messages": [{"role": "robot", "content": "x"}]}, ChatCompletionRequest).param == \
        "messages[0].role"
    assert refused({"messages": []}, ChatCompletionRequest).param == "messages"


def test_echoed_assistant_fields_are_accepted_only_empty():
    msg = {"role": "assistant", "content": "ok", "refusal": None, "function_call": None, "audio": None,
           "annotations": []}
    assert chat(messages=USER + [msg]).messages[1].content == "ok"
    for field, value in (("function_call", {"name": "f"}), ("audio", {"id": "a"})):
        err = refused({"messages": USER + [{**msg, field: value}]}, ChatCompletionRequest)
        assert err.param.startswith(f"messages[1].{field}")


@pytest.mark.parametrize("choice", ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_takes_openais_shapes(choice):
    assert chat(tool_choice=choice).tool_choice == choice


@pytest.mark.parametrize("choice", [
    "always", 3, {"type": "function"}, {"type": "function", "function": {"name": ""}},
    {"type": "function", "function": {"name": "f", "arguments": "{}"}},
    {"type": "tool", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}, "x": 1},
])
def test_a_bad_tool_choice_lists_the_shapes(choice):
    err = refused({"messages": USER, "tool_choice": choice}, ChatCompletionRequest)
    assert err.param == "tool_choice"
    assert err.args[0].startswith("'tool_choice': must be \"none\", \"auto\", \"required\" or")


def test_tools_are_checked_field_by_field():
    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert chat(tools=[good]).tools[0].function.name == "f"
    assert refused({"messages": USER, "tools": [{"type": "code", "function": {"name": "f"}}]},
                   ChatCompletionRequest).param == "tools[0].type"
    assert refused({"messages": USER, "tools": [good, {"type": "function", "function": {"name": ""}}]},
                   ChatCompletionRequest).param == "tools[1].function.name"
    assert refused({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
                   ChatCompletionRequest).param == "tools[0].function.parameters"


def test_response_format_and_structured_outputs_are_checked_too():
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert req.response_format.json_schema.schema_ == {"type": "object"}
    assert refused({"messages": USER, "response_format": {"type": "yaml"}}, ChatCompletionRequest).param == \
        "response_format.type"
    assert refused({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": ""}}},
                   ChatCompletionRequest).param == "response_format.json_schema.name"
    assert refused({"prompt": "a", "structured_outputs": {"regex": 5}}).param == "structured_outputs.regex"
    assert refused({"prompt": "a", "structured_outputs": {"lark": "x"}}).param == "structured_outputs.lark"
    assert completion(structured_outputs={"json": '{"type": "object"}'}).structured_outputs.json_ == \
        '{"type": "object"}'


# ---- vLLM's chat rendering options -------------------------------------------------------------

def test_template_options_default_to_a_generation_prompt():
    assert template_options(chat()) == {"add_generation_prompt": True, "continue_final_message": False}
    assert template_options(chat(add_generation_prompt=False))["add_generation_prompt"] is False


def test_continue_final_message_turns_off_the_default_generation_prompt_only():
    opts = template_options(chat(continue_final_message=True))
    assert opts == {"add_generation_prompt": False, "continue_final_message": True}
    assert template_options(chat(continue_final_message=True, add_generation_prompt=False))[
        "add_generation_prompt"] is False
    with pytest.raises(InvalidRequestError) as err:
        template_options(chat(continue_final_message=True, add_generation_prompt=True))
    assert err.value.param == "continue_final_message" and "add_generation_prompt: false" in str(err.value)


def test_chat_template_kwargs_reach_the_template_but_cannot_set_the_renderers_names():
    opts = template_options(chat(chat_template_kwargs={"enable_thinking": False, "tools_in_user": 1}))
    assert opts["enable_thinking"] is False and opts["tools_in_user"] == 1
    for name in sorted(RESERVED_TEMPLATE_NAMES):
        with pytest.raises(InvalidRequestError) as err:
            template_options(chat(chat_template_kwargs={name: 1, "zzz": 2}))
        assert err.value.param == "chat_template_kwargs" and repr(name) in str(err.value)


def test_echo_repeats_the_last_message_only_when_its_role_is_the_answers():
    assistant_last = USER + [{"role": "assistant", "content": "The answer is"}]
    assert echo_text(chat(messages=assistant_last)) == ""  # no echo asked
    # After a generation prompt the answer is the assistant's: the user's last message is not echoed.
    assert echo_text(chat(echo=True)) == ""
    assert echo_text(chat(messages=assistant_last, echo=True)) == "The answer is"
    # Without one, the answer continues the last message, whatever its role.
    assert echo_text(chat(echo=True, add_generation_prompt=False)) == "Hi"
    assert echo_text(chat(messages=assistant_last, echo=True, continue_final_message=True,
                          add_generation_prompt=False)) == "The answer is"
    assert echo_text(chat(messages=[{"role": "user", "content": None}], echo=True, add_generation_prompt=False)) == ""


# ---- OpenAI's fields that mean nothing to kvshare ------------------------------------------------

def test_ignored_fields_are_accepted_and_each_logged_once(caplog):
    logged: set[str] = set()
    req = chat(metadata={"a": "b"}, store=True, service_tier="auto", reasoning_effort="low", verbosity="low")
    with caplog.at_level(logging.INFO, logger="kvshare.server"):
        check_ignored_fields(req, logged)
        check_ignored_fields(req, logged)
    assert logged == {"metadata", "store", "service_tier", "reasoning_effort", "verbosity"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("accepted and ignored" in line for line in lines)
    assert sum("'store'" in line for line in lines) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvshare.server"):
        check_ignored_fields(chat(store=False, prompt_cache_key="k"), logged)
    assert [r.getMessage().split("'")[1] for r in caplog.records] == ["prompt_cache_key"]
    check_ignored_fields(chat(), logged)  # none given: nothing logged, nothing refused


def test_every_ignored_field_is_a_field_of_the_chat_request_and_still_typed():
    for name in IGNORED_FIELDS:
        assert name in ChatCompletionRequest.model_fields
    assert refused({"messages": USER, "store": "yes"}, ChatCompletionRequest).param == "store"
    assert refused({"messages": USER, "metadata": {"a": 1}}, ChatCompletionRequest).param == "metadata.a"
    # Completions take none of them: a chat field sent to /v1/completions is a typo to report.
    assert refused({"prompt": "a", "store": True}).param == "store"


def test_the_deprecated_function_fields_are_accepted_only_empty():
    logged: set[str] = set()
    check_ignored_fields(chat(functions=[], function_call="none"), logged)
    with pytest.raises(InvalidRequestError) as err:
        check_ignored_fields(chat(functions=[{"name": "f"}]), set())
    assert err.value.param == "functions" and "use 'tools'" in str(err.value)
    for call in ("auto", {"name": "f"}):
        with pytest.raises(InvalidRequestError) as err:
            check_ignored_fields(chat(function_call=call), set())
        assert err.value.param == "function_call" and "use 'tool_choice'" in str(err.value)
