"""SamplingParams and StructuredOutputsParams on their own, no engine: each bad value is an
InvalidRequestError naming its field (the server's 400 `param`) and what is allowed; the values
the engine relies on are normalised once (stop lists, top_k 0, deduplicated stop token ids); the
stop-string automaton is built once and shared by clones; a structured spec's cache key is
equal exactly when the grammar would be."""
from __future__ import annotations

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("field,value,allowed", [
    ("n", 0, "an integer >= 1"),
    ("n", 1.0, "an integer >= 1"),
    ("temperature", -1e-9, ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.0000001, "in (0, 1]"),
    ("top_k", -2, "-1/0 to disable"),
    ("top_k", 2.0, "an integer >= 1"),
    ("min_p", -0.1, "in [0, 1]"),
    ("min_p", 1.1, "in [0, 1]"),
    ("presence_penalty", 2.1, "in [-2, 2]"),
    ("frequency_penalty", -2.1, "in [-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("max_tokens", 0, "an integer >= 1"),
    ("max_tokens", 3.5, "an integer >= 1"),
    ("min_tokens", -1, "an integer >= 0"),
    ("logprobs", -1, "an integer >= 0 or None"),
    ("logprobs", "5", "an integer >= 0 or None"),
    ("prompt_logprobs", -1, "an integer >= 0 or None"),
    ("stop", "", "a non-empty string"),
    ("stop", ["ok", ""], "a non-empty string"),
    ("stop", ["ok", 3], "a non-empty string"),
    ("stop_token_ids", [1, -1], "non-negative token ids"),
    ("stop_token_ids", ["2"], "non-negative token ids"),
    ("seed", 1.5, "an integer or None"),
    ("structured_outputs", {"json": {}}, "a StructuredOutputsParams or None"),
])
def test_a_bad_value_names_its_field_the_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    message = str(err.value)
    assert message.startswith(f"SamplingParams.{field}={value!r} is invalid: must be ")
    assert allowed in message
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


def test_the_boundaries_are_accepted():
    p = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0,
                       frequency_penalty=2.0, repetition_penalty=1e-6, max_tokens=1, min_tokens=1, logprobs=0,
                       prompt_logprobs=0, seed=-5)
    assert p.greedy and p.min_tokens == p.max_tokens == 1
    assert SamplingParams(max_tokens=None, min_tokens=10**6).max_tokens is None


def test_min_tokens_may_not_exceed_max_tokens():
    SamplingParams(max_tokens=4, min_tokens=4)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens" and "<= max_tokens (4)" in str(err.value)


def test_greedy_is_a_temperature_below_1e_5():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams().greedy


def test_top_k_zero_means_disabled_as_minus_one():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("stop,expected", [
    (None, []), ("END", ["END"]), (["a", "bb"], ["a", "bb"]), (("x", "y"), ["x", "y"]),
])
def test_stop_becomes_a_list(stop, expected):
    p = SamplingParams(stop=stop)
    assert p.stop_list == expected
    assert p.stop == stop  # the caller's value is kept as given


def test_stop_token_ids_are_deduplicated_in_order_with_a_set_for_lookups():
    p = SamplingParams(stop_token_ids=[7, 3, 7, 9, 3])
    assert p.stop_token_ids == [7, 3, 9]
    assert p.stop_token_id_set == frozenset({3, 7, 9})
    q = SamplingParams()
    assert q.stop_token_ids == [] and q.stop_token_id_set == frozenset()


def test_the_stop_automaton_is_built_once_and_shared_by_clones():
    p = SamplingParams(stop=["END", "STOP", "END"], seed=3)
    automaton = p.stop_strings
    assert p.stop_strings is automaton
    assert automaton.strings == ("END", "STOP")  # duplicates once
    clone = p.clone()
    assert clone is not p and clone.stop_strings is automaton
    clone.stop_token_ids.append(5)  # the clone's lists are its own
    assert p.stop_token_ids == []


def test_validate_can_be_called_again_after_a_field_is_changed():
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(InvalidRequestError) as err:
        p.validate()
    assert err.value.param == "top_p"


# ---- structured outputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec,kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "string"}'), "json"),
    (dict(regex="[a-z]+"), "regex"),
    (dict(choice=["yes", "no"]), "choice"),
    (dict(grammar='root ::= "a"'), "grammar"),
    (dict(json_object=True), "json_object"),
])
def test_exactly_one_kind_is_the_spec(spec, kind):
    s = StructuredOutputsParams(**spec)
    assert s.kind == kind
    assert SamplingParams(structured_outputs=s).structured_outputs is s


@pytest.mark.parametrize("spec,named", [
    ({}, "none"),
    (dict(json_object=False), "none"),
    (dict(regex="a", choice=["a"]), "regex, choice"),
    (dict(json={}, grammar="x", json_object=True), "json, grammar, json_object"),
])
def test_none_or_several_kinds_are_refused_listing_what_was_given(spec, named):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**spec)
    assert err.value.param == "structured_outputs"
    assert str(err.value) == ("structured_outputs must set exactly one of json, regex, choice, grammar, "
                              f"json_object; got {named}")


@pytest.mark.parametrize("spec,allowed", [
    (dict(json=5), "a JSON schema"),
    (dict(json=["a"]), "a JSON schema"),
    (dict(regex=""), "a non-empty regex string"),
    (dict(regex=5), "a non-empty regex string"),
    (dict(choice=[]), "a non-empty list of strings"),
    (dict(choice=["a", 1]), "a non-empty list of strings"),
    (dict(choice="yes"), "a non-empty list of strings"),
    (dict(grammar="   \n"), "non-empty Lark or GBNF grammar text"),
    (dict(json_object=1), "true"),
])
def test_a_bad_spec_value_names_its_kind(spec, allowed):
    kind = next(iter(spec))
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**spec)
    assert err.value.param == f"structured_outputs.{kind}"
    assert str(err.value).startswith(f"structured_outputs.{kind} must be {allowed}")


def test_errors_name_the_request_field_the_spec_came_from():
    where = "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json=7, source_field=where)
    assert err.value.param == where and str(err.value).startswith(where + ".json must be")
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(source_field="tools")
    assert err.value.param == "tools" and "tools must set exactly one of" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json={}, whitespace_pattern=5)
    assert err.value.param == "structured_outputs.whitespace_pattern"


def test_the_source_field_does_not_make_two_specs_differ():
    assert StructuredOutputsParams(regex="a", source_field="x") == StructuredOutputsParams(regex="a")


def test_a_schema_as_text_or_object_in_any_key_order_has_one_cache_key():
    as_object = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    as_text = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert as_object.cache_key() == as_text.cache_key()
    assert hash(as_object.cache_key()) == hash(as_text.cache_key())


def test_cache_keys_differ_with_the_kind_the_spec_and_every_option():
    base = StructuredOutputsParams(json={"type": "object"})
    others = [
        StructuredOutputsParams(json={"type": "array"}),
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True),
        StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True),
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"[ ]?"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(grammar='{"type": "object"}'),
    ]
    keys = [base.cache_key()] + [o.cache_key() for o in others]
    assert len(set(keys)) == len(keys)
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() != StructuredOutputsParams(
        choice=["b", "a"]).cache_key()  # the order of choices is the grammar's order


def test_schema_text_that_is_not_json_still_has_a_key_and_is_refused_later():
    broken = StructuredOutputsParams(json="{not json")
    assert broken.cache_key()[:2] == ("json", "{not json")
