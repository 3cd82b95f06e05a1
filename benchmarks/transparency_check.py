"""How far sharing moves a request's bits: 12 greedy requests of 24 tokens (a shared 70-token
system prompt, then their own tails) with logprobs, each against itself run alone with prefix
caching off, when (a) batched together, (b) served after the system prompt was cached, (c)
prefilled in 32-token chunks. Prints (requests whose tokens changed, max |logprob difference|)
per line: (0, 0.0) everywhere on a bit-transparent engine (docs/transparency.md).

    python benchmarks/transparency_check.py                       # the bundled model, default mode
    M=gemma3-270m python benchmarks/transparency_check.py         # another --model
    KW='{"quantization": null, "dtype": "float32"}' python benchmarks/transparency_check.py   # exact mode
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers import english_token_prompts  # noqa: E402

from kvshare import LLM, SamplingParams  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def run(llm: LLM, prompts: list[list[int]], together: bool) -> list[tuple[list[int], list[float]]]:
    """(tokens, chosen-token logprobs) per prompt: all in the engine at once, or one by one."""
    engine, out = llm.engine, {}

    def drain():
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id] = (list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])

    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
        if not together:
            drain()
    drain()
    return [out[str(i)] for i in range(len(prompts))]


def diff(ref, got) -> tuple[int, float]:
    """(requests whose tokens changed, max |logprob difference| over the others)."""
    changed = sum(a[0] != b[0] for a, b in zip(ref, got))
    same = [(a, b) for a, b in zip(ref, got) if a[0] == b[0]]
    return changed, max((abs(x - y) for a, b in same for x, y in zip(a[1], b[1])), default=0.0)


def main() -> None:
    kw = dict(kv_cache_memory="256MiB", **json.loads(os.environ.get("KW", "{}")))
    if os.environ.get("M"):
        kw["model"] = os.environ["M"]
    base = LLM(enable_prefix_caching=False, **kw)
    enc = base.get_tokenizer().encode
    system = english_token_prompts(enc, [70])[0]
    prompts = [system + t for t in english_token_prompts(enc, [5 + 3 * i for i in range(12)], offset_step=53)]
    t0 = time.time()
    alone = run(base, prompts, together=False)
    print(f"alone {time.time() - t0:.1f} s")
    print("batched", diff(alone, run(base, prompts, together=True)))
    del base
    cached = LLM(enable_prefix_caching=True, **kw)
    run(cached, [system], together=False)
    print("prefix hit", diff(alone, run(cached, prompts, together=False)))
    del cached
    chunked = LLM(enable_prefix_caching=False, max_num_batched_tokens=32, **kw)
    print("chunked 32", diff(alone, run(chunked, prompts, together=False)))


if __name__ == "__main__":
    main()
