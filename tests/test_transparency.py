"""Bit-transparent sharing in the default mode (issue 28): a request's tokens and logprobs are the
same bits whatever shares its batch, whatever is cached, however its prompt is chunked.

Every comparison is exact (`==` on the floats the engine returns, top-2 alternatives included):
the reference is each request run alone with prefix caching off; the engine under test serves
it batched with unrelated requests, over a prefix hit at and around block boundaries, in chunks
of 1, 7, 16 and 64 tokens, as a second turn over the first turn's cached blocks, after being
preempted and recomputed, as one of n forks, as beam search, and through the HTTP server under
16 concurrent clients. What makes it hold is the default mode's token rows
(kvshare.model.numerics): every prompt row takes the decode rows' arithmetic. Models: the bundled
SmolLM2, Gemma 3 270M (sliding-window and global layers in KV cache groups), and tiny
kept-quantized (Q8_0) Qwen3 and Phi-3 with a sliding window, all on the fused C++ stack.
"""
from __future__ import annotations

import concurrent.futures

import gguf
import openai
import pytest

from helpers import english_token_prompts
from kvshare import LLM, SamplingParams
from kvshare.engine.beam_search import BeamSearchParams
from server_proc import SMALL_ENGINE, ServerProcess
from test_families import QWEN3, tiny, write_gguf

STEPS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
BOUNDARIES = (15, 16, 17, 32, 33)


def _result(out):
    """Per choice: (tokens, every returned logprob as (token, logprob) pairs per position)."""
    return [(list(c.token_ids), [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs])
            for c in out.outputs]


def serve(llm: LLM, prompts: dict, params: SamplingParams = GREEDY, together: bool = True,
          join_at: dict | None = None) -> dict:
    """Each request's result; `together`: all in the engine at once (else one after another);
    join_at: request id -> the step before which it is added (others at step 0)."""
    engine, out, steps = llm.engine, {}, 0
    pending = dict(prompts)

    def add_due():
        for rid in [r for r in pending if (join_at or {}).get(r, 0) <= steps]:
            engine.add_request(rid, {"prompt_token_ids": pending.pop(rid)}, params)

    def drain():
        nonlocal steps
        while engine.has_unfinished_requests() or (together and pending):
            if together:
                add_due()
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = _result(o)
            steps += 1

    if together:
        drain()
    else:
        for rid in list(pending):
            engine.add_request(rid, {"prompt_token_ids": pending.pop(rid)}, params)
            drain()
    return out


def alone(llm_factory, prompts: dict, params: SamplingParams = GREEDY) -> dict:
    """The reference: each request by itself, nothing shared (prefix caching off)."""
    return serve(llm_factory(enable_prefix_caching=False), prompts, params, together=False)


def hits(llm: LLM) -> int:
    return llm.engine.status().prefix_cache_hits


# ---- the bundled model ------------------------------------------------------------------------

