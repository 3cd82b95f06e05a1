"""Unseeded sampling: `kvshare serve` draws a fresh root per start, so an unseeded request does
not repeat its samples across restarts; an explicit --seed, and a request's own seed, still do."""
from __future__ import annotations

from kvshare import LLM, SamplingParams
from kvshare.cli import build_parser
from kvshare.engine_args import engine_options

PROMPT = "Once upon a time"
# 32 tokens at temperature 1: two independent draws agree on all of them with a vanishing chance.
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
SMALL = {"kv_cache_memory": "16MiB", "max_model_len": 256}


def sample(llm: LLM, params: SamplingParams = UNSEEDED) -> list[int]:
    return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_serve_draws_a_new_seed_each_start_unless_given_one():
    serve = build_parser().parse_args(["serve"])
    assert engine_options(serve)["seed"] is None
    assert engine_options(build_parser().parse_args(["serve", "--seed", "7"]))["seed"] == 7

    first, second = LLM(seed=None, **SMALL), LLM(seed=None, **SMALL)  # two starts of `kvshare serve` without --seed
    assert sample(first) != sample(second)
    # A request's own seed reproduces across them.
    seeded = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=11)
    assert sample(first, seeded) == sample(second, seeded)
    # So does an explicit engine seed (--seed, LLM(seed=...): the offline default stays 0).
    assert sample(LLM(seed=5, **SMALL)) == sample(LLM(seed=5, **SMALL))
