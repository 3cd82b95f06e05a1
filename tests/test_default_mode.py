"""The default mode (kept-quantized GGUF weights, `dtype="auto"`) against the exact mode.

The kept-quantized weights are the file's weights exactly (tests/test_qlinear.py), so what can
differ from the exact path is only arithmetic: float32 summation order in the kernels, and on
CPUs with avx512_bf16 the prefill GEMMs' bfloat16 inputs (EngineConfig.prefill_dtype; activations
stay float32) and the bfloat16 KV cache that comes with them
(kvshare.config.resolve_kv_cache_dtype). Hence the bounds below: tokens identical on at least 7 of
8 prompts over 32 greedy steps (14 of 16 in benchmarks/default_mode_accuracy.py; a near-tie can
flip once rounding differs, and one flip changes every later token), and, up to the first
differing token, chosen-token logprobs within _tol: float32 throughout, summation order only,
so 1e-3; bfloat16 prefill GEMMs, whose inputs carry 8 significant bits (2^-9
relative), perturb every prompt token's K/V by a few tenths of a percent: 0.1 (measured worst
0.034 over 16 prompts; 0.029-0.062 over 10 equally valid roundings on this test's 8 prompts,
`benchmarks/answer_margins.py --gap bundled`); bfloat16 activations (dtype="bfloat16"), 0.25.
With float32 prefill GEMMs but weights in VNNI blocks, 1e-2 (tests/helpers.py).
"""
from __future__ import annotations

import pytest

from helpers import EXACT, default_mode_logprob_tolerance, english_token_prompts, greedy_agreement
from kvshare import LLM, SamplingParams
from kvshare.model.kernels import qmatmul

STEPS = 32


@pytest.fixture(scope="module")
def engines():
    qmatmul.QMATMUL.wait_until_built()  # what `make setup` does; else the first steps run dense
    default = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False)
    exact = LLM(**EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False)
    return default, exact


_tol = default_mode_logprob_tolerance


def _prompts(llm, lengths):
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, lengths)]


def test_default_mode_keeps_weights_quantized(engines):
    default, exact = engines
    assert default.config.quantization == "auto" and default.config.dtype in ("float32", "bfloat16")
    kinds = {lin.kind for lin in default.engine.model.linears()}
    assert kinds <= {"int4-group", "int8-group"}, kinds
    # Resident weights stay near the file's size (94 MB of Q4_1/Q8_0), far below the float32 copy.
    assert default.engine.model.weight_bytes < 0.4 * exact.engine.model.weight_bytes
    assert any("kept quantized" in line for line in default.engine.startup.lines())
    # Where the start-up time went: the load, then the layers built (the weights repacked).
    timing = default.engine.startup.lines()[-1]
    assert "weights loaded in" in timing and "layers built in" in timing, timing
    assert 0 < default.engine.startup.build_seconds < default.engine.startup.ready_seconds


def test_greedy_tokens_and_logprobs_match_the_exact_path(engines):
    default, exact = engines
    # Eight lengths from 5 to 480 (every second one of the fused-decode test's 16).
    prompts = _prompts(default, [5, 20, 47, 80, 128, 200, 300, 400])
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    got = default.generate(prompts, params, use_tqdm=False)
    ref = exact.generate(prompts, params, use_tqdm=False)
    identical, worst = greedy_agreement(got, ref)
    assert identical >= 7, f"only {identical}/8 prompts decode identically"
    assert worst < _tol(default), worst


def test_prompt_logprobs_match_the_exact_path(engines):
    default, exact = engines
    prompts = _prompts(default, [40, 130])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for g, r in zip(default.generate(prompts, params, use_tqdm=False), exact.generate(prompts, params, use_tqdm=False)):
        ids = g.prompt_token_ids
        assert len(g.prompt_logprobs) == len(ids) and g.prompt_logprobs[0] is None
        diffs = [abs(g.prompt_logprobs[i][ids[i]].logprob - r.prompt_logprobs[i][ids[i]].logprob)
                 for i in range(1, len(ids))]
        # Prompt logprobs come straight from the prefill: in bfloat16 GEMMs every layer rounds.
        assert max(diffs) < _tol(default) * (4 if default.config.prefill_dtype == "bfloat16" else 1), max(diffs)


# Block boundaries up to 401 tokens. Together, the prefill steps exceed PACKED_MAX_ROWS (256) and take
# the dequantized scratch, while a short prompt alone takes the packed kernel; the 599/600-token pair
# of test_batch_isolation would add prefill time, not a kernel choice.
ISOLATION_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 48, 64, 100, 127, 255, 257, 401]


def test_batch_isolation_in_the_default_mode(engines):
    """15 prompts together == each alone, tokens identical: a prompt's answer must not depend on
    which kernel its batch's size picked (packed rows vs the dequantized scratch)."""
    default, _ = engines
    prompts = _prompts(default, ISOLATION_LENGTHS)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in default.generate(prompts, params, use_tqdm=False)]
    alone = [default.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
