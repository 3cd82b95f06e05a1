"""`kvshare bench serve`'s arithmetic: percentiles, the knee, workloads (no server needed)."""
from __future__ import annotations

from kvshare.bench.report import RequestResult, find_knee, percentile, summarize
from kvshare.bench.serve import make_workload


def _level(level, tok_s):
    return {"level": level, "total_tok_s": tok_s}


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert abs(percentile(list(range(1, 101)), 99) - 99.01) < 1e-9


def test_knee_is_the_first_level_near_the_best_throughput():
    rising = [_level(1, 100), _level(2, 190), _level(4, 350)]
    assert find_knee(rising) == {"level": 4, "why": "still rising at the last level"}
    flat = [_level(1, 100), _level(2, 180), _level(4, 300), _level(8, 310), _level(16, 305)]
    assert find_knee(flat)["level"] == 4
    noisy_dip = [_level(1, 100), _level(2, 150), _level(4, 140), _level(8, 260), _level(16, 270)]
    assert find_knee(noisy_dip)["level"] == 8  # an early dip is not the knee


def test_summary_counts_tokens_and_latencies():
    ok = RequestResult(ok=True, start=0.0, end=2.0, first_token=0.5, prompt_tokens=10, output_tokens=4)
    bad = RequestResult(ok=False, start=0.0, end=0.1, error="HTTP 500")
    s = summarize(4, "concurrency", [ok, bad], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, ["HTTP 500"])
    assert s["total_tok_s"] == 7.0 and s["output_tok_s"] == 2.0
    assert s["ttft_p50_s"] == 0.5 and s["tpot_p50_s"] == 0.5 and s["e2e_p50_s"] == 2.0


def test_workloads_share_exactly_what_they_should():
    a = make_workload("shared", 3, 16, "t1")
    b = make_workload("shared", 3, 16, "t1")
    assert [r.prompt for r in a] == [r.prompt for r in b]  # same tag, same prompts (fair A/B)
    preamble = a[0].prompt.split("\n\nQuestion")[0]
    assert all(r.prompt.startswith(preamble + "\n\nQuestion") for r in a) and len(set(r.prompt for r in a)) == 3
    mixed = make_workload("mixed", 20, 32, "t2")
    firsts = {r.prompt.split()[0] for r in mixed}
    assert len(firsts) == 20  # every prompt opens with its own tag: nothing cached across requests
    assert all(16 <= r.max_tokens <= 32 for r in mixed)
    assert make_workload("mixed", 5, 32, "t3")[0].prompt != mixed[0].prompt
    # --prompt-tokens / --output-tokens: the ranges hold, and they really move the draws.
    ranged = make_workload("mixed", 40, 32, "t2", prompt_tokens=(64, 80), output_tokens=(100, 128))
    assert all(100 <= r.max_tokens <= 128 for r in ranged)
    assert all(60 <= r.est_prompt_tokens <= 90 for r in ranged)
    assert max(r.est_prompt_tokens for r in mixed) > 200
