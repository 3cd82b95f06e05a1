"""Planted faults run only in a testing environment (KVSHARE_TESTING=1, which tests/conftest.py sets
for the suite): without it `kvshare serve --inject-fault`, `kvshare doctor --inject-fault` and
kvshare.testing.faults.plant are refused, naming the variable, before any model loads."""
from __future__ import annotations

import argparse
import types

import pytest

from kvshare.cli import main
from kvshare.testing.environment import TESTING_ENV, require_testing, testing_enabled
from kvshare.testing.faults import plant


def test_only_the_value_1_enables_testing():
    assert testing_enabled({TESTING_ENV: "1"})
    for environ in ({}, {TESTING_ENV: "0"}, {TESTING_ENV: ""}, {TESTING_ENV: "true"}):
        assert not testing_enabled(environ)
        with pytest.raises(ValueError, match=f"{TESTING_ENV}=1"):
            require_testing("x", environ)
    require_testing("x", {TESTING_ENV: "1"})


@pytest.mark.parametrize("argv", [["serve", "--audit", "--inject-fault", "share_without_incref"],
                                  ["serve", "--inject-fault", "share_without_incref"],
                                  ["doctor", "--inject-fault", "share_without_incref"]])
def test_inject_fault_is_refused_without_the_testing_variable(argv, monkeypatch, capsys):
    monkeypatch.delenv(TESTING_ENV)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--inject-fault share_without_incref" in err and f"{TESTING_ENV}=1" in err


def test_inject_fault_passes_the_gate_with_the_testing_variable(capsys):
    from kvshare.server.cli import check_inject_fault

    # Known fault and --audit: accepted (the model is never loaded here).
    check_inject_fault(argparse.Namespace(inject_fault="share_without_incref", audit=True))
    assert main(["serve", "--inject-fault", "x"]) == 2
    assert TESTING_ENV not in capsys.readouterr().err  # past the gate: the missing --audit is what it says


def test_plant_is_refused_without_the_testing_variable(monkeypatch):
    engine = types.SimpleNamespace()
    monkeypatch.delenv(TESTING_ENV)
    with pytest.raises(ValueError, match=TESTING_ENV):
        plant(engine, "share_without_incref")
    assert not hasattr(engine, "fault_fired")  # refused before touching the engine
