"""Beam search's rules on plain numbers (engine/beam_search.py's BeamState), with no engine: a toy
"model" gives each prefix fixed next-token logprobs. Beams wide enough to keep everything must
find exactly what exhaustive search finds (scores, lengths counting the EOS, finish reasons);
width 1 is greedy; early stopping, ignore_eos and the length penalty behave as transformers'
rules say; bad parameters name themselves."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kvshare.engine.beam_search import BeamSearchParams, BeamState

EOS = 0


def toy_logprobs(prefix: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    """Fixed, distinct next-token logprobs for a prefix."""
    rng = random.Random(hash((seed, prefix)))
    logits = torch.tensor([rng.uniform(-3.0, 3.0) for _ in range(vocab)], dtype=torch.float64)
    return torch.log_softmax(logits, dim=0)


def run_beams(params: BeamSearchParams, vocab: int, seed: int, eos=(EOS,)) -> BeamState:
    state = BeamState(params, list(eos))
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(params.max_tokens):
        logprobs = torch.stack([toy_logprobs(tuple(g), vocab, seed) for g, _ in beams])
        nxt = state.update([s for _, s in beams], logprobs, [g for g, _ in beams])
        if state.done:
            break
        beams = [(beams[c.parent][0] + [c.token_id], c.score) for c in nxt]
    assert state.done
    return state


def exhaustive(params: BeamSearchParams, vocab: int, seed: int, eos=(EOS,)) -> list[tuple[float, list[int], str]]:
    """Every complete sequence: ended by an EOS, or at max_tokens; scored as the finished set is."""
    found = []

    def walk(prefix: list[int], total: float) -> None:
        lps = toy_logprobs(tuple(prefix), vocab, seed)
        for tok in range(vocab):
            seq, score = prefix + [tok], total + float(lps[tok])
            if tok in eos and not params.ignore_eos:
                found.append((score / len(seq) ** params.length_penalty, seq, "stop"))
            elif len(seq) >= params.max_tokens:
                found.append((score / len(seq) ** params.length_penalty, seq, "length"))
            else:
                walk(seq, score)

    walk([], 0.0)
    return sorted(found, key=lambda f: f[0], reverse=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beams_wide_enough_find_what_exhaustive_search_finds(seed, length_penalty):
    vocab, max_tokens = 3, 3
    everything = exhaustive(BeamSearchParams(1, max_tokens, length_penalty=length_penalty), vocab, seed)
    width = len(everything)  # every sequence fits in the beams
    params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty, early_stopping="never")
    state = run_beams(params, vocab, seed)
    got = [(h.score, h.token_ids, h.finish_reason) for h in state.finished]
    assert [g[1:] for g in got] == [e[1:] for e in everything]
    assert [g[0] for g in got] == pytest.approx([e[0] for e in everything], abs=1e-5)
    for h in state.finished:  # the raw sum of logprobs, before the penalty
        assert h.score == pytest.approx(h.cum_logprob / len(h.token_ids) ** length_penalty, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_width_one_without_eos_is_greedy(seed):
    vocab, max_tokens = 5, 6
    state = run_beams(BeamSearchParams(1, max_tokens, ignore_eos=True), vocab, seed)
    (h,) = state.finished
    prefix, total = [], 0.0
    for _ in range(max_tokens):
        lps = toy_logprobs(tuple(prefix), vocab, seed)
        tok = int(torch.argmax(lps))
        prefix.append(tok)
        total += float(lps[tok])
    assert h.token_ids == prefix and h.finish_reason == "length"
    assert h.cum_logprob == pytest.approx(total, abs=1e-5)


def test_ignore_eos_runs_every_hypothesis_to_max_tokens():
    state = run_beams(BeamSearchParams(3, 4, ignore_eos=True), 4, seed=1)
    assert all(len(h.token_ids) == 4 and h.finish_reason == "length" for h in state.finished)
    assert len(state.finished) == 3


def test_the_finished_set_is_the_best_width_sorted_best_first():
    for seed in range(6):
        state = run_beams(BeamSearchParams(2, 5), 4, seed)
        scores = [h.score for h in state.finished]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
        for h in state.finished:
            assert h.token_ids[-1] == EOS if h.finish_reason == "stop" else len(h.token_ids) == 5
            assert EOS not in h.token_ids[:-1]  # nothing continues past an EOS


def test_early_stopping_true_stops_once_width_hypotheses_are_finished():
    # A model that says EOS is likely at once: two finished hypotheses after the first step.
    class EosFirst:
        def __call__(self, prefix):
            lp = torch.full((4,), -5.0, dtype=torch.float64)
            lp[EOS] = -0.01
            lp[1] = -0.02
            return lp

    model = EosFirst()
    params = BeamSearchParams(1, 10, early_stopping=True)
    state = BeamState(params, [EOS])
    out = state.update([0.0], model(()).unsqueeze(0), [[]])
    assert state.done and out == []
    assert [h.token_ids for h in state.finished] == [[EOS]] and state.step == 1


@pytest.mark.parametrize("seed", range(8))
def test_stopping_later_never_finishes_worse(seed):
    # The three rules run the same steps until the stricter one stops; the finished set only ever
    # takes better hypotheses, so a rule that stops later ends at least as well.
    runs = {rule: run_beams(BeamSearchParams(2, 6, early_stopping=rule, length_penalty=1.0), 4, seed)
            for rule in (True, False, "never")}
    steps = [runs[r].step for r in (True, False, "never")]
    assert steps == sorted(steps)
    for earlier, later in ((True, False), (False, "never")):
        a, b = runs[earlier].finished, runs[later].finished
        assert len(b) >= len(a)
        assert all(y.score >= x.score - 1e-9 for x, y in zip(a, b))  # i-th best against i-th best
    assert len(runs[True].finished) == 2


def test_a_step_where_every_candidate_stops_ends_the_search():
    params = BeamSearchParams(2, 1)
    state = BeamState(params, [EOS])
    out = state.update([0.0], torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), 1), [[]])
    assert state.done and out == []
    assert [h.finish_reason for h in state.finished] == ["length", "length"]
    assert [h.token_ids for h in state.finished] == [[2], [1]]


def test_only_the_top_width_candidates_may_enter_the_finished_set():
    # EOS is the third best candidate: with width 2 it may not finish this step.
    params = BeamSearchParams(2, 5)
    state = BeamState(params, [EOS])
    lps = torch.tensor([[-2.0, -0.1, -0.2, -5.0]], dtype=torch.float64)
    nxt = state.update([0.0], lps, [[]])
    assert state.finished == []
    assert [c.token_id for c in nxt] == [1, 2]


def test_scores_accumulate_from_each_parent():
    params = BeamSearchParams(2, 5, ignore_eos=True)
    state = BeamState(params, [EOS])
    lps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]], dtype=torch.float64)
    nxt = state.update([-1.0, -10.0], lps, [[0], [1]])
    assert [(c.parent, c.token_id) for c in nxt] == [(0, 0), (0, 1)]
    assert [c.score for c in nxt] == [pytest.approx(-2.0), pytest.approx(-3.0)]


@pytest.mark.parametrize("kwargs,field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
])
def test_bad_beam_parameters_name_themselves(kwargs, field):
    with pytest.raises(ValueError) as err:
        BeamSearchParams(**kwargs)
    assert str(err.value).startswith(f"BeamSearchParams.{field}=")


def test_the_exhaustive_reference_is_itself_complete():
    # 1 + 2 + 4 ... sequences for vocab 3, max 3: EOS ends 1 of 3 branches each step.
    found = exhaustive(BeamSearchParams(1, 3), 3, seed=0)
    assert len(found) == 1 + 2 + 4 * 3 and len({tuple(f[1]) for f in found}) == len(found)
    assert sum(math.exp(f[0]) for f in exhaustive(BeamSearchParams(1, 3, length_penalty=0.0), 3, 0)) == \
        pytest.approx(1.0)
    assert [f[2] for f in found].count("stop") == 1 + 2 + 4
