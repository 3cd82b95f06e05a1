"""The environment chat templates render in: jinja2's immutable sandbox (no attribute escapes, no
mutation of lists and dicts) plus a budget per render, since a template is code from a model file
run on data from clients (`chat_template_kwargs` can set any variable, e.g. a number a template
passes to range()).

The budget: a deadline, and a cap on what the template builds. A Python thread cannot be stopped
from outside, so the render stops itself: the deadline is checked wherever a template's work can
grow without bound (each step of a range() loop, each call, each intercepted operator, each
namespace assignment, each piece of output), and values that could multiply memory (`*`, `**`,
`%`, str.replace / str.join, format widths, filters' numeric arguments) are sized before they
are built and charged after. Loops over the request's own data are bounded by its size.
"""
from __future__ import annotations

import re
import time
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace

# Characters (about bytes) a render may build in all, its output included; far above any prompt a
# model's context holds, far below what hurts the server.
MAX_TEMPLATE_BUILD = 2**26
MAX_TEMPLATE_INT_BITS = 2**16  # larger integers make arithmetic itself slow
_BUDGET = "__kvshare_render_budget"  # its context name; the sandbox hides its (underscored) attributes
_WIDTH = re.compile(r"\d+")


class TemplateLimitError(Exception):
    """A render went over its time limit (``timed_out``) or its size cap."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


# A timed render (the server's) that runs past LONG_RENDER is rare for a real chat template (Qwen3's
# over 100 messages and 10 tools: 1.6 ms; 60,000 short messages, a 4 MiB body: 0.7 s): from then
# on it sleeps THROTTLE_SLEEP after every THROTTLE_SLICE of work, so it holds the GIL and a core
# for a fifth of the time. Otherwise one such render on a worker thread takes the GIL from the
# engine thread every switch interval and quadruples a neighbour's inter-token gaps. The sleeps
# count toward the deadline, so a render holds its thread no longer than the timeout (the 60,000
# messages render in ~2.5 s, well within the default 10 s).
LONG_RENDER = 0.25
THROTTLE_SLICE = 0.002
THROTTLE_SLEEP = 0.008


class RenderBudget:
    def __init__(self, timeout: float | None) -> None:
        self._timeout = timeout
        now = time.monotonic()
        self._deadline = None if timeout is None else now + timeout
        self._throttle_from = None if timeout is None else now + LONG_RENDER
        self._built = 0

    def _check(self) -> None:
        if self._deadline is None:
            return
        now = time.monotonic()
        if now > self._deadline:
            raise TemplateLimitError(f"rendering the chat template took longer than {self._timeout:g} s", True)
        if now > self._throttle_from:
            time.sleep(THROTTLE_SLEEP)
            self._throttle_from = time.monotonic() + THROTTLE_SLICE

    def _reserve(self, size: int) -> None:
        self._check()
        if self._built + size > MAX_TEMPLATE_BUILD:
            raise TemplateLimitError(f"the chat template built more than {MAX_TEMPLATE_BUILD} characters of text "
                                     f"and lists while rendering", False)

    def _charge(self, value: Any) -> Any:
        size = _size(value)
        self._reserve(size)
        self._built += size
        return value


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, range)):
        return 8 * len(value)  # a reference per item
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def _budget(context) -> RenderBudget:
    budget = context.get(_BUDGET)
    return budget if isinstance(budget, RenderBudget) else RenderBudget(None)


def _check_int(value: Any) -> None:
    """Numbers passed to calls, filters and format widths are sizes and counts in practice."""
    if isinstance(value, int) and abs(value) > MAX_TEMPLATE_BUILD:
        shown = value if value.bit_length() <= 64 else f"of {value.bit_length()} bits"
        raise TemplateLimitError(f"the chat template was given the number {shown} where a size or count goes: "
                                 f"at most {MAX_TEMPLATE_BUILD}", False)


def _check_format(fmt: str) -> None:
    for width in _WIDTH.findall(fmt):
        if len(width) > 9 or int(width) > MAX_TEMPLATE_BUILD:
            raise TemplateLimitError(f"the chat template formats with a width of {width[:12]}: at most "
                                     f"{MAX_TEMPLATE_BUILD}", False)


class _BudgetedRange:
    """range() as the sandbox allows it (MAX_RANGE items), checking the deadline at every step:
    a loop over a stored range makes no calls the sandbox sees."""

    def __init__(self, rng: range, budget: RenderBudget) -> None:
        self._range = rng
        self._budget = budget

    def __iter__(self):
        for i in self._range:
            self._budget._check()
            yield i

    def __reversed__(self):
        return iter(_BudgetedRange(self._range[::-1], self._budget))

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        item = self._range[index]
        return _BudgetedRange(item, self._budget) if isinstance(item, range) else item

    def __contains__(self, value) -> bool:
        return value in self._range

    def __repr__(self) -> str:
        return repr(self._range)


@jinja2.pass_context
def _range(context, *args: int) -> _BudgetedRange:
    for a in args:
        _check_int(a)
    return _BudgetedRange(safe_range(*args), _budget(context))


class _BudgetedNamespace(Namespace):
    """namespace(): the one value a template can grow across loop iterations, so every assignment
    is charged."""

    def __setitem__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_budget")._charge(value)
        super().__setitem__(name, value)


@jinja2.pass_context
def _namespace(context, *args: Any, **kwargs: Any) -> Namespace:
    ns = _BudgetedNamespace(*args, **kwargs)
    object.__setattr__(ns, "_budget", _budget(context))
    return ns


def _budgeted_filter(func):
    """A filter with its numeric arguments checked and its result charged (filters are called
    directly by compiled templates, not through the sandbox's call()). It takes the context
    itself, so it hands the filter what the filter asked jinja2 for (jinja2's private _PassArg)."""
    pass_arg = jinja2.utils._PassArg.from_obj(func)
    is_format = getattr(func, "__name__", "") == "do_format"

    @jinja2.pass_context
    def budgeted(context, *args: Any, **kwargs: Any) -> Any:
        for a in (*args[1:], *kwargs.values()):
            _check_int(a)
        if is_format and args and isinstance(args[0], str):
            _check_format(args[0])
        budget = _budget(context)
        budget._check()
        _charge_arguments(budget, args, kwargs)
        first = {jinja2.utils._PassArg.context: context, jinja2.utils._PassArg.eval_context: context.eval_ctx,
                 jinja2.utils._PassArg.environment: context.environment}.get(pass_arg)
        result = func(first, *args, **kwargs) if first is not None else func(*args, **kwargs)
        if isinstance(result, (str, list, tuple, dict)):
            budget._charge(result)
        return result

    return budgeted


def _charge_arguments(budget: RenderBudget, args: tuple, kwargs: dict) -> None:
    """Text and lists handed to a call or filter: a macro that calls itself with its argument
    doubled (`f(s ~ s)`) stores and writes nothing until the innermost call, so what the
    arguments hold is charged on the way in."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (str, list, tuple, dict)):
            budget._charge(a)


def _growth(obj: Any, args: tuple) -> int:
    """An upper bound on the size of what a str method that can multiply its input returns."""
    self = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(self, str) and name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        return len(self) + (len(self) // max(len(old), 1) + 1) * len(new)
    if isinstance(self, str) and name == "join" and args and hasattr(args[0], "__len__"):
        return len(self) * len(args[0])
    return 0


class TemplateSandbox(ImmutableSandboxedEnvironment):
    # "+" too: a sum is no larger than its operands, but repeated (a macro's argument, a namespace
    # attribute) it doubles, so each text or list sum is charged. ("~" cannot be intercepted; its
    # results reach a call, an assignment or the output, which are charged.)
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals["range"] = _range
        self.globals["namespace"] = _namespace

    def budget_filters(self) -> None:
        """Wrap every filter, those set after construction included (call once, at the end)."""
        self.filters = {name: _budgeted_filter(f) for name, f in self.filters.items()}

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's spelling)
        budget = _budget(__context)
        for a in (*args, *kwargs.values()):
            _check_int(a)
        _charge_arguments(budget, args, kwargs)
        budget._reserve(_growth(__obj, args))
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple, dict)):
            budget._charge(result)
        return result

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget(context)
        if isinstance(left, int) and isinstance(right, int) and operator in ("*", "**"):
            power = operator == "**" and right > 0
            bits = left.bit_length() * right if power else left.bit_length() + right.bit_length()
            if bits > MAX_TEMPLATE_INT_BITS:
                raise TemplateLimitError(f"the chat template computes a number of more than {MAX_TEMPLATE_INT_BITS} "
                                         f"bits with '{operator}'", False)
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    budget._reserve(_size(seq) * max(n, 0))
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            for a in right if isinstance(right, tuple) else (right,):
                _check_int(a)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)):
            budget._charge(result)
        return result

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        _check_format(value.__self__)
        return wrapper


def render(template: jinja2.Template, timeout: float | None, **variables: Any) -> str:
    """The template's text, within ``timeout`` seconds (None: no limit) and the size cap; raises
    TemplateLimitError beyond either."""
    budget = RenderBudget(timeout)
    pieces = []
    for piece in template.generate(**variables, **{_BUDGET: budget}):
        budget._charge(piece)
        pieces.append(piece)
    return "".join(pieces)
