"""A tensor-parallel worker rank: `python -m kvshare.engine.tp_worker`, started by the engine
(kvshare.engine.tensor_parallel), never by hand. It loads the model, keeps its shard, and runs
every step plan rank 0 broadcasts until told to stop. Its own module, which the kvshare package
does not import, so `-m` runs it as a fresh __main__.

It trusts the start-up store only as far as it must: every value it reads is signed with the
launch's token, which it gets in its environment (TOKEN_ENV; a worker without it refuses to
start), and it maps a shared memory segment or sizes its KV pool only where what it is told
matches what it computes itself from the config."""
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
from typing import MutableMapping

import torch

from kvshare.config import EngineConfig
from kvshare.engine.model_setup import KVPlan, build_rank, check_tensor_parallel, plan_kv
from kvshare.engine.tensor_parallel import (TOKEN_ENV, PlanChannel, SignedStore, config_from_json, gloo_group,
                                            open_store)
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model.config import ModelArchConfig
from kvshare.model.kernels import shm
from kvshare.model.loader import load_model
from kvshare.model.numerics import numerics_for
from kvshare.model.tensor_parallel import TPCollectives, TPShard
from kvshare.model.tp_transport import GlooTransport, ShmSegment, ShmTransport, check_segment_path


def _exit_with_parent(parent: int) -> None:
    """A worker outlives no engine: when rank 0's process is gone, exit (its sockets may linger)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def _ignore(signum, frame) -> None:
    pass


def map_segment(spec: bytes, size: int, slot_bytes: int) -> ShmSegment | None:
    """Rank 0's shared memory segment, or None (it made none, or this rank cannot use it).
    slot_bytes: what this rank computes from the config. A segment its engine could not have
    made (another path, another size, a symbolic link) raises: it is never mapped."""
    if not spec:
        return None
    info = json.loads(spec)
    path = info["path"]
    check_segment_path(path)
    if info["slot_bytes"] != slot_bytes:
        raise ValueError(f"shared memory segment {path}: slot_bytes {info['slot_bytes']} is not the {slot_bytes} "
                         "this rank computes from the config")
    if shm.SHM.settle() is not None:
        return None
    try:
        return ShmSegment(path, size, slot_bytes, create=False)
    except OSError:  # one it cannot map (SegmentRefused is no OSError): every rank then takes gloo
        return None


def check_num_blocks(num_blocks: int, config: EngineConfig, mc: ModelArchConfig, kv: KVPlan) -> int:
    """The KV pool size rank 0 planned, if this rank would have planned it: the same count when
    the budget is fixed (kv_cache_memory), else at least one block and no more than this machine's
    memory holds."""
    bytes_per_token = config.kv_format.bytes_per_token(kv.layers_per_block, mc.num_kv_heads, mc.head_dim)
    if config.kv_cache_memory is not None:
        want = kv_pool_blocks(config.kv_budget_bytes(), bytes_per_token, config.block_size)
        if num_blocks != want:
            raise ValueError(f"a KV pool of {num_blocks} blocks is not the {want} that kv_cache_memory="
                             f"{config.kv_cache_memory} holds")
        return num_blocks
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_blocks < 1 or num_blocks * bytes_per_token * config.block_size > memory:
        raise ValueError(f"a KV pool of {num_blocks} blocks of {config.block_size} tokens x {bytes_per_token} bytes "
                         f"is not between one block and this machine's memory ({memory} bytes)")
    return num_blocks


def launch_token(environ: MutableMapping[str, str]) -> str:
    """The launch's token, taken out of `environ` so that no process this worker starts inherits it."""
    token = environ.pop(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"kvshare tensor-parallel worker: {TOKEN_ENV} is not set: a worker is started by its "
                         "engine, which hands it the launch's token; refusing to start")
    return token


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvshare.engine.tp_worker",
                                description="a tensor-parallel worker rank (started by the engine, not by hand)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    token = launch_token(os.environ)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s kvshare tp rank {args.rank}: %(message)s")
    # Rank 0 decides when this rank stops (a stop message, or SIGKILL): a Ctrl+C or a SIGTERM sent
    # to the whole process group must not take a worker away while rank 0 drains its requests.
    # A handler that does nothing rather than SIG_IGN: a compiler this process starts (a kernel
    # build) gets the default dispositions back at exec, so it does not outlive a killed worker.
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    torch.set_num_threads(args.threads)
    store = SignedStore(open_store(args.store, args.size), token)
    config = config_from_json(store.get("config"))
    loaded = load_model(config.model, dtype=config.torch_dtype, quantization=config.quantization)
    config.settle_for_weights(loaded.kept_quantized)
    # Before this rank says it is ready: a kernel it cannot load stops the start, not a step.
    numerics = numerics_for(config.exact, loaded.kept_quantized)
    check_tensor_parallel(loaded.config, args.size)
    shard = TPShard(args.rank, args.size, loaded.config)
    kv = plan_kv(config, loaded.config)
    num_blocks = check_num_blocks(int(store.get("num_blocks")), config, loaded.config, kv)
    segment = map_segment(store.get("shm"), args.size,
                          ShmSegment.slot_bytes_for(config.max_num_batched_tokens, loaded.config.hidden_size))
    store.set(f"shm/{args.rank}", "1" if segment is not None else "0")
    store.set(f"ready/{args.rank}", "1")
    transport: ShmTransport | GlooTransport
    if store.get("transport") == b"shm":
        assert segment is not None  # rank 0 picks shm only when every rank mapped the segment
        transport = ShmTransport(segment, args.rank, lambda rank: None)  # rank 0 gone: the watchdog exits
    else:
        transport = GlooTransport(gloo_group(store.store, args.rank, args.size), args.rank, args.size)
    store.set(f"connected/{args.rank}", "1")  # rank 0 removes the store once every rank says this
    _, _, runner = build_rank(config, loaded.config, loaded.weights, kv, num_blocks, numerics,
                              TPCollectives(transport, shard))
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
