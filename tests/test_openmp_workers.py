"""The server's event-loop thread hands the CPU to the engine thread: it ends its own OpenMP
workers first (openmp.release_openmp_workers), or libgomp, seeing more workers than CPUs,
puts the engine thread's workers to sleep between parallel regions (the bundled model's decode
then took 12.6 instead of 8.6 ms/token here). Speed is a benchmark's business
(docs/benchmarks.md, "Fifth pass"); these tests check the mechanism: the workers really end, and
the server releases them before its engine thread starts."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from kvshare.engine.core import EngineStatus
from kvshare.model.kernels import openmp
from kvshare.server import async_engine
from kvshare.server.metrics import ServerMetrics


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_release_ends_the_calling_threads_openmp_workers():
    # A fresh process (this one's OpenMP state depends on the tests run before), whose
    # OMP_NUM_THREADS differs from the team size torch sets: the team made again after the
    # release must still be torch's size, not the environment's.
    code = textwrap.dedent("""
        import os, time, torch
        from kvshare.model.kernels import openmp
        torch.set_num_threads(2)  # a team of 2, so one worker thread, whatever the CPU count
        threads = lambda: len(os.listdir("/proc/self/task"))
        before = threads()
        torch.sin(torch.randn(4_000_000))  # a parallel region: this thread's team is made
        with_team = threads()
        released = openmp.release_openmp_workers()
        deadline = time.monotonic() + 10
        while threads() >= with_team and time.monotonic() < deadline:  # workers exit as they wake
            time.sleep(0.01)
        after = threads()
        torch.sin(torch.randn(4_000_000))  # a team is made again when the thread needs one
        print(before, with_team, released, after, threads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    before, with_team, released, after, again = out.stdout.split()
    assert int(with_team) > int(before), "the parallel region made no worker thread"
    assert released == "True"
    assert int(after) < int(with_team), "the workers did not end"
    assert int(again) == int(with_team), "the team made again is not torch's size"


def test_the_server_releases_its_workers_before_the_engine_thread_starts(monkeypatch):
    monkeypatch.setattr(async_engine, "IDLE_WAIT_SECONDS", 60.0)  # the stub engine never wakes to step
    calls = []
    monkeypatch.setattr(openmp, "release_openmp_workers",
                        lambda: calls.append(ae._thread) or True)
    engine = SimpleNamespace(layout=SimpleNamespace(num_blocks=8), has_unfinished_requests=lambda: False,
                             close=lambda: None, status=EngineStatus)
    ae = async_engine.AsyncEngine(engine, ServerMetrics("m"))
    ae.start(loop=None)
    try:
        assert calls == [None]  # called once, before the engine thread existed
        assert ae.is_alive()
    finally:
        ae.stop(timeout=10)
    assert not ae._thread.is_alive()
