"""Tensor parallelism across processes (EngineConfig.tensor_parallel_size > 1).

Rank 0 is the engine's own process: its scheduler and KV manager decide every step, and before
running a step it broadcasts the step plan (sequences stripped: the runner reads only block ids,
slots, positions and tokens) to the other ranks. Each rank runs that plan through its shard of
the model over its shard of the KV cache (its KV heads, at the same block ids), and the shards
meet only in the model's collectives (kvshare.model.tensor_parallel). So the block tables are
identical on every rank by construction: there is one table, and it travels in the plan.

Start-up goes through a torch.distributed FileStore, a file in a fresh directory only the server's
user can open (mkdtemp: mode 0700), removed once every rank has connected: no TCP listener, unlike
torch's TCPStore, which listens on every interface whatever host it is given. Rank 0 puts the
config in it (as JSON) and starts the workers (`python -m kvshare.engine.tp_worker`), which load the
model while rank 0 does; rank 0 then puts the KV pool size it planned and the shared memory
segment it made, each worker says whether it could map that segment, and all ranks take the
same transport (kvshare.model.tp_transport): shared memory when every rank can, else a gloo
process group on loopback (EngineConfig.tensor_parallel_backend="gloo" asks for gloo). Every
value in the store is signed with a random per-launch token (SignedStore) that the workers get
in their environment, and a worker checks what it is told (the segment's path and sizes, the
pool size) against what it computes itself before it maps or allocates anything.
kvshare's tensors are CPU tensors, so NCCL, which needs CUDA ones, has no use here yet. The gloo
group is built directly, not through init_process_group: no process-wide default group exists,
and several engines can live in one process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kvshare.config import EngineConfig
from kvshare.engine.step_plan import StepPlan
from kvshare.engine.wire import codec
from kvshare.model.kernels import shm
from kvshare.model.tensor_parallel import TPCollectives, TPShard
from kvshare.model.tp_transport import SEGMENT_PREFIX, GlooTransport, ShmSegment, ShmTransport, segment_dir

logger = logging.getLogger("kvshare")

# Start-up waits (a worker's model load) give up after this long.
STARTUP_TIMEOUT = timedelta(minutes=5)
# A gloo collective's wait: a worker sits in the plan broadcast for as long as the engine is idle.
# A rank that dies ends the others' waits at once (its sockets close); this is only the backstop.
COLLECTIVE_TIMEOUT = timedelta(days=365)
# The per-launch token reaches the workers in this environment variable: a process's environment
# is readable only by its user, its command line by everyone (/proc/<pid>/cmdline).
TOKEN_ENV = "KVSHARE_TP_TOKEN"


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's share of the engine's threads (config.num_threads, else torch's default)."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


def gloo_group(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    # The device on loopback: by default gloo binds (and keeps a listener on, for the group's
    # life) the address the host name resolves to, which other machines may reach.
    # torch's stub names it Options (a Backend.Options without _devices); the binding is _Options.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    # The Gloo backend serves as the group: it has ProcessGroup's collectives (allreduce, gather,
    # broadcast), which torch's stub leaves off its Backend base class.
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, opts)  # type: ignore[return-value]


def open_store(path: str, size: int) -> dist.FileStore:
    store = dist.FileStore(path, size)
    store.set_timeout(STARTUP_TIMEOUT)
    return store


class SignedStore:
    """The start-up store, every value signed with the launch's token (HMAC-SHA256 over the key
    and the value): a rank trusts only what a holder of the token wrote under that key, and
    refuses the rest with an error rather than act on it. (The gloo group reads and writes the
    store itself, unsigned: only addresses it connects to on loopback.)"""

    def __init__(self, store: dist.Store, token: str) -> None:
        self.store = store
        self._key = token.encode()

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: str) -> None:
        data = value.encode()
        # The binding takes bytes (pybind's std::string caster); torch's stub says str.
        self.store.set(key, self._mac(key, data) + data)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        """Waits for `key` (up to the store's timeout), then returns its value if signed."""
        data = self.store.get(key)
        mac, value = data[:32], data[32:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise RuntimeError(f"tensor parallel: the start-up store's {key!r} is not signed with this launch's "
                               "token: refusing it")
        return value

    def check(self, key: str) -> bool:
        return self.store.check([key])


def config_to_json(config: EngineConfig) -> str:
    # JSON, not pickle: nothing a rank reads at start-up may be able to run code, whoever wrote it.
    return json.dumps(dataclasses.asdict(config), default=str)  # (a pathlib.Path model: its string)


def config_from_json(data: bytes) -> EngineConfig:
    return EngineConfig(**json.loads(data))


class PlanChannel:
    """Step plans from rank 0 to every rank (msgpack: plain numbers, strings and lists, never
    code); an empty message tells the workers to stop."""

    def __init__(self, transport) -> None:
        self.transport = transport

    def send(self, plan: StepPlan | None) -> None:
        self.transport.broadcast0(b"" if plan is None else msgpack.packb(_encode(plan)))

    def recv(self) -> StepPlan | None:
        data = self.transport.broadcast0(None)
        return _decode(msgpack.unpackb(data)) if data else None


# A plan's wire form: derived from StepPlan's fields (kvshare/engine/wire.py), so a field added
# to the plan reaches the workers with no edit here.
_encode, _decode = codec(StepPlan)


class TensorParallelLauncher:
    """Rank 0's side of start-up: the store, the worker processes, and agreeing on a transport."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self.store_dir = tempfile.mkdtemp(prefix=f"kvshare-tp-store-{os.getpid()}-")  # mode 0700: this user's alone
        # An engine dropped without close() (the offline LLM never closes) still ends its workers
        # and removes the store, as does a start-up that fails between two of them.
        self._finalizer = weakref.finalize(self, _clean_up, self.procs, self.store_dir)
        token = secrets.token_hex(32)
        store_path = os.path.join(self.store_dir, "store")
        self.store = SignedStore(open_store(store_path, self.size), token)
        self.store.set("config", config_to_json(config))
        threads = str(threads_per_rank(config))
        env = dict(os.environ, **{TOKEN_ENV: token})
        for r in range(1, self.size):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "kvshare.engine.tp_worker", "--rank", str(r),
                                                "--size", str(self.size), "--store", store_path,
                                                "--threads", threads, "--parent", str(os.getpid())], env=env))
        self.transport_name = ""

    def connect(self, shard: TPShard, num_blocks: int) -> TPCollectives:
        """Tell the workers the KV pool size and the segment, wait until each has loaded its
        shard's weights, and agree on the transport."""
        segment = self._segment(shard)
        self.store.set("shm", json.dumps({"path": segment.path, "slot_bytes": segment.slot_bytes}) if segment else "")
        self.store.set("num_blocks", str(num_blocks))
        try:
            self._wait_for("ready")
        finally:
            if segment is not None:
                os.unlink(segment.path)  # every rank has mapped it (or given up): no file is left behind
        use_shm = segment is not None and all(self.store.get(f"shm/{r}") == b"1" for r in range(1, self.size))
        self.transport_name = "shared memory" if use_shm else "gloo"
        self.store.set("transport", "shm" if use_shm else "gloo")
        transport: ShmTransport | GlooTransport
        if use_shm:
            assert segment is not None  # use_shm is decided on it
            transport = ShmTransport(segment, 0, self._check_worker)
        else:
            transport = GlooTransport(gloo_group(self.store.store, 0, self.size), 0, self.size)
        self._wait_for("connected")
        shutil.rmtree(self.store_dir)  # every rank is done with the store: nothing of it outlives start-up
        return TPCollectives(transport, shard)

    def _segment(self, shard: TPShard) -> ShmSegment | None:
        if self.config.tensor_parallel_backend == "gloo":
            return None
        if shm.SHM.settle() is not None:
            logger.warning("tensor parallel: kvshare's shared memory collectives are not available (%s): the ranks "
                           "use gloo, several times slower per step (`make setup` builds them)",
                           shm.SHM.unavailable_reason())
            return None
        base = segment_dir()
        path = os.path.join(base, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        slot = ShmSegment.slot_bytes_for(self.config.max_num_batched_tokens, shard.config.hidden_size)
        try:
            return ShmSegment(path, self.size, slot, create=True)
        except OSError as e:  # e.g. a full /dev/shm: found now, not as a SIGBUS mid-step
            logger.warning("tensor parallel: no shared memory segment in %s (%s): the ranks use gloo", base, e)
            return None

    def _wait_for(self, key: str) -> None:
        """Until every worker has signed `{key}/{rank}` (or one exits, or start-up times out)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        for r, proc in enumerate(self.procs, start=1):
            while not self.store.check(f"{key}/{r}"):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor parallel: worker rank {r} exited with code {proc.returncode} during "
                                       "start-up (its error is in the log above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor parallel: worker rank {r} did not start within "
                                       f"{STARTUP_TIMEOUT.total_seconds():.0f} s")
                time.sleep(0.02)
            self.store.get(f"{key}/{r}")  # signed by the worker, or refused

    def _check_worker(self, rank: int) -> None:
        """Called while a shared memory wait for `rank` drags on: raises if that worker is gone."""
        proc = self.procs[rank - 1] if rank > 0 else None
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worker rank {rank} exited with code {proc.returncode}")

    def close(self, channel: PlanChannel | None) -> None:
        """Stop the workers: asked to (a stop message), else terminated."""
        if channel is not None and all(p.poll() is None for p in self.procs):
            try:
                channel.send(None)
            except RuntimeError:
                pass  # a worker is gone: the others are killed below
        else:
            _terminate(self.procs)  # start-up failed, or a worker is gone: nothing to wait for
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._finalizer()  # the store, if start-up ended before removing it


def _clean_up(procs: list[subprocess.Popen], store_dir: str) -> None:
    _terminate(procs)
    shutil.rmtree(store_dir, ignore_errors=True)


def _terminate(procs: list[subprocess.Popen]) -> None:
    # SIGKILL: workers ignore SIGINT and SIGTERM (rank 0 alone decides when they stop), and hold
    # nothing that needs cleaning up.
    for p in procs:
        if p.poll() is None:
            p.kill()


class TensorParallelRunner:
    """Rank 0's runner: sends each plan to the workers, then runs its own shard of it. The other
    attributes (model, kv_cache, ...) are rank 0's runner's."""

    def __init__(self, runner, launcher: TensorParallelLauncher, tp: TPCollectives) -> None:
        self.runner = runner
        self.launcher: TensorParallelLauncher | None = launcher  # None once closed
        self.channel = PlanChannel(tp.transport)
        self.broken: str | None = None  # why the ranks can no longer step together

    def execute(self, plan: StepPlan):
        if self.broken is not None:
            raise RuntimeError(f"tensor parallel: the engine cannot step: {self.broken}")
        try:
            self.channel.send(plan)
            return self.runner.execute(plan)
        except BaseException as e:
            # A step stopped part-way (a worker gone, a collective failed, an interrupt): the
            # ranks are no longer at the same operation, and the next message would pair with
            # the wrong one. Stop the workers; this engine steps no more.
            gone = [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.launcher.procs, start=1)
                    if p.poll() is not None] if self.launcher is not None else []
            self.broken = (f"worker {', '.join(gone)} is gone" if gone else
                           f"a step failed part-way ({type(e).__name__}: {e})")
            self.close()
            if isinstance(e, Exception):
                raise RuntimeError(f"tensor parallel: the engine cannot step: {self.broken}") from e
            raise

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close(self.channel if self.broken is None else None)
            self.launcher = None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)
