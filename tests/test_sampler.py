"""Sampler semantics: greedy, seeded determinism, filters, penalties, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvshare.model.sampler import (
    SampleResult,
    Sampler,
    SamplingRow,
    apply_penalties,
    logprobs_of,
)
from kvshare.sampling_params import SamplingParams


def row(params=None, gen=None, prompt=(), out=(), eos=(), **kw):
    p = params if params is not None else SamplingParams(**kw)
    return SamplingRow(
        params=p,
        generator=gen,
        prompt_token_ids=list(prompt),
        output_token_ids=list(out),
        eos_token_ids=list(eos),
    )


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs * n
    keep = exp > 0
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum())


def draw_counts(logits_row: torch.Tensor, n: int, extra_rows=(), **kw) -> torch.Tensor:
    """Sample n times (one batch of n identical unseeded rows, plus ``extra_rows`` appended);
    return per-token counts over the n rows."""
    logits = logits_row.unsqueeze(0).repeat(n + len(extra_rows), 1)
    res = Sampler()(logits, [row(**kw) for _ in range(n)] + list(extra_rows))[:n]
    ids = torch.tensor([r.token_id for r in res])
    return torch.bincount(ids, minlength=logits_row.numel()).float()


SAMPLER = Sampler()


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_fp32_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(7, 300) * 3
    rows = [row(temperature=0.0) for _ in range(7)]
    got = [r.token_id for r in SAMPLER(logits, rows)]
    assert got == logits.argmax(-1).tolist()
    lb = logits.to(torch.bfloat16)
    got_b = [r.token_id for r in SAMPLER(lb, rows)]
    assert got_b == lb.float().argmax(-1).tolist()


def test_greedy_fast_path_computes_logprobs_only_for_rows_that_ask(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    calls = []
    real_lsm, real_sm = torch.log_softmax, torch.softmax
    monkeypatch.setattr(torch, "log_softmax", lambda x, *a, **k: calls.append(("lsm", tuple(x.shape))) or real_lsm(x, *a, **k))
    monkeypatch.setattr(torch, "softmax", lambda x, *a, **k: calls.append(("sm", tuple(x.shape))) or real_sm(x, *a, **k))

    rows = [row(temperature=0.0) for _ in range(5)]
    res = SAMPLER(logits, rows)
    assert calls == []  # pure argmax
    assert all(math.isnan(r.logprob) and r.rank == 0 and r.top_ids == [] for r in res)

    rows[3] = row(temperature=0.0, logprobs=2)
    res = SAMPLER(logits, rows)
    assert calls == [("lsm", (1, 64))]
    assert res[3].rank == 1 and len(res[3].top_ids) == 2
    assert math.isnan(res[0].logprob)


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(2)
    logits = torch.randn(6, 50) * 2
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.5) for i in range(6)]
    res = SAMPLER(logits, rows)
    for i in range(0, 6, 2):
        assert res[i].token_id == int(logits[i].argmax())


# ----------------------------------------------------------------------------- seeded sampling


def test_seeded_row_is_independent_of_batch_composition():
    torch.manual_seed(3)
    vocab = 1000
    params = dict(temperature=0.9, top_p=0.95, top_k=200, min_p=0.001)
    tokens_alone = []
    for trial in range(12):
        target = torch.randn(vocab) * 2
        seed = 1000 + trial
        alone = SAMPLER(target.unsqueeze(0), [row(gen=seeded(seed), **params)])[0].token_id
        tokens_alone.append(alone)
        pos = trial % 8
        logits = torch.randn(8, vocab) * 2
        logits[pos] = target
        rows = []
        for i in range(8):
            if i == pos:
                rows.append(row(gen=seeded(seed), **params))
            elif i % 3 == 0:
                rows.append(row(gen=seeded(7 * i + trial), temperature=1.2, top_k=5))
            elif i % 3 == 1:
                rows.append(row(temperature=0.7, top_p=0.5, repetition_penalty=1.3, out=[1, 2, 3]))
            else:
                rows.append(row(temperature=0.0, logprobs=3))
        batched = SAMPLER(logits, rows)[pos].token_id
        assert batched == alone, (trial, pos)
    assert len(set(tokens_alone)) > 1  # the check is not vacuous


def test_same_seed_same_sequence_different_seed_differs():
    torch.manual_seed(4)
    logits = torch.randn(1, 200)

    def seq(seed):
        g = seeded(seed)
        return [SAMPLER(logits, [row(gen=g, temperature=1.0)])[0].token_id for _ in range(40)]

    a, b, c = seq(11), seq(11), seq(12)
    assert a == b
    assert a != c


def test_seeded_draws_follow_softmax_and_differ_across_seeds():
    """Each row has its own seed; the empirical distribution over seeds must match softmax."""
    logits_row = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 3000
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    res = SAMPLER(logits, [row(gen=seeded(s), temperature=1.0) for s in range(n)])
    counts = torch.bincount(torch.tensor([r.token_id for r in res]), minlength=5).float()
    probs = torch.softmax(logits_row, -1)
    assert chi2(counts, probs) < 25.0  # df=4; p(chi2 > 25) ~ 5e-5
    # and a wrong distribution is rejected by the same statistic
    assert chi2(counts, torch.softmax(logits_row / 0.5, -1)) > 100.0


# ----------------------------------------------------------------------------- distributions


def test_temperature_frequencies_match_softmax():
    torch.manual_seed(5)
    logits_row = torch.tensor([0.5, 1.5, -1.0, 0.0, 1.0, -0.3])
    T = 0.7
    counts = draw_counts(logits_row, 20000, temperature=T)
    assert chi2(counts, torch.softmax(logits_row / T, -1)) < 25.0  # df=5
    assert chi2(counts, torch.softmax(logits_row, -1)) > 100.0  # T=1 would be detected


@pytest.mark.parametrize("full_sort", [False, True])
def test_top_k_top_p_frequencies_match_direct_formula(full_sort):
    torch.manual_seed(6)
    logits_row = torch.tensor([2.0, 1.8, 1.0, 0.9, 0.2, -1.0, 0.5, 1.2])
    T, k, p = 1.3, 5, 0.7
    # a row without top_k in the batch forces the full-sort code path for everyone
    extra = [row(temperature=1.0, top_p=0.9)] if full_sort else []
    counts = draw_counts(logits_row, 20000, extra, temperature=T, top_k=k, top_p=p)
    # direct: keep the top-k, renormalise, keep the smallest head with mass >= p, renormalise
    probs = torch.softmax(logits_row / T, -1)
    order = probs.argsort(descending=True).tolist()
    topk = order[:k]
    pk = probs[topk] / probs[topk].sum()
    kept, mass = [], 0.0
    for tok, q in zip(topk, pk.tolist()):
        if mass >= p:
            break
        kept.append(tok)
        mass += q
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert 1 < len(kept) < k
    assert counts[[i for i in range(8) if i not in kept]].sum() == 0
    assert chi2(counts, expected) < 25.0


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(7)
    logits = torch.randn(64, 500)
    g = logits.argmax(-1).tolist()
    r1 = SAMPLER(logits, [row(temperature=1.0, top_k=1) for _ in range(64)])
    r2 = SAMPLER(logits, [row(temperature=1.0, top_p=1e-6) for _ in range(64)])
    r3 = SAMPLER(logits, [row(gen=seeded(i), temperature=2.0, top_k=1, top_p=0.5) for i in range(64)])
    assert [r.token_id for r in r1] == g
    assert [r.token_id for r in r2] == g
    assert [r.token_id for r in r3] == g


def test_min_p_filters_low_probability_tokens():
    torch.manual_seed(8)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits_row = probs.log()
    counts = draw_counts(logits_row, 10000, temperature=1.0, min_p=0.2)  # threshold 0.1
    assert counts[3] == 0
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert chi2(counts, expected) < 20.0
    counts_off = draw_counts(logits_row, 10000, temperature=1.0)
    assert counts_off[3] > 300  # without min_p the tail token does appear


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(1, 10)
    logits[0, 9] = 10.0  # eos
    logits[0, 8] = 9.0  # stop token id
    logits[0, 4] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    assert SAMPLER(logits, [row(p, out=[1, 2], eos=[9])])[0].token_id == 4
    assert SAMPLER(logits, [row(p, out=[1, 2, 3], eos=[9])])[0].token_id == 9
    # random rows never sample masked ids, and the masked ids' raw logprobs are still reported
    n = 2000
    pr = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[8], logprobs=1)
    res = SAMPLER(logits.repeat(n, 1), [row(pr, out=[0], eos=[9]) for _ in range(n)])
    assert all(r.token_id not in (8, 9) for r in res)
    assert res[0].top_ids == [9]
    # min_tokens masks eos even with ignore_eos (vLLM)
    pi = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert SAMPLER(logits, [row(pi, out=[], eos=[9])])[0].token_id == 8


# ----------------------------------------------------------------------------- penalties


def direct_penalties(logits, prompt, out, rep, freq, pres):
    x = logits.clone()
    seen = set(prompt) | set(out)
    for t in range(x.numel()):
        v = x[t].item()
        if t in seen and rep != 1.0:
            v = v / rep if v > 0 else v * rep
        c = out.count(t)
        v -= freq * c
        v -= pres * (1.0 if c > 0 else 0.0)
        x[t] = v
    return x


def test_penalties_match_direct_formula():
    torch.manual_seed(9)
    V = 40
    logits = torch.randn(3, V) * 3
    cfgs = [
        dict(repetition_penalty=1.7, prompt=[1, 2, 3, 5, 5], out=[3, 7, 7, 7, 30]),
        dict(frequency_penalty=0.6, presence_penalty=-0.4, prompt=[0, 1], out=[1, 1, 2, 9, 9, 9]),
        dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5, prompt=[4, 39], out=[4, 6, 6, 38]),
    ]
    rows = []
    expected = []
    for i, c in enumerate(cfgs):
        c = dict(c)
        prompt, out = c.pop("prompt"), c.pop("out")
        rows.append(row(prompt=prompt, out=out, **c))
        p = rows[-1].params
        expected.append(
            direct_penalties(logits[i], prompt, out, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        )
    got = apply_penalties(logits.clone(), rows)
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)


def test_penalties_change_greedy_choice_but_not_reported_logprobs():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    base = SAMPLER(logits, [row(temperature=0.0, logprobs=1)])[0]
    assert base.token_id == 0
    # token 0 was already generated: repetition penalty 1.2 -> 2.5 < 2.9
    pen = SAMPLER(logits, [row(temperature=0.0, logprobs=1, repetition_penalty=1.2, out=[0])])[0]
    assert pen.token_id == 1
    raw_lp = torch.log_softmax(logits[0], -1)
    assert pen.logprob == pytest.approx(raw_lp[1].item(), abs=1e-6)
    assert pen.rank == 2  # raw rank, not post-penalty rank
    assert pen.top_ids == [0]
    # presence penalty only considers output tokens, not prompt tokens
    pp = SAMPLER(logits, [row(temperature=0.0, presence_penalty=2.0, prompt=[0])])[0]
    assert pp.token_id == 0


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranks_correct():
    torch.manual_seed(10)
    V = 120
    logits = torch.randn(6, V) * 2
    rows = [
        row(temperature=0.8, logprobs=5, gen=seeded(1)),
        row(temperature=0.0, logprobs=0),
        row(temperature=1.3, top_k=20, logprobs=3, repetition_penalty=1.5, out=[1, 2]),
        row(temperature=0.5, top_p=0.8, logprobs=None),
        row(temperature=2.0, logprobs=10),
        row(temperature=1.0, min_p=0.05, logprobs=1, presence_penalty=1.0, out=[5]),
    ]
    res = SAMPLER(logits, rows)
    lsm = torch.log_softmax(logits, -1)
    for i, (r, s) in enumerate(zip(rows, res)):
        k = r.params.logprobs
        if k is None:
            assert math.isnan(s.logprob) and s.rank == 0 and s.top_ids == []
            continue
        assert s.logprob == pytest.approx(lsm[i, s.token_id].item(), abs=1e-5)
        assert s.rank == int((lsm[i] > lsm[i, s.token_id]).sum()) + 1
        order = lsm[i].argsort(descending=True).tolist()
        assert s.top_ids == order[:k]
        assert s.top_logprobs == pytest.approx(lsm[i, order[:k]].tolist(), abs=1e-5)
        assert len(s.top_ids) == k


def test_logprobs_of_matches_per_row_and_handles_chunks():
    torch.manual_seed(11)
    n, V = 600, 77  # more rows than one internal chunk
    logits = (torch.randn(n, V) * 2).to(torch.bfloat16)
    ids = torch.randint(0, V, (n,))
    got = logprobs_of(logits, ids, 4)
    got_list = logprobs_of(logits, ids.tolist(), 0)
    assert len(got) == len(got_list) == n
    for i in range(0, n, 7):
        lp = torch.log_softmax(logits[i].float(), -1)
        t = int(ids[i])
        assert isinstance(got[i], SampleResult)
        assert got[i].token_id == t
        assert got[i].logprob == pytest.approx(lp[t].item(), abs=1e-5)
        assert got[i].rank == int((lp > lp[t]).sum()) + 1
        top = lp.topk(4)
        assert got[i].top_ids == top.indices.tolist()
        assert got[i].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
        assert got_list[i].top_ids == [] and got_list[i].rank == got[i].rank


def test_bad_shapes_rejected():
    with pytest.raises(ValueError):
        SAMPLER(torch.zeros(2, 5), [row()])
    with pytest.raises(ValueError):
        logprobs_of(torch.zeros(3, 5), [1, 2], 1)
