"""The testing environment variable: what plants bugs on purpose (kvshare.testing.faults, the hidden
`--inject-fault` of `kvshare serve` and `kvshare doctor`) runs only where it is set, so a
production command line cannot reach it by a flag alone. The test suite sets it (tests/conftest.py)."""
from __future__ import annotations

import os
from collections.abc import Mapping

TESTING_ENV = "KVSHARE_TESTING"


def testing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(TESTING_ENV) == "1"


def require_testing(what: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError naming the variable unless it is set to 1."""
    if not testing_enabled(environ):
        raise ValueError(f"{what} is a test-only option: it is refused unless {TESTING_ENV}=1 is set in the "
                         "environment (it plants a KV cache bug on purpose)")
