"""A free loopback port, for the server tests and the serving benchmark's servers."""
from __future__ import annotations

import socket


def free_port() -> int:
    # Racy by nature (another process may take it before the server binds); fine on loopback here.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
