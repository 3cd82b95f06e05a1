"""Structured outputs as the server receives them, with no model and no grammar engine: how
`response_format` and `structured_outputs` become one StructuredOutputsParams (or a 400 naming the
field), and the grammar-compile pool's rules (server/structured.py's GrammarCompiles) driven by a
stand-in compiler: one compile per grammar however many wait, a bounded number at once, 429 when
no slot frees in time, 400 when the compile itself is too slow, refused for good only by CPU time,
and a queued compile nobody waits for never runs."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import StructuredOutputsParams
from kvshare.server.errors import APIError
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest
from kvshare.server import structured
from kvshare.server.structured import GrammarCompiles, structured_params

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


# ---- the request's constraint ---------------------------------------------------------------------

def test_no_constraint_and_a_text_format_are_none():
    assert structured_params(chat()) is None
    assert structured_params(chat(response_format={"type": "text"})) is None


def test_a_json_schema_format_becomes_a_json_spec_naming_its_field():
    spec = structured_params(chat(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "out", "schema": SCHEMA}}))
    assert spec.kind == "json" and spec.json == SCHEMA
    assert spec.source_field == "response_format.json_schema.schema"


def test_a_json_object_format_is_any_object():
    spec = structured_params(chat(response_format={"type": "json_object"}))
    assert spec.kind == "json_object" and spec.source_field == "response_format"


@pytest.mark.parametrize("response_format,param,words", [
    ({"type": "json_schema"}, "response_format.json_schema", "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "out"}}, "response_format.json_schema.schema", "needs 'schema'"),
    ({"type": "json_object", "json_schema": {"name": "out", "schema": SCHEMA}}, "response_format.json_schema",
     "only allowed with type 'json_schema'"),
    ({"type": "text", "json_schema": {"name": "out", "schema": SCHEMA}}, "response_format.json_schema",
     "only allowed with type 'json_schema'"),
])
def test_a_malformed_response_format_names_the_field(response_format, param, words):
    with pytest.raises(InvalidRequestError) as err:
        structured_params(chat(response_format=response_format))
    assert err.value.param == param and words in str(err.value)


def test_structured_outputs_pass_through_with_their_options():
    spec = structured_params(chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                                      "whitespace_pattern": "[ ]?"}))
    assert spec == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, whitespace_pattern="[ ]?")
    assert structured_params(chat(structured_outputs={"choice": ["a", "b"]})).choice == ["a", "b"]
    completion = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}})
    assert structured_params(completion).regex == "[0-9]+"


def test_both_ways_at_once_is_refused_but_a_text_format_beside_structured_outputs_is_not():
    with pytest.raises(InvalidRequestError) as err:
        structured_params(chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}))
    assert err.value.param == "structured_outputs" and "not both" in str(err.value)
    assert structured_params(chat(structured_outputs={"regex": "a"}, response_format={"type": "text"})).regex == "a"


def test_an_empty_structured_outputs_is_the_params_own_refusal():
    with pytest.raises(InvalidRequestError) as err:
        structured_params(chat(structured_outputs={}))
    assert err.value.param == "structured_outputs" and "exactly one of" in str(err.value)


# ---- the compile pool -----------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def compile_threads_at_normal_priority(monkeypatch):
    """The pool's threads run at nice 19 in the server; on a loaded test machine that can hold a
    stand-in's start for long. The rules under test do not depend on the priority."""
    monkeypatch.setattr(structured, "_lowest_cpu_priority", lambda: None)


class StandIn:
    """A compiler: each spec's compile blocks until released (or spins its CPU for `spin` s)."""

    def __init__(self, spin: float = 0.0) -> None:
        self.spin = spin
        self.calls: list[tuple] = []
        self.running = 0
        self.most_at_once = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> None:
        with self.lock:
            self.calls.append(spec.cache_key())
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.spin:
                end = time.thread_time() + self.spin
                while time.thread_time() < end:
                    pass
            else:
                self.release.wait(5)
        finally:
            with self.lock:
                self.running -= 1


def regex(i) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"[a-z]{{{i}}}")


async def settle(compiles, *tasks):
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.02)  # the pool's done-callbacks run on the loop
    return results