def bundled(**kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLM(**kw)


@pytest.fixture(scope="module")
def prompts():
    """A shared 40-token system prompt then unrelated tails (5..26 tokens), plus unrelated prompts."""
    tok = LLM(kv_cache_memory="16MiB").get_tokenizer()
    system = english_token_prompts(tok.encode, [40])[0]
    tails = english_token_prompts(tok.encode, [5 + 3 * i for i in range(8)], offset_step=53)
    shared = {f"s{i}": system + t for i, t in enumerate(tails)}
    other = {f"o{i}": p for i, p in enumerate(english_token_prompts(tok.encode, [9, 23, 48], offset_step=71))}
    return shared, other


@pytest.fixture(scope="module")
def reference(prompts):
    shared, other = prompts
    return alone(bundled, {**shared, **other})


def test_the_default_mode_says_it_is_bit_transparent():
    llm = bundled()
    assert llm.engine.numerics.token_rows
    assert llm.engine.transparency == ()


def test_batched_with_unrelated_requests(prompts, reference):
    shared, other = prompts
    got = serve(bundled(enable_prefix_caching=False), {**shared, **other},
                join_at={"o1": 2, "s3": 3, "s5": 5})  # some join while others decode
    assert got == reference


@pytest.mark.parametrize("shared_len", BOUNDARIES)
def test_a_prefix_hit_at_and_around_block_boundaries(prompts, shared_len):
    shared, _ = prompts
    target, donor = shared["s7"], shared["s6"]
    # The donor shares exactly shared_len tokens with the target (then differs), and is cached first.
    donor = target[:shared_len] + [t for t in donor[shared_len:] if t != target[shared_len]][:12]
    assert donor[shared_len] != target[shared_len]
    llm = bundled()
    serve(llm, {"donor": donor})
    before = hits(llm)
    got = serve(llm, {"target": target})
    assert hits(llm) - before == shared_len // 16 * 16  # whole blocks hit, counted in tokens
    assert got["target"] == alone(bundled, {"target": target})["target"]


@pytest.mark.parametrize("budget", [1, 7, 16, 64])
def test_chunked_prefill_budgets(prompts, reference, budget):
    shared, other = prompts
    some = {k: shared[k] for k in ("s0", "s7")} | {"o2": other["o2"]}
    got = serve(bundled(enable_prefix_caching=False, max_num_batched_tokens=budget), some)
    assert got == {k: reference[k] for k in some}


def test_the_shared_system_prompt_from_the_cache(prompts, reference):
    shared, _ = prompts
    llm = bundled(max_num_batched_tokens=32)  # chunked too, over the hit
    got = serve(llm, shared, together=False)
    assert hits(llm) >= 2 * (len(shared) - 1)
    assert got == {k: reference[k] for k in shared}


def test_multi_turn_reuse(prompts):
    shared, _ = prompts
    llm = bundled()
    first = serve(llm, {"t1": shared["s2"]})["t1"][0][0]
    turn2 = shared["s2"] + first + shared["s4"][-9:]
    before = hits(llm)
    got = serve(llm, {"t2": turn2})
    assert hits(llm) > before
    assert got == alone(bundled, {"t2": turn2})


def test_after_preemption_and_recompute(prompts, reference):
    shared, other = prompts
    # A pool of 12 blocks for four 45-70-token requests: the later-admitted ones are preempted
    # (their blocks freed) and recomputed from their prompt and the tokens they had produced.
    llm = bundled(kv_cache_memory=f"{12 * 16 * 23040}B", enable_prefix_caching=False, max_num_seqs=4)
    some = {k: shared[k] for k in ("s1", "s3", "s6")} | {"o2": other["o2"]}
    got = serve(llm, some)
    assert llm.engine.status().preemptions > 0
    assert got == {k: reference[k] for k in some}


def test_n_forks_equal_their_seeds_alone(prompts):
    shared, _ = prompts
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    got = serve(bundled(), {"f": shared["s5"]}, params)["f"]
    for i in range(3):
        one = SamplingParams(n=1, temperature=0.9, seed=11 + i, max_tokens=STEPS, ignore_eos=True, logprobs=2)
        assert got[i] == alone(bundled, {"f": shared["s5"]}, one)["f"][0]


def test_beam_search_scores(prompts):
    shared, _ = prompts
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)

    def beams(llm, prompt):
        return [(s.tokens, s.cum_logprob, s.score) for s in llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences]

    ref = beams(bundled(enable_prefix_caching=False), shared["s3"])
    llm = bundled()
    beams(llm, shared["s2"])  # the system prompt into the cache
    assert beams(llm, shared["s3"]) == ref


