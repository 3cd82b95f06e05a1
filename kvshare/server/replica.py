"""One data-parallel replica: a full `kvshare serve` child process on an internal loopback port,
publishing its KV cache events for the front end (kvshare.server.data_parallel).

The child runs in its own session, so a Ctrl+C in the terminal reaches only the front end, which
then drains the replicas itself (a second signal would make a replica exit at once); on Linux it
also gets SIGTERM if the front end dies without cleaning up, so no replica outlives it. Its
output is copied line by line to the front end's stderr with an "[engine N]" prefix, and the
last lines are kept to explain a replica that fails to start.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from kvshare.engine_args import HASH_SEED_ENV
from kvshare.server.tenants import ADMIN_KEY_ENV, API_KEY_ENV, REPLICA_AUTH_ENV

logger = logging.getLogger("kvshare.server")

LOG_TAIL_LINES = 40
PARENT_ENV = "KVSHARE_DIE_WITH_PARENT"  # the front end's pid, for the replica's first lines (REPLICA_BOOT)
# The replica's entry point, run with `python -c`: before anything heavy is imported (and before
# any thread exists in it), it asks the kernel for SIGTERM when its parent dies (Linux prctl
# PR_SET_PDEATHSIG = 1), then checks that its parent is still the front end that started it: one
# that died before the prctl sends no signal, so the replica exits itself. This replaces a
# preexec_fn, which is unsafe in the threaded front end (fork, then Python code before exec).
REPLICA_BOOT = f"""import os, sys
parent = os.environ.pop({PARENT_ENV!r}, "")
if parent and sys.platform == "linux":
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit("kvshare replica: the data-parallel front end (pid " + parent + ") exited before it started")
from kvshare.cli import main
sys.exit(main(sys.argv[1:]))
"""


# ---- launch planning: endpoints, ports and CPUs per replica --------------------------------------
def offset_endpoint(endpoint: str, rank: int, flag: str) -> str:
    """Replica `rank`'s endpoint from a base one, as vLLM offsets it under data parallelism:
    tcp://host:PORT -> tcp://host:PORT+rank; ipc://PATH -> ipc://PATH.rank."""
    m = re.fullmatch(r"(tcp://.+):(\d+)", endpoint)
    if m and int(m.group(2)) > 0:
        return f"{m.group(1)}:{int(m.group(2)) + rank}"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return f"{endpoint}.{rank}"
    raise ValueError(f"{flag} {endpoint!r} is invalid with --data-parallel-size: give tcp://HOST:PORT with an "
                     f"explicit port (replica r publishes on PORT + r, as in vLLM) or ipc://PATH")



def bind_loopback_socket() -> socket.socket:
    """A replica's listening socket, bound here on a free loopback port and inherited by the
    replica (ReplicaLaunch.listen_fd), so no other process can take the port in between. Not
    listening yet: connections are refused until the replica serves it."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
    except OSError:
        sock.close()
        raise
    return sock



def free_loopback_port() -> int:
    """A free loopback port, released again: another process may take it before it is bound (the
    replicas get bound sockets instead, bind_loopback_socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def connect_endpoint(bound: str) -> str:
    """Where the front end connects to reach an endpoint a replica binds (a wildcard host is loopback here)."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0)(?=:)", "tcp://127.0.0.1", bound)



def split_cpus(size: int, thread_budget: int | None) -> list[tuple[int, tuple[int, ...] | None]]:
    """(torch threads, CPU affinity) per replica: the front end's CPUs split evenly, each replica
    pinned to its share when there is at least one CPU each; `thread_budget` (OMP_NUM_THREADS
    given to the front end) caps the threads all replicas use together."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    total = min(len(cpus), thread_budget) if thread_budget else len(cpus)
    threads = max(1, total // size)
    if len(cpus) < size:
        return [(threads, None)] * size
    share = len(cpus) // size
    return [(threads, tuple(cpus[r * share:(r + 1) * share])) for r in range(size)]



@dataclass(frozen=True)
class ReplicaLaunch:
    """What one replica is started with."""

    index: int
    port: int
    argv: list[str]  # the `kvshare serve` arguments (engine and server flags), without the program
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    omp_threads: int
    cpus: tuple[int, ...] | None  # CPU affinity; None: whatever the front end has
    auth: dict | None  # ServerConfig's api_keys and admin_key, for the replica's own check; None: no keys
    listen_fd: int | None = None  # the bound socket the replica serves (inherited, same number); None: it binds port
    hash_seed: str | None = None  # the prefix-caching hash seed, passed in the environment


class ReplicaProcess:
    def __init__(self, launch: ReplicaLaunch, listen_socket=None) -> None:
        """`listen_socket`: the socket whose fd is launch.listen_fd; closed here once the replica has it."""
        self.launch = launch
        self._listen_socket = listen_socket
        self.index = launch.index
        self.url = f"http://127.0.0.1:{launch.port}"
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        threads = str(self.launch.omp_threads)
        env = dict(os.environ, OMP_NUM_THREADS=threads, KVSHARE_NUM_THREADS=threads)
        for var in (API_KEY_ENV, ADMIN_KEY_ENV, REPLICA_AUTH_ENV):
            env.pop(var, None)
        if self.launch.auth is not None:
            env[REPLICA_AUTH_ENV] = json.dumps(self.launch.auth)  # not on the command line, where `ps` shows it
        env.pop(HASH_SEED_ENV, None)
        if self.launch.hash_seed is not None:
            env[HASH_SEED_ENV] = self.launch.hash_seed  # like the keys: not where `ps` shows it
        env[PARENT_ENV] = str(os.getpid())
        cmd = [sys.executable, "-c", REPLICA_BOOT, "serve", *self.launch.argv]
        cpus = self.launch.cpus
        fds = (self.launch.listen_fd,) if self.launch.listen_fd is not None else ()
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
        finally:
            # The replica holds the only copy: once it exits, connecting is refused (the sign of a
            # dead replica) instead of queueing on a socket nobody serves.
            if self._listen_socket is not None:
                self._listen_socket.close()
                self._listen_socket = None
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            # From here, right after exec: the child is still importing, single-threaded, so the
            # threads torch starts later inherit this affinity.
            try:
                os.sched_setaffinity(self.proc.pid, cpus)
            except OSError as e:  # e.g. a CPU taken away meanwhile: it runs unpinned, still correct
                logger.warning("engine %d: could not pin it to CPUs %s (%s)", self.index, cpus, e)
        self._pump = threading.Thread(target=self._copy_output, name=f"engine-{self.index}-log", daemon=True)
        self._pump.start()
        logger.info("engine %d: pid %d on %s, KV events %s, %d thread(s)%s", self.index, self.proc.pid, self.url,
                    self.launch.kv_events_endpoint, self.launch.omp_threads,
                    f", CPUs {','.join(map(str, cpus))}" if cpus is not None else "")

    def _copy_output(self) -> None:
        prefix = f"[engine {self.index}] "
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.log_tail.append(line)
            try:
                sys.stderr.write(prefix + line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed at exit: keep draining the pipe
                pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while it runs; else its exit status (negative: the signal that ended it)."""
        return self.proc.poll() if self.proc is not None else None

    def describe_exit(self) -> str:
        code = self.exit_code()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill_and_wait(self, timeout: float = 10.0) -> None:
        if self._listen_socket is not None:  # never started
            self._listen_socket.close()
            self._listen_socket = None
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.error("engine %d (pid %d) did not exit after SIGKILL", self.index, self.proc.pid)
        if self._pump is not None:
            self._pump.join(timeout=2)