def test_one_compile_per_grammar_however_many_requests_wait():
    async def main():
        compiles = GrammarCompiles(2, 2.0)
        compiler = StandIn()
        tasks = [asyncio.create_task(compiles.compile(compiler.compile, regex(3))) for _ in range(5)]
        await asyncio.sleep(0.05)
        compiler.release.set()
        results = await settle(compiles, *tasks)
        assert results == [None] * 5
        assert compiler.calls == [regex(3).cache_key()]
        assert compiles._in_flight == {}
        # A schema as text and the same schema as an object are one grammar.
        await compiles.compile(compiler.compile, StructuredOutputsParams(json='{"type": "object"}'))
        await compiles.compile(compiler.compile, StructuredOutputsParams(json={"type": "object"}))
        assert len(compiler.calls) == 3  # (compiled twice: the pool is not the grammar cache)

    asyncio.run(main())


def test_no_more_than_max_concurrent_compile_at_once():
    async def main():
        compiles = GrammarCompiles(2, 2.0)
        compiler = StandIn()
        tasks = [asyncio.create_task(compiles.compile(compiler.compile, regex(i))) for i in range(1, 6)]
        for _ in range(500):  # until the pool's threads are up (slow on a loaded machine)
            if compiler.running == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert compiler.running == 2
        compiler.release.set()
        assert await settle(compiles, *tasks) == [None] * 5
        assert compiler.most_at_once == 2 and len(compiler.calls) == 5

    asyncio.run(main())


def test_a_compile_that_does_not_start_in_time_is_a_429_and_never_runs():
    async def main():
        compiles = GrammarCompiles(1, 0.1)
        compiler = StandIn()
        busy = asyncio.create_task(compiles.compile(compiler.compile, regex(1)))
        await asyncio.sleep(0.02)
        with pytest.raises(APIError) as err:
            await compiles.compile(compiler.compile, regex(2))
        e = err.value
        assert e.status == 429 and e.code == "grammar_compiles_busy" and e.headers == {"Retry-After": "1"}
        assert e.param == "structured_outputs" and "--max-concurrent-grammar-compiles" in e.message
        compiler.release.set()
        await settle(compiles, busy)
        await asyncio.sleep(0.05)
        assert compiler.calls == [regex(1).cache_key()]  # the refused one left the queue

    asyncio.run(main())


def test_a_compile_over_the_timeout_is_a_400_and_refused_for_good_by_its_cpu_time():
    async def main():
        # Timeouts well above a thread's start-up on a loaded machine: a compile not yet started
        # when its wait ends is a 429, not this 400.
        compiles = GrammarCompiles(1, 0.15)
        slow = StandIn(spin=0.25)
        spec = StructuredOutputsParams(json=SCHEMA, source_field="response_format.json_schema.schema")
        with pytest.raises(InvalidRequestError) as err:
            await compiles.compile(slow.compile, spec)
        assert err.value.param == "response_format.json_schema.schema"
        assert "json grammar took longer than 0.15 s" in str(err.value)
        assert "--grammar-compile-timeout" in str(err.value)
        for _ in range(500):  # the compile goes on in the background, then is judged
            if not compiles._in_flight:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.02)
        assert not compiles._in_flight and len(compiles._refused) == 1
        start = time.monotonic()
        with pytest.raises(InvalidRequestError):
            await compiles.compile(slow.compile, spec)  # at once, without compiling again
        assert time.monotonic() - start < 0.1 and len(slow.calls) == 1

    asyncio.run(main())


def test_a_compile_slow_on_the_clock_but_not_in_cpu_is_not_refused_for_good():
    async def main():
        compiles = GrammarCompiles(1, 0.15)
        waiting = StandIn()  # blocks without using the CPU
        task = asyncio.create_task(compiles.compile(waiting.compile, regex(4)))
        with pytest.raises(InvalidRequestError):
            await task
        waiting.release.set()
        await asyncio.sleep(0.1)
        assert compiles._refused == {}
        await compiles.compile(waiting.compile, regex(4))  # asked again, it compiles again

    asyncio.run(main())


def test_the_refused_memory_is_bounded():
    compiles = GrammarCompiles(1, 1.0)
    compiles.REFUSED_KEPT = 3
    for key in (b"a", b"b", b"c", b"a", b"d"):
        compiles._refuse(key)
    assert list(compiles._refused) == [b"c", b"a", b"d"]  # the oldest went; a refused again is recent
