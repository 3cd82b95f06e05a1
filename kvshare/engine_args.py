"""The engine options shared by every command that builds an engine (`generate`, `info`,
`serve`, `doctor`): their argparse flags, and the EngineConfig keyword arguments they map to.
Defaults come from EngineConfig, so the flags cannot drift from the Python API."""
from __future__ import annotations

import argparse
import os

from kvshare.config import engine_default

# How a data-parallel front end hands its replicas the hash seed: not on their command lines.
HASH_SEED_ENV = "KVSHARE_PREFIX_CACHING_HASH_SEED"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--model", default=engine_default("model"),
                   help="GGUF file, HF directory or gemma3-270m (packaged Gemma 3 270M) (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=engine_default("dtype"), choices=["auto", "float32", "bfloat16"],
                   help="activations: auto = float32")
    g.add_argument("--prefill-dtype", default=engine_default("prefill_dtype"), choices=["auto", "float32", "bfloat16"],
                   help="GEMMs over many rows (prefill) on kept-quantized weights: auto = bfloat16 where the CPU "
                        "has avx512_bf16, else --dtype")
    g.add_argument("--quantization", default=engine_default("quantization"), choices=["auto", "none"],
                   help="auto: GGUF weights stay quantized (fast); none: dequantize (with --dtype float32: "
                        "the exact reference mode)")
    g.add_argument("--block-size", type=int, default=engine_default("block_size"))
    g.add_argument("--kv-cache-dtype", default=engine_default("kv_cache_dtype"),
                   help="KV storage: auto (= --dtype; bfloat16 in the default mode on CPUs with avx512_bf16), float32, "
                        "bfloat16, float16, int8, fp8_e4m3")
    fraction = engine_default("kv_cache_memory_fraction")
    g.add_argument("--kv-cache-memory", default=engine_default("kv_cache_memory"),
                   help=f"KV pool size, e.g. 512MiB (default: {fraction * 100:g}%% of free memory)")
    g.add_argument("--max-model-len", type=int, default=engine_default("max_model_len"))
    g.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int, default=engine_default("max_num_batched_tokens"))
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="models mixing global and sliding-window layers: one block table for every layer "
                        "instead of one per KV cache group (vLLM's flag)")
    g.add_argument("--kv-policy", default=engine_default("kv_policy"), choices=["sink"],
                   help="sink: keep --sink-tokens first tokens + --window-tokens recent ones (docs/kv_policies.md)")
    g.add_argument("--sink-tokens", type=int, default=engine_default("sink_tokens"))
    g.add_argument("--window-tokens", type=int, default=engine_default("window_tokens"))
    g.add_argument("--sink-max-tokens", type=int, default=engine_default("sink_max_tokens"),
                   help="with --kv-policy sink: the most tokens one request may generate (default: %(default)s)")
    g.add_argument("--seed", type=int, default=engine_default("seed"),
                   help="root of unseeded requests' sampling; a request's own seed always reproduces "
                        f"(default: {engine_default('seed')}; serve: a random one per start)")
    g.add_argument("--audit", action="store_true", help="check KV isolation invariants after every step")
    g.add_argument("--kv-event-log", default=engine_default("kv_event_log"),
                   help="write block events as JSONL (see kvshare audit replay)")
    g.add_argument("--kv-events-endpoint", default=engine_default("kv_events_endpoint"),
                   help="publish KV cache events (BlockStored / BlockRemoved / AllBlocksCleared, vLLM's "
                        "wire format: ZMQ PUB, msgpack) on this endpoint, e.g. tcp://127.0.0.1:5557")
    g.add_argument("--kv-events-replay-endpoint", default=engine_default("kv_events_replay_endpoint"),
                   help="ZMQ ROUTER endpoint that resends buffered event batches from a sequence number")
    g.add_argument("--kv-events-topic", default=engine_default("kv_events_topic"),
                   help="topic frame of every published batch (default: empty)")
    g.add_argument("--kv-events-token-ids", action="store_true",
                   help="publish BlockStored with the block's token ids (the tenants' prompt text) for consumers "
                        "that need them; by default they are empty lists (routers need only the hashes)")
    g.add_argument("--kv-events-no-token-ids", action="store_true",
                   help="accepted for compatibility: empty token_ids are the default now")
    g.add_argument("--kv-events-allow-remote", action="store_true",
                   help="allow a KV event or replay endpoint other machines can reach (tcp://*, 0.0.0.0, a host "
                        "name, a non-loopback address): the sockets have no authentication, and the replay socket "
                        "resends the last 10,000 batches (default: loopback tcp://, ipc:// and inproc:// only)")
    g.add_argument("--prefix-caching-hash-seed",
                   default=os.environ.get(HASH_SEED_ENV) or engine_default("prefix_caching_hash_seed"),
                   help="derive prefix-cache block hashes from this seed instead of a random per-process "
                        "root, so replicas (and a router) compute the same hashes from token ids (default: "
                        f"${HASH_SEED_ENV}, which keeps it off the command line other users can read)")
    g.add_argument("--data-parallel-rank", type=int, default=engine_default("data_parallel_rank"),
                   help="this engine's rank among data-parallel replicas, carried in its KV event batches (set "
                        "by --data-parallel-size for each replica; default: none)")

    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=engine_default("tensor_parallel_size"),
                   metavar="N", help="split every layer across N processes on this machine; threads are "
                                     "divided between them (docs/tensor_parallel.md)")
    g.add_argument("--tensor-parallel-backend", default=engine_default("tensor_parallel_backend"),
                   choices=["auto", "gloo"], help="how the ranks exchange activations: auto = shared memory "
                                                  "(gloo where kvshare's C++ library is not built), gloo = always gloo")


def kv_events_token_ids(args: argparse.Namespace) -> bool:
    if args.kv_events_token_ids and args.kv_events_no_token_ids:
        raise ValueError("--kv-events-token-ids and --kv-events-no-token-ids contradict each other: give one "
                         "(without either, token_ids are empty)")
    return args.kv_events_token_ids


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, dtype=args.dtype, prefill_dtype=args.prefill_dtype, quantization=args.quantization, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, kv_event_log=args.kv_event_log, kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint, kv_events_topic=args.kv_events_topic,
        kv_events_token_ids=kv_events_token_ids(args),
        kv_events_allow_remote=args.kv_events_allow_remote,
        prefix_caching_hash_seed=args.prefix_caching_hash_seed, data_parallel_rank=args.data_parallel_rank,
        kv_policy=args.kv_policy,
        sink_tokens=args.sink_tokens, window_tokens=args.window_tokens, sink_max_tokens=args.sink_max_tokens,
        kv_cache_groups=not args.disable_hybrid_kv_cache_manager, tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_backend=args.tensor_parallel_backend,
        # Only an explicit --audit overrides KVSHARE_AUDIT.
        **({"audit": True} if args.audit else {}),
    )