def test_prompt_logprobs_on_a_hit(prompts):
    shared, _ = prompts
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1)

    def prompt_lps(llm, prompt):
        engine = llm.engine
        engine.add_request("p", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    return [None if d is None else sorted((t, lp.logprob) for t, lp in d.items())
                            for d in o.prompt_logprobs], _result(o)

    ref = prompt_lps(bundled(enable_prefix_caching=False), shared["s1"])
    llm = bundled()
    prompt_lps(llm, shared["s0"])
    assert prompt_lps(llm, shared["s1"]) == ref


def test_through_the_server_with_16_concurrent_clients():
    srv = ServerProcess().wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        tok = LLM(kv_cache_memory="16MiB").get_tokenizer()
        system = english_token_prompts(tok.encode, [37])[0]
        prompts = [system + t for t in english_token_prompts(tok.encode, [4 + 2 * i for i in range(16)], offset_step=29)]

        def complete(p):
            r = client.completions.create(model=model, prompt=p, max_tokens=STEPS, temperature=0, logprobs=2)
            c = r.choices[0]
            return c.logprobs.tokens, c.logprobs.token_logprobs, [sorted(d.items()) for d in c.logprobs.top_logprobs]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            served = list(pool.map(complete, prompts))
        kv_memory = SMALL_ENGINE[SMALL_ENGINE.index("--kv-cache-memory") + 1]
        max_len = int(SMALL_ENGINE[SMALL_ENGINE.index("--max-model-len") + 1])
        ref_llm = LLM(kv_cache_memory=kv_memory, max_model_len=max_len, enable_prefix_caching=False)
        for p, got in zip(prompts, served):
            ref = ref_llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=STEPS,
                                                                           logprobs=2), use_tqdm=False)[0].outputs[0]
            assert got[1] == [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
            assert got[0] == [tok.decode([t]) for t in ref.token_ids]
    finally:
        srv.close()


# ---- Gemma 3 270M and tiny kept-quantized families --------------------------------------------

def _family_checks(factory, prompts: dict) -> None:
    """Batched, prefix hits (a system prompt, then a second turn), chunk budgets 1 and 7, each
    equal to the requests alone."""
    ref = alone(factory, prompts)
    assert serve(factory(enable_prefix_caching=False), prompts) == ref
    cached = factory()
    assert serve(cached, prompts, together=False) == ref
    assert hits(cached) > 0
    for budget in (1, 7):
        small = {k: prompts[k] for k in list(prompts)[:2]}
        assert serve(factory(max_num_batched_tokens=budget), small) == {k: ref[k] for k in small}


def test_gemma3_270m():
    def gemma(**kw):
        return LLM(model="gemma3-270m", kv_cache_memory="64MiB", **kw)

    tok = gemma(enable_prefix_caching=False).get_tokenizer()
    system = english_token_prompts(tok.encode, [35])[0]
    prompts = {f"g{i}": system + t for i, t in enumerate(english_token_prompts(tok.encode, [6, 11, 19], offset_step=41))}
    _family_checks(gemma, prompts)


@pytest.mark.parametrize("kind", ["qwen3", "phi3-window"])
def test_tiny_kept_quantized_families(tmp_path, kind):
    if kind == "qwen3":
        model = tiny("qwen3", tmp_path / "hf", **QWEN3)
        write_gguf(tmp_path / "m.gguf", model, "qwen3", gguf.GGMLQuantizationType.Q8_0)
    else:  # every layer windowed: rows past the window stay in the fused stack, each with its range
        model = tiny("phi3", tmp_path / "hf", sliding_window=24)
        write_gguf(tmp_path / "m.gguf", model, "phi3", gguf.GGMLQuantizationType.Q8_0)

    def factory(**kw):
        return LLM(model=str(tmp_path / "m.gguf"), kv_cache_memory="16MiB",
                   block_size=16, **kw)

    llm = factory()
    assert llm.engine.transparency == ()
    system = list(range(3, 43))
    prompts = {f"q{i}": system + [(7 * i + j) % 300 + 3 for j in range(5 + 4 * i)] for i in range(3)}
    _family_checks(factory, prompts)
