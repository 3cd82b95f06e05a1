"""How far the default mode's greedy answers are from a tie, under last-bit changes to attention.

End-to-end tests check that the bundled model's greedy answer names a fact ("Paris"). The default
mode's bfloat16 prefill GEMMs magnify float32 last-bit differences, so a first token that leads
its runner-up by 0.0003 flips when attention rounds differently (docs/benchmarks.md, "Fourth
pass"). This script decodes each candidate prompt greedily in the default mode under several
attention variants: SDPA as is, SDPA's output times (1 + 1e-7 noise) for a few seeds, and
kvshare's causal prefill kernel in SDPA's place. For each it prints whether the answer names the
fact and the smallest top-1 / top-2 logprob margin up to the token that completes it and over
the whole answer (as many tokens as the test compares). A prompt a test may rest on keeps a
margin far above what these variants move (they move a logprob by ~0.05).

With --gap MODEL it prints instead, per variant, tests/test_default_mode.py's measure against
the exact path (prompts decoding identically, the worst chosen-token logprob gap up to the first
differing token), by default on the prompts tests/test_gemma3_real.py uses: how much of a test's
bound the default mode's own rounding noise takes.

    .venv/bin/python benchmarks/answer_margins.py
    .venv/bin/python benchmarks/answer_margins.py --gap gemma3-270m --seeds 16
    .venv/bin/python benchmarks/answer_margins.py --gap bundled --seeds 8 --steps 32 --lengths 5,20,47,80,128,200,300,400
    .venv/bin/python benchmarks/answer_margins.py --gap gemma3-270m --engine-option kv_cache_dtype=float32
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

from kvshare import LLM, SamplingParams
from kvshare.model import attention
from kvshare.model.kernels import paged_attention

# (messages, the word the answer must name, max tokens) as the end-to-end tests send them; a
# messages list ending with an assistant turn is continued (continue_final_message), a str is a
# completion prompt.
USER = "user"
CANDIDATES = (
    ([{"role": USER, "content": "What is the capital of France?"}], "Paris", 24),
    ([{"role": USER, "content": "What is the capital city of France?"}], "Paris", 24),
    ([{"role": USER, "content": "Which city is the capital of France?"}], "Paris", 24),
    ([{"role": USER, "content": "Name the capital of France."}], "Paris", 24),  # tests/test_server.py CHAT
    ([{"role": USER, "content": "What is the capital of France? Answer in one word."}], "Paris", 24),
    ([{"role": USER, "content": "In which city is the Eiffel Tower?"}], "Paris", 24),
    ([{"role": USER, "content": "What is the capital of Germany?"}], "Berlin", 24),
    ([{"role": USER, "content": "What is the capital of Japan?"}], "Tokyo", 5),  # tests/test_ray_serve.py
    ([{"role": USER, "content": "Say hi"}], "Hello", 5),  # what tests/test_ray_serve.py asked before
    ([{"role": USER, "content": "Name the capital of France."},  # test_continue_final_message...
      {"role": "assistant", "content": "The capital of France is"}], "Paris", 6),
    ("The capital of France is", "Paris", 8),
    ("The Eiffel Tower is in the city of", "Paris", 8),
)


class _NoisySdpa:
    """Stands in for torch.nn.functional inside attention.py: SDPA's output times (1 + eps * N(0,1))."""

    def __init__(self, seed: int, eps: float = 1e-7) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.eps = eps

    def __getattr__(self, name):
        return getattr(F, name)

    def scaled_dot_product_attention(self, *args, **kwargs):
        out = F.scaled_dot_product_attention(*args, **kwargs)
        noise = torch.randn(out.shape, generator=self.gen, dtype=out.dtype)
        return out * (1 + self.eps * noise)


