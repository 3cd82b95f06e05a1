"""How closely one engine configuration follows another on greedy decoding (e.g. a quantized KV
cache against an exact one), shared by tests/test_kv_quant.py and benchmarks/kv_memory.py.

  free-running: each engine generates on its own; the fraction of output positions holding the
      same token, over the whole output (after a divergence positions usually differ and count
      against it).
  teacher-forced: prompt + the reference output go through the candidate as one prompt; the
      fraction of output positions where the reference token is still the argmax. Each decision
      is judged on the same prefix, so one near-tie does not decide the rest of the output.
  mean |logprob delta|: over the reference tokens, teacher-forced in both engines.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.sampling_params import SamplingParams


@dataclass
class Reference:
    prompts: list[list[int]]
    outputs: list[list[int]]
    forced: list[list[tuple[int, float]]]  # (rank, logprob) of each reference token, teacher-forced


@dataclass
class Agreement:
    free_running: float
    teacher_forced: float
    mean_abs_logprob_delta: float
    max_abs_logprob_delta: float


def free_running(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced(llm, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[tuple[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs)], params, use_tqdm=False)
    res = []
    for p, o, out in zip(prompts, outputs, outs):
        entries = out.prompt_logprobs[len(p):]  # entry i predicts output token i
        res.append([(e[t].rank, e[t].logprob) for t, e in zip(o, entries)])
    return res


def reference(llm, prompts: list[list[int]], num_tokens: int) -> Reference:
    outputs = free_running(llm, prompts, num_tokens)
    return Reference(prompts, outputs, teacher_forced(llm, prompts, outputs))


def agreement(llm, ref: Reference) -> Agreement:
    total = sum(len(o) for o in ref.outputs)
    got = free_running(llm, ref.prompts, max(len(o) for o in ref.outputs))
    free = sum(a == b for r, g in zip(ref.outputs, got) for a, b in zip(r, g)) / total
    forced = teacher_forced(llm, ref.prompts, ref.outputs)
    top1 = sum(rank == 1 for row in forced for rank, _ in row) / total
    deltas = [abs(lp - lp_ref) for row, ref_row in zip(forced, ref.forced)
              for (_, lp), (_, lp_ref) in zip(row, ref_row)]
    return Agreement(free, top1, sum(deltas) / len(deltas), max(deltas))
