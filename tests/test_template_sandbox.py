"""The chat-template sandbox (kvshare/model/template_sandbox.py) on its own, no tokenizer and no
model: templates render as jinja2 would, cannot mutate what they are given or reach Python
internals, stop at their deadline, and cannot build (or compute) beyond the size cap by any of the
routes the module names; a long timed render yields the CPU."""
from __future__ import annotations

import time

import jinja2
import jinja2.exceptions
import pytest

from kvshare.model import template_sandbox
from kvshare.model.template_sandbox import (
    MAX_TEMPLATE_BUILD,
    MAX_TEMPLATE_INT_BITS,
    TemplateLimitError,
    TemplateSandbox,
    render,
)


def compile_template(source: str) -> jinja2.Template:
    env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.budget_filters()
    return env.from_string(source)


def run(source: str, timeout: float | None = None, **variables) -> str:
    return render(compile_template(source), timeout, **variables)


def limit(source: str, timeout: float | None = None, **variables) -> TemplateLimitError:
    with pytest.raises(TemplateLimitError) as err:
        run(source, timeout, **variables)
    return err.value


CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_chat_template_renders_as_jinja_would():
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"}]
    got = run(CHAT, 5.0, messages=messages, add_generation_prompt=True)
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT)
    assert got == plain.render(messages=messages, add_generation_prompt=True)
    assert got == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_loops_namespaces_filters_and_loop_controls_work_within_the_budget():
    source = ("{% set ns = namespace(total=0, seen=[]) %}{% for i in range(10) %}{% if i == 7 %}{% break %}"
              "{% endif %}{% if i is odd %}{% continue %}{% endif %}{% set ns.total = ns.total + i %}{% endfor %}"
              "{{ ns.total }}|{{ 'ab' * 3 }}|{{ [3, 1, 2] | sort | join(',') }}|{{ '%05d' % 42 }}|"
              "{{ '{:>6}'.format('x') }}|{{ 'a b'.replace(' ', '-') }}|{{ range(5) | reverse | list }}")
    assert run(source, 5.0) == "12|ababab|1,2,3|00042|     x|a-b|[4, 3, 2, 1, 0]"


def test_the_given_data_cannot_be_mutated():
    messages = [{"role": "user", "content": "x"}]
    for source in ("{{ messages.append(1) }}", "{{ messages[0].update({'role': 'system'}) }}",
                   "{{ messages.pop() }}", "{{ messages[0].clear() }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            run(source, messages=messages)
    assert messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__ }}",
    "{{ '{0.__class__}'.format(1) }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ (messages|attr('__class__')) }}",
])
def test_python_internals_are_out_of_reach(source):
    try:
        text = run(source, messages=[])
    except jinja2.exceptions.SecurityError:
        return
    assert "class" not in text and "function" not in text and text == ""


def test_lipsum_is_gone_and_range_is_the_budgeted_one():
    with pytest.raises(jinja2.exceptions.UndefinedError):
        run("{{ lipsum(100000) }}")
    env = TemplateSandbox()
    assert "lipsum" not in env.globals
    assert env.globals["range"] is template_sandbox._range


def test_a_budgeted_range_behaves_as_a_range():
    budget = template_sandbox.RenderBudget(None)
    r = template_sandbox._BudgetedRange(range(2, 20, 3), budget)
    assert list(r) == [2, 5, 8, 11, 14, 17]
    assert len(r) == 6 and r[1] == 5 and r[-1] == 17
    assert list(reversed(r)) == [17, 14, 11, 8, 5, 2]
    assert 8 in r and 9 not in r
    assert isinstance(r[1:3], template_sandbox._BudgetedRange) and list(r[1:3]) == [5, 8]
    assert repr(r) == "range(2, 20, 3)"
    assert run("{{ range(3) | list }}|{{ range(1, 10)[2] }}|{{ 4 in range(5) }}|{{ range(7)|length }}") == \
        "[0, 1, 2]|3|True|7"


def test_jinjas_own_range_cap_still_holds():
    with pytest.raises(OverflowError):
        run("{% for i in range(200000) %}{% endfor %}")


def test_a_render_stops_at_its_deadline_and_says_so():
    source = "{% for i in range(90000) %}{% for j in range(90000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    err = limit(source, 0.05)
    assert err.timed_out and str(err) == "rendering the chat template took longer than 0.05 s"
    assert time.monotonic() - start < 1.0


