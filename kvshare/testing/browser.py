"""The headless browser the dashboard's tests and its cost benchmark drive through Playwright:
Debian's chromium (`make browser` installs it; Playwright downloads no browser of its own here)."""
from __future__ import annotations

import os
import shutil

CHROMIUM = "/usr/bin/chromium"
# Headless without a sandbox (tests may run as root in a container), and nothing that reaches
# out to the network on its own: the page must be the only thing the browser talks to.
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_missing() -> str | None:
    """Why the browser cannot run (None: it can)."""
    if os.access(CHROMIUM, os.X_OK):
        return None
    return f"{CHROMIUM} is missing: `make browser` (part of `make setup`) installs Debian's chromium"


def can_install_chromium() -> bool:
    """Whether this machine could have installed it (Debian: apt-get), so its absence is a broken
    setup rather than a machine the browser tests do not run on."""
    return shutil.which("apt-get") is not None
