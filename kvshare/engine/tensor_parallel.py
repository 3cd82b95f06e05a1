"""Tensor parallelism across processes (EngineConfig.tensor_parallel_size > 1).

Rank 0 is the engine's own process: its scheduler and KV manager decide every step, and before
running a step it broadcasts the step plan (sequences stripped: the runner reads only block ids,
slots, positions and tokens) to the other ranks. Each rank runs that plan through its shard of
the model over its shard of the KV cache (its KV heads, at the same block ids), and the shards
meet only in the model's collectives (kvshare.model.tensor_parallel). So the block tables are
identical on every rank by construction: there is one table, and it travels in the plan.

Ranks talk over a torch.distributed gloo process group on loopback (kvshare's tensors are CPU
tensors; NCCL would need CUDA ones, which no kvshare path has yet). The process group is built
directly, not through init_process_group, so no process-wide default group exists and several
engines can live in one process.

Start-up: rank 0 opens a TCPStore on a free loopback port, puts the config in it and starts the
workers (`python -m kvshare.engine.tp_worker`), which load the model while rank 0 does;
rank 0 then puts the KV pool size it planned, and every rank joins the group.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from kvshare.config import EngineConfig
from kvshare.engine.step_plan import StepPlan
from kvshare.model.tensor_parallel import TPCollectives, TPShard

# Start-up waits (a worker's model load) give up after this long.
STARTUP_TIMEOUT = timedelta(minutes=5)
# A collective's wait: a worker sits in the plan broadcast for as long as the engine is idle.
# A rank that dies ends the others' waits at once (its sockets close); this is only the backstop.
COLLECTIVE_TIMEOUT = timedelta(days=365)
_STOP = -1  # plan size that tells the workers to exit


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's share of the engine's threads (config.num_threads, else torch's default)."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


class PlanChannel:
    """Step plans from rank 0 to every rank, as one size broadcast and one byte broadcast."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def send(self, plan: StepPlan | None) -> None:
        data = b"" if plan is None else pickle.dumps(_wire_plan(plan), protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([_STOP if plan is None else len(data)], dtype=torch.int64)
        self.group.broadcast([size], self._opts).wait()
        if data:
            self.group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self._opts).wait()

    def recv(self) -> StepPlan | None:
        size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast([size], self._opts).wait()
        n = int(size)
        if n == _STOP:
            return None
        buf = torch.empty(n, dtype=torch.uint8)
        self.group.broadcast([buf], self._opts).wait()
        return pickle.loads(buf.numpy().tobytes())


def _wire_plan(plan: StepPlan) -> StepPlan:
    """The plan as the runner reads it: the engine's Sequence records (generators, detokenizers)
    stay on rank 0."""
    return StepPlan(chunks=[dataclasses.replace(c, seq=None) for c in plan.chunks], preempted=[],
                    block_copies=plan.block_copies, rotations=plan.rotations)


class TensorParallelLauncher:
    """Rank 0's side of start-up: the store, the worker processes, and joining the group."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=STARTUP_TIMEOUT,
                                   wait_for_workers=False)
        self.store.set("config", pickle.dumps(config))
        threads = str(threads_per_rank(config))
        self.procs = [subprocess.Popen([sys.executable, "-m", "kvshare.engine.tp_worker", "--rank", str(r),
                                        "--size", str(self.size), "--port", str(self.store.port),
                                        "--threads", threads, "--parent", str(os.getpid())])
                      for r in range(1, self.size)]
        # An engine dropped without close() (the offline LLM never closes) still ends its workers.
        self._finalizer = weakref.finalize(self, _terminate, list(self.procs))

    def connect(self, shard: TPShard, num_blocks: int) -> TPCollectives:
        """Tell the workers the KV pool size, wait until each has loaded its shard's weights,
        and join the group with them."""
        self.store.set("num_blocks", str(num_blocks))
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        for r, proc in enumerate(self.procs, start=1):
            while not self.store.check([f"ready/{r}"]):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor parallel: worker rank {r} exited with code {proc.returncode} during "
                                       "start-up (its error is in the log above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor parallel: worker rank {r} did not start within "
                                       f"{STARTUP_TIMEOUT.total_seconds():.0f} s")
                time.sleep(0.02)
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), 0, self.size, COLLECTIVE_TIMEOUT)
        return TPCollectives(group, shard)

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
        self._finalizer.detach()


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()


class TensorParallelRunner:
    """Rank 0's runner: sends each plan to the workers, then runs its own shard of it. The other
    attributes (model, kv_cache, ...) are rank 0's runner's."""

    def __init__(self, runner, launcher: TensorParallelLauncher, tp: TPCollectives) -> None:
        self.runner = runner
        self.launcher = launcher
        self.channel = PlanChannel(tp.group)

    def execute(self, plan: StepPlan):
        try:
            self.channel.send(plan)
            return self.runner.execute(plan)
        except RuntimeError as e:  # gloo's: a peer's sockets closed, or a collective failed
            gone = [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.launcher.procs, start=1)
                    if p.poll() is not None] if self.launcher is not None else []
            raise RuntimeError("tensor parallel: " + (f"worker {', '.join(gone)} is gone" if gone else
                                                      "a collective failed") + f"; the engine cannot step ({e})") from e

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close(self.channel)
            self.launcher = None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)
