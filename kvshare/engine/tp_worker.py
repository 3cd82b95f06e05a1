"""A tensor-parallel worker rank: `python -m kvshare.engine.tp_worker`, started by the engine
(kvshare.engine.tensor_parallel), never by hand. It loads the model, keeps its shard, and runs
every step plan rank 0 broadcasts until told to stop. Its own module, which the kvshare package
does not import, so `-m` runs it as a fresh __main__."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from kvshare.engine.model_setup import build_rank, plan_kv
from kvshare.engine.tensor_parallel import STARTUP_TIMEOUT, PlanChannel, config_from_json, gloo_group
from kvshare.model import cpu_kernels
from kvshare.model.loader import load_model
from kvshare.model.tensor_parallel import TPCollectives, TPShard
from kvshare.model.tp_transport import GlooTransport, ShmSegment, ShmTransport


def _exit_with_parent(parent: int) -> None:
    """A worker outlives no engine: when rank 0's process is gone, exit (its sockets may linger)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def _ignore(signum, frame) -> None:
    pass


def _map_segment(spec: bytes, size: int) -> ShmSegment | None:
    """Rank 0's shared memory segment, or None (it made none, or this rank cannot use it)."""
    if not spec or not cpu_kernels.SHM.available():
        return None
    info = json.loads(spec)
    try:
        return ShmSegment(info["path"], size, info["slot_bytes"], create=False)
    except OSError:
        return None


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvshare.engine.tp_worker",
                                description="a tensor-parallel worker rank (started by the engine, not by hand)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s kvshare tp rank {args.rank}: %(message)s")
    # Rank 0 decides when this rank stops (a stop message, or SIGKILL): a Ctrl+C or a SIGTERM sent
    # to the whole process group must not take a worker away while rank 0 drains its requests.
    # A handler that does nothing rather than SIG_IGN: a compiler this process starts (a kernel
    # build) gets the default dispositions back at exec, so it does not outlive a killed worker.
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, False, timeout=STARTUP_TIMEOUT)
    config = config_from_json(store.get("config"))
    loaded = load_model(config.model, dtype=config.torch_dtype, quantization=config.quantization)
    config.settle_for_weights(loaded.kept_quantized)
    shard = TPShard(args.rank, args.size, loaded.config)
    kv = plan_kv(config, loaded.config)
    num_blocks = int(store.get("num_blocks"))
    segment = _map_segment(store.get("shm"), args.size)
    store.set(f"shm/{args.rank}", "1" if segment is not None else "0")
    store.set(f"ready/{args.rank}", "1")
    if store.get("transport") == b"shm":
        transport = ShmTransport(segment, args.rank, lambda rank: None)  # rank 0 gone: the watchdog exits
    else:
        transport = GlooTransport(gloo_group(store, args.rank, args.size), args.rank, args.size)
    _, _, runner = build_rank(config, loaded.config, loaded.weights, kv, num_blocks, TPCollectives(transport, shard))
    del loaded
    channel = PlanChannel(transport)
    try:
        while (plan := channel.recv()) is not None:
            runner.execute(plan)
    except Exception:  # rank 0 gone, or a failure here: either way this rank is done
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
