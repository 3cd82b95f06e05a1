"""Structural checks of issue 27 that anyone can run: each its own test."""
from __future__ import annotations

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvshare"


def _sources(exclude: str | None = None):
    for path in sorted(PACKAGE.rglob("*.py")):
        if exclude is None or exclude not in path.relative_to(PACKAGE).parts:
            yield path, path.read_text(encoding="utf-8")


def test_no_step_asks_whether_a_kernel_build_has_finished():
    """A kernel library is settled when the engine is built (KernelLibrary.settle); outside the
    kernels package nothing polls `available()` / `is_done()`, which change when a background
    build finishes, so no row's kernel can switch mid-run."""
    polls = re.compile(r"\b(ATTENTION|QMATMUL|DECODE|SHM|paged_attention)\.(available|is_done)\(")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path, text in _sources(exclude="kernels")
             for n, line in enumerate(text.splitlines(), 1) if polls.search(line)]
    assert found == []


def test_one_gguf_reader():
    """GGUF files are read by kvshare.model.gguf_header alone (not also by the gguf package's
    GGUFReader), so every check on a corrupt file is made once."""
    uses = re.compile(r"^\s*(from gguf(\.\w+)* )?import [^\n]*\bGGUFReader\b|\bgguf\.GGUFReader\b", re.M)
    found = [str(path.relative_to(PACKAGE)) for path, text in _sources() if uses.search(text)]
    assert found == []