def test_a_loop_over_a_stored_range_is_bounded_too():
    # No call the sandbox sees happens inside the loop: the range itself checks the clock.
    source = "{% set r = range(90000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    assert limit(source, 0.05).timed_out


def test_without_a_timeout_only_the_size_cap_applies():
    assert run("{% for i in range(3000) %}{% endfor %}done", None) == "done"
    assert not limit("{{ 'x' * n }}", None, n=2 * MAX_TEMPLATE_BUILD).timed_out


@pytest.mark.parametrize("name,source,variables", [
    ("repeat", "{{ 'x' * n }}", {"n": 2**27}),
    ("repeat_list", "{{ ([1, 2] * n) | length }}", {"n": 2**25}),
    ("replace", "{{ s.replace('', s) }}", {"s": "y" * 2**14}),
    ("join", "{{ s.join(range(9000) | list) }}", {"s": "z" * 2**14}),
    ("center_filter", "{{ 'a' | center(n) }}", {"n": 2**27}),
    ("format_width", "{{ f.format(1) }}", {"f": "{:>%d}" % 2**27}),
    ("format_filter_width", "{{ f | format(1) }}", {"f": "%0" + str(2**27) + "d"}),
    ("percent_width", "{{ '%*d' % (n, 1) }}", {"n": 2**27}),
    ("namespace_doubling", "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s | length }}", {}),
    ("macro_argument", "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s | length }}"
                       "{% endif %}{% endmacro %}{{ f('x', 28) }}", {}),
    ("macro_argument_plus", "{% macro f(s, n) %}{% if n > 0 %}{{ f(s + s, n - 1) }}{% else %}{{ s | length }}"
                            "{% endif %}{% endmacro %}{{ f('x', 28) }}", {}),
    ("list_plus", "{% macro f(l, n) %}{% if n > 0 %}{{ f(l + l, n - 1) }}{% else %}{{ l | length }}{% endif %}"
                  "{% endmacro %}{{ f([1], 26) }}", {}),
    ("output", "{% for i in range(40000) %}{{ s }}{% endfor %}", {"s": "w" * 2**12}),
])
def test_nothing_builds_past_the_cap(name, source, variables):
    err = limit(source, 30.0, **variables)
    assert not err.timed_out
    assert str(MAX_TEMPLATE_BUILD) in str(err)


def test_huge_numbers_are_refused_where_sizes_and_counts_go():
    err = limit("{{ (10 ** n) % 7 }}", n=2**17)
    assert f"more than {MAX_TEMPLATE_INT_BITS} bits with '**'" in str(err)
    err = limit("{{ (a * b) % 7 }}", a=2**40000, b=2**40000)
    assert "bits with '*'" in str(err)
    err = limit("{{ range(n) }}", n=10**12)
    assert "the number 1000000000000 where a size or count goes" in str(err)
    err = limit("{{ 'a' | truncate(n) }}", n=2**200)
    assert "of 201 bits" in str(err)
    assert run("{{ (2 ** 100) % 7 }}") == str(2**100 % 7)  # ordinary arithmetic is untouched


def test_what_the_template_builds_is_counted_across_the_render():
    # Each piece is well under the cap; together they pass it.
    piece = 2**22
    pieces = MAX_TEMPLATE_BUILD // piece + 1
    assert not limit("{% for i in range(n) %}{{ 'q' * k }}{% endfor %}", n=pieces, k=piece).timed_out
    assert len(run("{% for i in range(n) %}{{ 'q' * k }}{% endfor %}", n=pieces // 4, k=piece)) == \
        pieces // 4 * piece


def test_a_long_timed_render_sleeps_between_slices_and_an_untimed_one_never(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(template_sandbox, "LONG_RENDER", 0.0)
    monkeypatch.setattr(template_sandbox.time, "sleep", sleeps.append)
    source = "{% for i in range(2000) %}{{ i }}{% endfor %}"
    run(source, None)
    assert sleeps == []
    run(source, 10.0)
    assert sleeps and set(sleeps) == {template_sandbox.THROTTLE_SLEEP}
    # The throttle sleeps once per slice, not once per step.
    assert len(sleeps) < 2000


def test_the_limit_error_says_which_limit():
    assert TemplateLimitError("x", True).timed_out
    assert not TemplateLimitError("x", False).timed_out
    assert isinstance(TemplateLimitError("x", False), Exception)
