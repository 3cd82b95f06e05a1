"""Structured outputs' cost: decode steps at batch 1 and 32 with a JSON schema vs without, same
prompts, in one run; the grammar's own time per token (mask fill + applying it + advancing the
matcher); and the compile time of each test schema, cold and cached.

    python benchmarks/structured_decode.py            # default mode (kept-quantized weights)
    python benchmarks/structured_decode.py --runs 5

Both sides generate the same number of tokens per row: the schema asks for a long string
(minLength 2000), so no constrained row can finish before max_tokens; the free rows ignore EOS.
Each run measures both sides (which goes first alternates between runs) and reports per-step medians; the ratio is taken per run
and the median ratio printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # run from a checkout's root
from helpers import english_token_prompts  # noqa: E402

from kvshare import LLM, SamplingParams  # noqa: E402
from kvshare.engine import llm_engine  # noqa: E402
from kvshare.engine.structured_output import StructuredOutputs  # noqa: E402
from kvshare.model.kernels import decode_step, qmatmul  # noqa: E402
from kvshare.sampling_params import StructuredOutputsParams  # noqa: E402
from kvshare.testing.json_schemas import SCHEMAS  # noqa: E402

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"],
        "additionalProperties": False}
DECODE_STEPS = 48


class GrammarTimer:
    """Wall time inside the grammar's parts of a step: the bitmask fill, applying it, consuming."""

    def __init__(self, eng) -> None:
        self.total = 0.0
        self.calls = 0
        self._wrap(eng.structured, "fill_bitmask")
        self._wrap_module(llm_engine, "apply_token_bitmask")
        import kvshare.model.sampler as sampler_mod
        self._wrap_module(sampler_mod, "apply_token_bitmask")
        from kvshare.engine import structured_output
        self._wrap(structured_output.GrammarMatcher, "accept")

    def _timed(self, f):
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.total += time.perf_counter() - t
        return w

    def _wrap(self, obj, name):
        setattr(obj, name, self._timed(getattr(obj, name)))

    def _wrap_module(self, mod, name):
        if hasattr(mod, name):
            setattr(mod, name, self._timed(getattr(mod, name)))


def decode_ms(eng, prompts, params, timer: GrammarTimer) -> tuple[float, float]:
    """(median ms per decode step, grammar ms per step) once every prompt is prefilled."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    while any(s.in_prefill or s.num_output_tokens == 0 for st in eng.requests.values() for s in st.seqs):
        eng.step()
    steps, grammar = [], []
    for _ in range(DECODE_STEPS):
        timer.total = 0.0
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
        grammar.append(timer.total)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(steps) * 1e3, statistics.median(grammar) * 1e3


def compile_times(tokenizer, vocab, eos) -> list[tuple[str, float, float]]:
    so = StructuredOutputs(tokenizer, vocab, eos)
    t = time.perf_counter()
    so._llg()
    print(f"llguidance tokenizer (once per engine, on the first structured request): "
          f"{(time.perf_counter() - t) * 1e3:.0f} ms")
    out = []
    for name, schema in SCHEMAS:
        spec = StructuredOutputsParams(json=schema)
        t = time.perf_counter(); so.compile(spec).new_matcher(); cold = time.perf_counter() - t
        t = time.perf_counter(); so.compile(spec).new_matcher(); cached = time.perf_counter() - t
        out.append((name, cold * 1e3, cached * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=DECODE_STEPS + 8)
    args = ap.parse_args()
    decode_step.DECODE.wait_until_built(); qmatmul.QMATMUL.wait_until_built()
    llm = LLM(kv_cache_memory="1GiB", enable_prefix_caching=False)
    eng = llm.engine
    tok = llm.get_tokenizer()
    timer = GrammarTimer(eng)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=LONG))
    warm = english_token_prompts(tok.encode, [40])
    decode_ms(eng, warm, free, timer)  # first-step costs (kernel loads, llguidance's tokenizer) out of the runs
    decode_ms(eng, warm, constrained, timer)
    results = {1: [], 32: []}
    for run in range(args.runs):
        for batch in (1, 32):
            prompts = english_token_prompts(tok.encode, [40 + 3 * i for i in range(batch)])
            if run % 2 == 0:  # which side goes first alternates: neither always follows the other
                f_ms, _ = decode_ms(eng, prompts, free, timer)
                c_ms, g_ms = decode_ms(eng, prompts, constrained, timer)
            else:
                c_ms, g_ms = decode_ms(eng, prompts, constrained, timer)
                f_ms, _ = decode_ms(eng, prompts, free, timer)
            results[batch].append((f_ms, c_ms, g_ms))
            print(f"run {run + 1} batch {batch:2d}: step {f_ms:7.2f} ms free, {c_ms:7.2f} ms with the schema "
                  f"({c_ms / f_ms:.3f}x); grammar {g_ms:.3f} ms/step = {g_ms * 1e3 / batch:.1f} us/token")
    print()
    for batch, rows in results.items():
        ratio = statistics.median(c / f for f, c, _ in rows)
        g = statistics.median(r[2] for r in rows)
        print(f"batch {batch:2d}: median step {statistics.median(r[0] for r in rows):.2f} ms free, "
              f"{statistics.median(r[1] for r in rows):.2f} ms with the schema: {ratio:.3f}x "
              f"(cost {100 * (ratio - 1):+.1f}%); grammar {g:.3f} ms/step, {g * 1e3 / batch:.1f} us/token")
    print()
    print(f"{'schema':16s} {'cold ms':>8s} {'cached ms':>10s}")
    for name, cold, cached in compile_times(tok, eng.model_config.vocab_size, eng.eos_token_ids):
        print(f"{name:16s} {cold:8.2f} {cached:10.3f}")


if __name__ == "__main__":
    main()
