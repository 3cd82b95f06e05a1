"""`kvshare doctor` over a Target (kvshare.doctor_target), model-free: a fake target whose one
request is changed by another when sharing is on. The doctor blames sharing, shrinks to the
pair, and writes the repro where the user says or else to a temporary file it names: never into
the current directory. A target that reports itself bit-transparent is compared exactly: one ulp
diverges; one with transparency gaps, or that does not say, within the tolerance, named in the report."""
from __future__ import annotations

import json
import math
import os
import tempfile

import pytest

import kvshare.doctor_target
from kvshare.cli import main
from kvshare.doctor import DEFAULT_TOL, Doctor, compare, format_report, parse_request, RunResult
from kvshare.doctor_target import Choice, Finished


class LeakyTarget:
    """Each request finishes `ticks` ticks after submission with tokens made from its prompt;
    with sharing on, "victim" finishing while "culprit" was submitted in the same run gets
    different logprobs (what a wrongly shared block would do)."""

    def __init__(self, leaky: bool = True, ticks: int = 2, ulp: bool = False) -> None:
        self.leaky, self.ticks, self.ulp = leaky, ticks, ulp  # ulp: the leak is one ulp, not 0.5
        self.runs: list[tuple[bool, bool]] = []
        self.sharing = False

    def reset(self, sharing: bool, audit: bool) -> None:
        self.runs.append((sharing, audit))
        self.sharing, self.live, self.seen = sharing, {}, set()

    def tokenize(self, text: str) -> list[int] | None:
        return None

    def submit(self, request_id, prompt, params) -> None:
        self.live[request_id] = [list(prompt), params, self.ticks]
        self.seen.add(request_id)

    def abort(self, request_id: str) -> None:
        del self.live[request_id]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.live

    def busy(self) -> bool:
        return bool(self.live)

    def advance(self) -> list[Finished]:
        done = []
        for rid, entry in list(self.live.items()):
            entry[2] -= 1
            if entry[2] == 0:
                prompt, params, _ = self.live.pop(rid)
                toks = [(sum(prompt) + i) % 97 for i in range(params.max_tokens)]
                shift = 0.5 if self.leaky and self.sharing and rid == "victim" and "culprit" in self.seen else 0.0
                lp = math.nextafter(-1.0, -2.0) if shift and self.ulp else -1.0 - shift
                done.append(Finished(rid, [Choice(0, toks, [lp] * len(toks))]))
        return done


ROWS = [{"id": "bystander", "prompt_token_ids": [9, 9, 9], "max_tokens": 3},
        {"id": "culprit", "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "delay_steps": 1},
        {"id": "victim", "prompt_token_ids": [1, 2, 4], "max_tokens": 4, "delay_steps": 2}]


def requests():
    return [parse_request(dict(r), r["id"]) for r in ROWS]


def test_the_doctor_drives_a_target_blames_sharing_and_writes_a_temporary_repro(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = LeakyTarget()
    report = Doctor(target).diagnose(requests())
    assert report["conclusion"] == "sharing logic" and report["blamed_setting"] == "configured"
    assert list(report["settings"]["configured"]["diverged"]) == ["victim"]
    assert (False, False) in target.runs and (True, True) in target.runs  # reference; audited as configured
    path = report["repro"]["path"]
    try:
        assert report["repro"]["requests"] == ["culprit", "victim"]
        assert os.path.dirname(os.path.abspath(path)) == os.path.abspath(tempfile.gettempdir())
        assert [json.loads(line)["id"] for line in open(path, encoding="utf-8")] == ["culprit", "victim"]
        assert f"written to {path}" in format_report(report)
    finally:
        os.unlink(path)
    assert os.listdir(tmp_path) == []  # the current directory stays clean


def test_a_clean_target_gets_no_repro_and_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    report = Doctor(LeakyTarget(leaky=False)).diagnose(requests())
    assert report["conclusion"] == "no contamination found" and report["repro"] is None
    assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tmp_path) == ["tmp"]


@pytest.mark.parametrize("named", [False, True])
def test_the_cli_writes_the_repro_where_named_or_to_a_printed_temporary_file(tmp_path, monkeypatch, capsys, named):
    workdir, tmpdir = tmp_path / "checkout", tmp_path / "tmp"
    workdir.mkdir()
    tmpdir.mkdir()
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    monkeypatch.setattr(kvshare.doctor_target, "InProcessTarget", lambda config, faults: LeakyTarget())
    extra = ["--repro-out", str(tmp_path / "mine.jsonl")] if named else []
    assert main(["doctor", "--workload", str(workload), *extra]) == 1
    out = capsys.readouterr().out
    written = [tmp_path / "mine.jsonl"] if named else [tmpdir / f for f in os.listdir(tmpdir)]
    assert len(written) == 1 and f"written to {written[0]}" in out
    assert [json.loads(line)["id"] for line in written[0].read_text().splitlines()] == ["culprit", "victim"]
    assert os.listdir(workdir) == [] and os.listdir(tmpdir) == ([] if named else [written[0].name])


class ReportingTarget(LeakyTarget):
    """A LeakyTarget that says how transparent it is; its leak is one ulp of a logprob."""

    def __init__(self, gaps: tuple[str, ...], **kw) -> None:
        super().__init__(ulp=True, **kw)
        self.gaps = gaps

    def transparency(self) -> tuple[str, ...]:
        return self.gaps


def test_a_bit_transparent_target_is_compared_exactly_and_one_ulp_diverges():
    report = Doctor(ReportingTarget(())).diagnose(requests())
    assert report["comparison"] == {"tolerance": 0.0, "exact": True, "why": "the engine is bit-transparent",
                                    "transparency_gaps": []}
    assert report["conclusion"] == "sharing logic" and list(report["settings"]["configured"]["diverged"]) == ["victim"]
    why = report["settings"]["configured"]["diverged"]["victim"]
    assert "exact equality required: the engine is bit-transparent" in why, why
    assert "compared by exact equality: the engine is bit-transparent" in format_report(report)
    os.unlink(report["repro"]["path"])
    assert Doctor(ReportingTarget((), leaky=False)).diagnose(requests())["conclusion"] == "no contamination found"


@pytest.mark.parametrize("gaps", [("exact mode: prompt rows on dense GEMMs", "dense weights"), None])
def test_a_target_with_gaps_or_silent_is_compared_within_the_tolerance(gaps):
    # None: a target without transparency(), so the doctor cannot know.
    target = ReportingTarget(gaps) if gaps is not None else LeakyTarget(ulp=True)
    report = Doctor(target).diagnose(requests())
    c = report["comparison"]
    assert c["tolerance"] == DEFAULT_TOL and not c["exact"] and c["transparency_gaps"] == (list(gaps) if gaps else None)
    assert report["conclusion"] == "no contamination found"  # one ulp hides under any tolerance
    if gaps:
        assert "; ".join(gaps) in c["why"] and "; ".join(gaps) in format_report(report)
    # The user's tolerance wins either way: 0 catches the ulp.
    strict = Doctor(ReportingTarget(gaps or ()), tol=0).diagnose(requests())
    assert strict["comparison"]["why"] == "exact equality set by the user" and strict["conclusion"] == "sharing logic"
    os.unlink(strict["repro"]["path"])


def test_compare_with_tolerance_0_flags_one_ulp():
    ref = RunResult({("r", 0): ([1, 2], [-0.5, -1.0])})
    run = RunResult({("r", 0): ([1, 2], [-0.5, math.nextafter(-1.0, 0.0)])})
    assert compare(run, ref, 2e-3) == {}
    assert "exact equality required" in compare(run, ref, 0.0)["r"]