class _CausalKernel:
    """Stands in for torch.nn.functional inside attention.py: the causal prefill kernel where it fits."""

    fits = staticmethod(paged_attention.causal_prefill_fits)  # _attention_functional turns the module's off

    def __getattr__(self, name):
        return getattr(F, name)

    def scaled_dot_product_attention(self, q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        # attention.py calls SDPA on [1, H, n, D] / [1, KVH, n, D]; the kernel takes [n, H, D].
        qk = q[0].transpose(0, 1).contiguous()
        kk, vk = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        if is_causal and attn_mask is None and k.shape[2] == q.shape[2] and self.fits(qk, kk):
            out = torch.empty_like(qk)
            paged_attention.causal_prefill_attention(qk, kk, vk, scale, out=out)
            return out.transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


@contextlib.contextmanager
def _attention_functional(stand_in):
    """attention.py's prompt attention on SDPA (the causal kernel, where the engine has it wired
    in, turned off), through stand_in in place of torch.nn.functional when given."""
    saved_f, saved_fits = attention.F, paged_attention.causal_prefill_fits
    attention.F = stand_in if stand_in is not None else F
    paged_attention.causal_prefill_fits = lambda *args: False
    try:
        yield
    finally:
        attention.F, paged_attention.causal_prefill_fits = saved_f, saved_fits


def _margins(tok, out, word: str) -> tuple[bool, float, float, str]:
    """(the answer names word, the smallest top-1 minus top-2 logprob up to the token completing it
    (over the whole answer when it never does), the smallest over the whole answer, the answer)."""
    comp = out.outputs[0]
    margins, named_at = [], None
    for i in range(len(comp.token_ids)):
        ranked = sorted(lp.logprob for lp in comp.logprobs[i].values())
        margins.append(ranked[-1] - ranked[-2] if len(ranked) > 1 else float("inf"))
        if named_at is None and word in tok.decode(comp.token_ids[:i + 1], skip_special_tokens=True):
            named_at = i
    if not margins:
        return False, float("inf"), float("inf"), comp.text
    upto = margins if named_at is None else margins[:named_at + 1]
    return named_at is not None, min(upto), min(margins), comp.text


def _prompt(tok, messages) -> dict:
    if isinstance(messages, str):
        return {"prompt": messages}
    cont = messages[-1]["role"] == "assistant"
    text = tok.apply_chat_template(messages, add_generation_prompt=not cont, continue_final_message=cont)
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def _variants(seeds: int) -> list[tuple[str, object]]:
    """Fresh stand-ins (each noise generator starts at its seed), so a prompt's noise does not
    depend on the prompts measured before it."""
    variants = [("sdpa", None)] + [(f"noise{s}", _NoisySdpa(s)) for s in range(seeds)]
    if "avx512" in paged_attention.cpu_paths():
        variants.append(("causal-kernel", _CausalKernel()))
    return variants


def _gaps(model: str | None, seeds: int, steps: int, lengths: list[int], options: dict) -> None:
    """The measure of tests/test_default_mode.py and test_gemma3_real.py, per variant, for the
    default engine with `options` on top."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from helpers import EXACT, english_token_prompts, greedy_agreement

    default = LLM(model=model, kv_cache_memory="64MiB", enable_prefix_caching=False, **options)
    exact = LLM(model=model, **EXACT, kv_cache_memory="64MiB", enable_prefix_caching=False)
    tok = default.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, lengths)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    ref = exact.generate(prompts, params, use_tqdm=False)
    for name, stand_in in _variants(seeds):
        with _attention_functional(stand_in):
            got = default.generate(prompts, params, use_tqdm=False)
        identical, worst = greedy_agreement(got, ref)
        print(f"{model or 'bundled'} {name:<14} identical {identical}/{len(prompts)}  worst logprob gap {worst:.4f}")


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, None if value == "None" else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=4, help="noise seeds per prompt")
    ap.add_argument("--gap", metavar="MODEL", help="the default-vs-exact gap per variant for MODEL ('bundled': "
                    "the bundled model) instead")
    ap.add_argument("--steps", type=int, help="greedy steps for --gap (default 8, test_gemma3_real.py's; "
                    "test_default_mode.py: 32)")
    ap.add_argument("--lengths", help="prompt lengths for --gap (default 5,12,20,33,47,64, test_gemma3_real.py's; "
                    "test_default_mode.py's: 5,20,47,80,128,200,300,400)")
    ap.add_argument("--engine-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                    help="for --gap: an LLM() option of the engine measured against the exact path "
                    "(e.g. kv_cache_dtype=float32); repeatable")
    args = ap.parse_args()
    if args.gap:
        lengths = [int(n) for n in (args.lengths or "5,12,20,33,47,64").split(",")]
        _gaps(None if args.gap == "bundled" else args.gap, args.seeds, 8 if args.steps is None else args.steps,
              lengths, dict(args.engine_option))
        return
    for flag, given in (("--steps", args.steps is not None), ("--lengths", args.lengths is not None),
                        ("--engine-option", bool(args.engine_option))):
        if given:
            ap.error(f"{flag} applies only with --gap")
    # No prefix caching: every variant must compute its prompt afresh.
    llm = LLM(enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    print(f"{'prompt':<52} {'variant':<14} {'names it':<8} {'to it':>7} {'whole':>7}  answer")
    for messages, word, max_tokens in CANDIDATES:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
        label = messages if isinstance(messages, str) else " / ".join(m["content"] for m in messages)
        worst_to, worst_whole = float("inf"), float("inf")
        for name, stand_in in _variants(args.seeds):
            with _attention_functional(stand_in):
                out = llm.generate(_prompt(tok, messages), params, use_tqdm=False)[0]
            named, to_word, whole, text = _margins(tok, out, word)
            worst_to = min(worst_to, to_word if named else float("-inf"))
            worst_whole = min(worst_whole, whole)
            print(f"{label[:52]:<52} {name:<14} {str(named):<8} {to_word:>7.4f} {whole:>7.4f}  {text[:50]!r}")
        print(f"{'':<52} {'worst':<14} {'':<8} {worst_to:>7.4f} {worst_whole:>7.4f}  ({max_tokens} tokens)")


if __name__ == "__main__":
    main()
