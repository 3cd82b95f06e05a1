"""Structural checks of issue 27 that anyone can run: each is a test, each reads the source."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvshare"

ENGINE_INTERNALS = {"manager", "scheduler", "pool", "kv_cache"}


def _callers_of_the_engine() -> list[Path]:
    """The server, Ray and the doctor: they use the engine's API, never its parts."""
    files = sorted((PACKAGE / "server").rglob("*.py")) + sorted((PACKAGE / "ray").rglob("*.py"))
    return files + sorted(PACKAGE.glob("doctor*.py"))


def test_server_ray_and_doctor_read_no_engine_internals():
    found = []
    for path in _callers_of_the_engine():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
    assert len(_callers_of_the_engine()) > 10
    assert not found, "read through the engine API instead:\n" + "\n".join(found)


def test_engine_and_model_runner_modules_are_at_most_300_lines():
    for name in ("llm_engine.py", "model_runner.py"):
        lines = len((PACKAGE / "engine" / name).read_text(encoding="utf-8").splitlines())
        assert lines <= 300, f"kvshare/engine/{name} has {lines} lines"
