"""`kvshare doctor` over a Target (kvshare.doctor_target), model-free: a fake target whose one
request is changed by another when sharing is on. The doctor blames sharing, shrinks to the
pair, and writes the repro where the user says or else to a temporary file it names: never into
the current directory."""
from __future__ import annotations

import json
import os
import tempfile

import pytest

import kvshare.doctor_target
from kvshare.cli import main
from kvshare.doctor import Doctor, format_report, parse_request
from kvshare.doctor_target import Choice, Finished


class LeakyTarget:
    """Each request finishes `ticks` ticks after submission with tokens made from its prompt;
    with sharing on, "victim" finishing while "culprit" was submitted in the same run gets
    different logprobs (what a wrongly shared block would do)."""

    def __init__(self, leaky: bool = True, ticks: int = 2) -> None:
        self.leaky, self.ticks = leaky, ticks
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
                done.append(Finished(rid, [Choice(0, toks, [-1.0 - shift] * len(toks))]))
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
