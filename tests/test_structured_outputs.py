"""Constrained decoding in the engine: the grammar mask, one matcher per sequence, forks, beams,
preemption, and isolation from the unconstrained rows of the same batch (bundled model)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.beam_search import BeamSearchParams
from kvshare.errors import InvalidRequestError
from kvshare.model.sampler import Sampler, SamplingRow, TokenBitmask
from kvshare.sampling_params import StructuredOutputsParams
from kvshare.testing.json_schemas import PROMPTS, SCHEMAS

SCHEMA = dict(SCHEMAS)["person"]


@pytest.fixture(scope="module")
def llm():
    # float32 prefill GEMMs on every CPU: a test below needs the model's own greedy choice of EOS
    # ("No."), which bfloat16 prefill GEMMs (the default on avx512_bf16 CPUs) turn into a longer
    # answer; these tests are about the grammar's meaning, not the numerics.
    return LLM(kv_cache_memory="64MiB", max_model_len=512, prefill_dtype="float32")


def _chat(llm, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                      add_special_tokens=False)


def _json(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=kw.pop("schema", SCHEMA)), **kw)


# ---- params and masks without the model ---------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json": 5}, "structured_outputs.json"),
    ({"json_object": False}, "structured_outputs"),
])
def test_params_need_exactly_one_valid_spec(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == param


def test_bitmask_unpacks_bit_j_of_word_w_as_token_32w_plus_j():
    words = torch.zeros((2, 3), dtype=torch.int32)
    allowed_ids = [[0, 31, 33, 70], [5, 64]]
    for r, ids in enumerate(allowed_ids):
        for t in ids:
            words[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    got = TokenBitmask([0, 1], words).allowed(71)
    assert [torch.nonzero(row).flatten().tolist() for row in got] == allowed_ids


def test_sampler_masks_only_the_rows_with_a_bitmask():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    bits = torch.zeros((1, 4), dtype=torch.int32)
    bits[0, 1] = 1 << 3  # token 35 only
    rows = [SamplingRow(SamplingParams(temperature=t, seed=s), torch.Generator().manual_seed(7) if s else None, [1], [])
            for t, s in ((0, None), (1.0, 7), (0, None))]
    plain = Sampler()(logits.clone(), rows)
    rows[1].generator = torch.Generator().manual_seed(7)
    masked = Sampler()(logits.clone(), rows, TokenBitmask([1], bits))
    assert masked[1].token_id == 35
    assert [masked[0].token_id, masked[2].token_id] == [plain[0].token_id, plain[2].token_id]


# ---- the engine ---------------------------------------------------------------------------

def test_ten_schemas_give_valid_json_offline(llm):
    prompts = [_chat(llm, PROMPTS[name]) for name, _ in SCHEMAS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_json(schema=s, max_tokens=200) for _, s in SCHEMAS], use_tqdm=False)
    for (name, schema), o in zip(SCHEMAS, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.manager.num_used_blocks() == 0


def test_constrained_and_unconstrained_rows_do_not_touch(llm):
    prompts = [{"prompt_token_ids": _chat(llm, t)} for t in ("Tell me about cats.", "A person as JSON.",
                                                              "Name a city.", "Someone you know, as JSON.")]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    plan = [free, _json(), seeded, _json(temperature=0.8, seed=5, n=4)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, plan)]
    together = llm.generate(prompts, plan, use_tqdm=False)
    for a, b in zip(alone, together):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    # The unconstrained rows are not JSON objects (the test could tell a leaked mask apart) ...
    assert not together[0].outputs[0].text.lstrip().startswith("{")
    # ... and every constrained choice, all four forks included, validates on its own.
    for c in together[1].outputs + together[3].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in together[3].outputs}) > 1  # the forks sampled, each with its own matcher


def test_max_tokens_cuts_a_schema_with_finish_reason_length(llm):
    out = llm.generate([{"prompt_token_ids": _chat(llm, "A person as JSON.")}], _json(max_tokens=4),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")


def test_regex_choice_and_grammar(llm):
    p = {"prompt_token_ids": _chat(llm, "Give me a phone number.")}
    specs = [StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/')]
    outs = llm.generate([p] * 3, [SamplingParams(temperature=0, max_tokens=30, structured_outputs=s) for s in specs],
                        use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", outs[2].outputs[0].text)


def test_a_bad_spec_is_refused_before_anything_is_queued(llm):
    for spec, param in ((StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
                        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
                        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar")):
        with pytest.raises(InvalidRequestError) as e:
            llm.engine.add_request(None, [1, 2, 3], SamplingParams(structured_outputs=spec))
        assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_grammars_are_compiled_once_per_spec(llm):
    s = llm.engine.structured
    before = dict(s.stats)
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    a = s.compile(StructuredOutputsParams(json=schema))
    b = s.compile(StructuredOutputsParams(json=json.dumps(dict(reversed(list(schema.items()))))))
    assert a is b
    assert s.stats["compiled"] == before["compiled"] + 1 and s.stats["cache_hits"] == before["cache_hits"] + 1


def test_abort_and_finish_free_the_matcher(llm):
    eng = llm.engine
    rid = eng.add_request(None, _chat(llm, "A person as JSON."), _json(n=2))
    eng.step()
    seqs = list(eng.requests[rid].seqs)
    assert len(seqs) == 2 and all(s.grammar is not None for s in seqs)
    assert seqs[0].grammar is not seqs[1].grammar and seqs[0].grammar.raw is not seqs[1].grammar.raw
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    assert all(s.grammar is None for s in seqs)


def test_preempted_constrained_request_still_validates():
    # 16 blocks of 16 slots: three ~100-token prompts and their outputs cannot all stay resident,
    # so the scheduler preempts and recomputes.
    small = LLM(kv_cache_memory=46080 * 16 * 16, kv_cache_dtype="float32", max_model_len=512,
                enable_prefix_caching=False, max_num_batched_tokens=128)
    filler = "Write about the history of the city of Rome in detail. " * 7
    prompts = [{"prompt_token_ids": _chat(small, filler + f" Then give person number {i} as JSON.")}
               for i in range(3)]
    params = _json(max_tokens=60)
    together = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in together) > 0
    for o in together:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    for p, o in zip(prompts, together):
        if o.metrics.num_preemptions:  # recomputed: the same tokens as when it runs alone
            assert small.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == o.outputs[0].token_ids


def test_beam_search_beams_each_follow_the_grammar(llm):
    prompt = {"prompt_token_ids": _chat(llm, "A person as JSON.")}
    outs = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=30,
                                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    texts = [llm.get_tokenizer().decode(s.tokens[len(prompt["prompt_token_ids"]):]) for s in outs[0].sequences]
    assert len(texts) == 2
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_stop_strings_and_min_tokens_keep_their_meaning(llm):
    p = {"prompt_token_ids": _chat(llm, "Say hello.")}
    choice = StructuredOutputsParams(choice=["hello big world", "hello big moon"])
    stopped = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, stop=[" big"], structured_outputs=choice),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == "hello" and stopped.finish_reason == "stop" and stopped.stop_reason == " big"
    # min_tokens holds end-of-sequence back while the grammar still has somewhere to go.
    answer = StructuredOutputsParams(regex=r"(Yes|No)[A-Za-z ,.]{0,40}")
    p = {"prompt_token_ids": _chat(llm, "Is the sky blue? Answer yes or no.")}
    short = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, structured_outputs=answer),
                         use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids  # the model chose EOS
    longer = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, min_tokens=len(short.token_ids) + 2,
                                              structured_outputs=answer), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(Yes|No)[A-Za-z ,.]{0,40}", longer.text)
    assert len(longer.token_ids) >= len(short.token_ids) + 2


class FakeCompiler:
    """StructuredOutputs.compile's stand-in: counts the compiles (per regex), how many run at once,
    and sleeps `seconds` (or, for the regexes in `held`, computes until `release` is set)."""

    def __init__(self, seconds: float = 0.0, held: tuple = ()) -> None:
        import threading

        self.seconds, self.held = seconds, held
        self.release = threading.Event()
        self.calls: list[str] = []
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def compile(self, spec):
        import time

        with self._lock:
            self.calls.append(spec.regex)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if spec.regex in self.held:  # compiling: CPU time, which is what a refusal is judged by
                deadline = time.monotonic() + 10
                while not self.release.is_set() and time.monotonic() < deadline:
                    pass
            else:
                time.sleep(self.seconds)  # waiting (a starved compile thread): no CPU time
        finally:
            with self._lock:
                self.running -= 1


def test_a_slow_compile_is_refused_stays_refused_and_the_loop_keeps_running():
    import asyncio
    import time

    from kvshare.server.structured import GrammarCompiles

    compiler = FakeCompiler(held=("a+",))
    compiles = GrammarCompiles(max_concurrent=2, timeout=0.2)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not compiler.release.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        with pytest.raises(InvalidRequestError) as first:
            await compiles.compile(compiler.compile, StructuredOutputsParams(regex="a+"))
        compiler.release.set()
        await t
        await asyncio.sleep(0.2)  # the background compile finishes (in the real server: into the cache)
        start = time.monotonic()
        with pytest.raises(InvalidRequestError) as retry:  # the retry is not served from that compile
            await compiles.compile(compiler.compile, StructuredOutputsParams(regex="a+"))
        return first.value, retry.value, time.monotonic() - start, ticks

    first, retry, retry_seconds, ticks = asyncio.run(main())
    assert first.param == "structured_outputs" and "0.2 s" in str(first) and "--grammar-compile-timeout" in str(first)
    assert retry.param == first.param and str(retry) == str(first)
    assert retry_seconds < 0.1 and compiler.calls == ["a+"]  # refused at once, never compiled again
    assert ticks >= 10  # the event loop ran on while the compile was pending


def test_one_grammar_asked_for_by_many_requests_compiles_once():
    import asyncio

    from kvshare.server.structured import GrammarCompiles

    compiler = FakeCompiler(seconds=0.3)
    compiles = GrammarCompiles(max_concurrent=2, timeout=10)

    async def main():
        await asyncio.gather(*(compiles.compile(compiler.compile, StructuredOutputsParams(regex="b+")) for _ in range(8)))

    asyncio.run(main())
    assert compiler.calls == ["b+"]


def test_no_more_grammars_compile_at_once_than_the_limit():
    import asyncio

    from kvshare.server.structured import GrammarCompiles

    compiler = FakeCompiler(seconds=0.2)
    compiles = GrammarCompiles(max_concurrent=2, timeout=30)

    async def main():
        await asyncio.gather(*(compiles.compile(compiler.compile, StructuredOutputsParams(regex=f"c{{{i}}}"))
                               for i in range(6)))

    asyncio.run(main())
    assert sorted(compiler.calls) == sorted(f"c{{{i}}}" for i in range(6))
    assert compiler.most_running == 2


def test_a_compile_that_cannot_start_in_time_is_a_429_and_leaves_the_queue():
    import asyncio

    from kvshare.server.errors import APIError
    from kvshare.server.structured import GrammarCompiles

    compiler = FakeCompiler(held=("busy",))
    compiles = GrammarCompiles(max_concurrent=1, timeout=0.3)

    async def main():
        hog = asyncio.create_task(compiles.compile(compiler.compile, StructuredOutputsParams(regex="busy")))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as queued:
            await compiles.compile(compiler.compile, StructuredOutputsParams(regex="d+"))
        with pytest.raises(InvalidRequestError):
            await hog
        compiler.release.set()
        await asyncio.sleep(0.2)
        ran_while_nobody_waited = "d+" in compiler.calls
        await compiles.compile(compiler.compile, StructuredOutputsParams(regex="d+"))  # not refused: it never ran
        return queued.value, ran_while_nobody_waited

    err, ran_while_nobody_waited = asyncio.run(main())
    assert err.status == 429 and err.param == "structured_outputs" and err.headers == {"Retry-After": "1"}
    assert "--max-concurrent-grammar-compiles" in err.message
    assert not ran_while_nobody_waited and compiler.calls == ["busy", "d+"]


def test_a_compile_slow_only_on_the_clock_is_not_refused_for_good():
    """Compile threads run at the lowest priority, so on a busy server a quick grammar can take
    long on the clock: its request gets the 400, but once its compile is done (cached), a retry
    is served. Only CPU time past the timeout refuses a grammar for good."""
    import asyncio

    from kvshare.server.structured import GrammarCompiles

    compiler = FakeCompiler(seconds=0.4)  # sleeps: a starved thread, no CPU time
    compiles = GrammarCompiles(max_concurrent=1, timeout=0.2)

    async def main():
        with pytest.raises(InvalidRequestError) as first:
            await compiles.compile(compiler.compile, StructuredOutputsParams(regex="b+"))
        await asyncio.sleep(0.4)  # its compile finishes in the background
        compiler.seconds = 0.0  # what the engine's cache does for a compiled grammar
        await compiles.compile(compiler.compile, StructuredOutputsParams(regex="b+"))
        return first.value

    first = asyncio.run(main())
    assert first.param == "structured_outputs" and "--grammar-compile-timeout" in str(first)
    assert compiler.calls == ["b+", "b+"]  # asked again, not refused from memory
