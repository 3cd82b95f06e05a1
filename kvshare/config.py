"""The one engine configuration object; every component receives it (or the part it needs)."""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields

import torch

from kvshare.model.kv_quant import KVFormat, check_kv_cache_dtype, resolve_kv_format

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def _canonical(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)


def parse_bytes(value: int | str, field_name: str = "kv_cache_memory") -> int:
    """Accept 1073741824, "1GiB", "512MiB", "2G"."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}={value!r} is invalid: give a byte count like 1073741824 or '1GiB'")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field_name}={value!r} is invalid: give a byte count like 1073741824 or '1GiB'")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ValueError(f"{field_name}={value!r} is invalid: must be > 0 bytes")
    return n


def local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can be reached only from this machine: ipc:// and inproc://, or TCP
    on a loopback address. A wildcard, a host name or an interface name counts as remote."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (then bfloat16 activations are the fast default)."""
    return "avx512_bf16" in cpu_flags()


def resolve_dtype(dtype: str) -> str:
    """"auto": float32 activations on every CPU. bfloat16 activations (8 significant bits in the
    residual stream, every norm, RoPE and SiLU) move greedy decoding off the exact path on 6-7 of 16
    prompts within 32 tokens on the bundled model; float32 with kept-quantized weights keeps all
    16, and decode is memory-bound, so it costs no speed. Where bfloat16 pays, in the
    compute-bound prefill GEMMs, `prefill_dtype` puts it."""
    return "float32" if dtype == "auto" else dtype


def resolve_prefill_dtype(prefill_dtype: str, dtype: str, quantization: str | None) -> str:
    """"auto": bfloat16 where the CPU multiplies it natively (avx512_bf16) and the weights are kept
    quantized (the many-row GEMM then multiplies a bfloat16 scratch copy of one layer's weights:
    ~2.5x float32's rate there); else the activation dtype."""
    if prefill_dtype != "auto":
        return prefill_dtype
    return "bfloat16" if quantization == "auto" and cpu_has_avx512_bf16() else dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, prefill_dtype: str, kv_policy: str | None = None) -> str:
    """"auto": the activation dtype, except where float32 activations come with bfloat16 prefill
    GEMMs (the default mode on avx512_bf16 CPUs, once EngineConfig.settle_for_weights has seen
    kept-quantized weights): there K/V are stored in bfloat16. The keys and values a prompt writes
    come out of bfloat16 GEMMs already (for the bundled model, V exactly, K up to its RoPE), a
    decode step reads half the bytes, and a KV budget holds twice the tokens; greedy decoding
    stays on the exact path on the same 15 of 16 prompts (benchmarks/default_mode_accuracy.py).
    Not under kv_policy="sink": its kept keys are re-rotated in place at every eviction, and a
    bfloat16 cache would round each of them again every time."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if kv_policy is None and dtype == "float32" and prefill_dtype == "bfloat16":
        return "bfloat16"
    return dtype


QUANTIZATION_CHOICES = ("auto", "none")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
KV_POLICIES = ("sink",)
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank too
TENSOR_PARALLEL_BACKENDS = ("auto", "gloo")
# How a data-parallel front end hands its replicas the hash seed: not on their command lines.
HASH_SEED_ENV = "KVSHARE_PREFIX_CACHING_HASH_SEED"
KV_CACHE_MEMORY_FRACTION = 0.05


@dataclass(frozen=True)
class Flag:
    """How an engine option appears on the command line (kvshare.engine_args builds the argparse
    flags from these; Ray's options and the memory planner read the same fields). The flag's name
    is --field-name unless `name` says otherwise; a bool field is a store_true flag."""

    help: str | None = None  # "{default}" and "{env}" are filled in with the field's default and `env`
    name: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negate: bool = False  # a store_true flag that sets the field False (--no-prefix-caching)
    only_when_given: bool = False  # passed on only when given: the field has an environment fallback
    env: str | None = None  # the flag's default is read from this environment variable first


def option(default, flag: Flag | None = Flag()):
    """An EngineConfig field: its default, and its command-line flag (None: no flag). Each engine
    option is declared here once; the CLI, Ray's options and the memory planner derive from it."""
    return field(default=default, metadata={"flag": flag})


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


@dataclass
class EngineConfig:
    model: str | None = option(None, Flag(  # None: the bundled SmolLM2-135M-Instruct
        "GGUF file, HF directory or gemma3-270m (packaged Gemma 3 270M) (default: bundled SmolLM2-135M-Instruct)"))
    # Activation dtype: "auto" is float32 (see resolve_dtype).
    dtype: str = option("auto", Flag("activations: auto = float32", choices=DTYPE_CHOICES))
    # The dtype of the dense GEMMs that prompt rows (prefill chunks) take on kept-quantized weights:
    # their inputs are rounded to it, the sums stay float32-accurate; decode rows always take the
    # packed kernels in `dtype` (kvshare.model.qlinear). "auto": bfloat16 where the CPU has
    # avx512_bf16, else `dtype` (resolve_prefill_dtype).
    prefill_dtype: str = option("auto", Flag(
        "GEMMs over many rows (prefill) on kept-quantized weights: auto = bfloat16 where the CPU has avx512_bf16, "
        "else --dtype", choices=DTYPE_CHOICES))
    # vLLM's option name. "auto": GGUF tensors stay in their quantized format, each on a kernel
    # that reads it (kvshare.model.qlinear); None (or "none"): everything dequantized to `dtype`,
    # the exact reference path (with dtype="float32", what the HF-parity tests run).
    quantization: str | None = option("auto", Flag(
        "auto: GGUF weights stay quantized (fast); none: dequantize (with --dtype float32: the exact reference mode)",
        choices=QUANTIZATION_CHOICES))
    block_size: int = option(16)
    # How K/V are stored: "auto" (the model dtype; bfloat16 in the default mode on avx512_bf16
    # CPUs: resolve_kv_cache_dtype), "float32", "bfloat16", "float16", or "int8" /
    # "fp8_e4m3" with one float32 scale per token per kv head (kvshare.model.kv_quant).
    kv_cache_dtype: str = option("auto", Flag(
        "KV storage: auto (= --dtype; bfloat16 in the default mode on CPUs with avx512_bf16), float32, bfloat16, "
        "float16, int8, fp8_e4m3"))
    # KV budget: an explicit byte count wins; otherwise a fraction of currently available memory.
    kv_cache_memory: int | str | None = option(None, Flag(
        f"KV pool size, e.g. 512MiB (default: {KV_CACHE_MEMORY_FRACTION * 100:g}%% of free memory)"))
    kv_cache_memory_fraction: float = option(KV_CACHE_MEMORY_FRACTION, None)
    max_model_len: int | None = option(None)  # None: the model's context length, capped by the pool
    max_num_seqs: int = option(128)
    # LoRA adapters (vLLM's options; kvshare.model.lora, docs/lora.md): requests may name an adapter
    # loaded on the engine; at most max_loras distinct adapters loaded at once, each of rank <= max_lora_rank.
    enable_lora: bool = option(False, Flag("serve LoRA adapters over the base model"))
    max_loras: int = option(1, Flag("most LoRA adapters loaded at once"))
    max_lora_rank: int = option(16, Flag("largest LoRA rank an adapter may have"))
    max_num_batched_tokens: int = option(2048)
    # vLLM's: "fcfs" admits by arrival; "priority" by (SamplingParams.priority, arrival), lower
    # first, and preempts the running request with the largest (priority, arrival) first.
    scheduling_policy: str = option("fcfs", Flag(
        "fcfs: first come first served; priority: by each request's priority (lower first), then arrival; "
        "the least important running request is preempted first", choices=SCHEDULING_POLICIES))
    enable_prefix_caching: bool = option(True, Flag("disable automatic prefix caching", name="--no-prefix-caching",
                                                    negate=True))
    # Models mixing global and sliding-window layers keep one block table per group of layers of
    # one attention type (kvshare.kvcache.kv_groups), so window layers hold only their window.
    # False: every layer shares one table (vLLM's disable_hybrid_kv_cache_manager).
    kv_cache_groups: bool = option(True, Flag(
        "models mixing global and sliding-window layers: one block table for every layer instead of one per KV "
        "cache group (vLLM's flag)", name="--disable-hybrid-kv-cache-manager", negate=True))
    # Opt-in KV eviction (kvshare.kvcache.kv_policy, docs/kv_policies.md): None keeps every key the
    # model attends to (its own sliding windows still apply); "sink" is StreamingLLM: the first
    # `sink_tokens` tokens plus the last `window_tokens` (rounded up to whole blocks), with
    # cache positions, so a request can generate past max_model_len in flat memory.
    kv_policy: str | None = option(None, Flag(
        "sink: keep --sink-tokens first tokens + --window-tokens recent ones (docs/kv_policies.md)",
        choices=KV_POLICIES))
    sink_tokens: int = option(4)
    window_tokens: int | None = option(None)
    # Under "sink" a sequence is never stopped by max_model_len: the most tokens one request may
    # generate there (a larger max_tokens is refused), so no request decodes forever.
    sink_max_tokens: int = option(32768, Flag(
        "with --kv-policy sink: the most tokens one request may generate (default: %(default)s)"))
    # The root of unseeded requests' sampling generators: a fixed seed repeats them run after run
    # (the offline default, 0); None draws one per engine from os.urandom (`kvshare serve`'s default).
    seed: int | None = option(0, Flag(
        "root of unseeded requests' sampling; a request's own seed always reproduces "
        "(default: {default}; serve: a random one per start)"))
    num_threads: int | None = option(None, None)  # KVSHARE_NUM_THREADS
    # Isolation audit after every step (KVSHARE_AUDIT=1 turns it on too); costs nothing when off.
    # Only an explicit --audit overrides KVSHARE_AUDIT.
    audit: bool = option(False, Flag("check KV isolation invariants after every step", only_when_given=True))
    kv_event_log: str | None = option(None, Flag(  # JSONL file of block events (kvshare audit replay reads it)
        "write block events as JSONL (see kvshare audit replay)"))
    # KV cache events for routers in vLLM's wire format (kvshare.engine.prefix_update_publisher): a ZMQ
    # PUB endpoint such as "tcp://127.0.0.1:5557", an optional ROUTER endpoint replaying missed
    # batches by sequence number, and the topic frame.
    kv_events_endpoint: str | None = option(None, Flag(
        "publish KV cache events (BlockStored / BlockRemoved / AllBlocksCleared, vLLM's wire format: ZMQ PUB, "
        "msgpack) on this endpoint, e.g. tcp://127.0.0.1:5557"))
    kv_events_replay_endpoint: str | None = option(None, Flag(
        "ZMQ ROUTER endpoint that resends buffered event batches from a sequence number"))
    kv_events_topic: str = option("", Flag("topic frame of every published batch (default: empty)"))
    # vLLM's BlockStored events carry the block's token ids. They are the tenants' prompts (salted
    # ones too), and the event sockets have no authentication: by default the lists are empty (the
    # wire format stays valid; routers need only the hashes). True publishes them, for consumers
    # that need them (`--kv-events-token-ids`).
    kv_events_token_ids: bool = option(False, Flag(
        "publish BlockStored with the block's token ids (the tenants' prompt text) for consumers that need them; "
        "by default they are empty lists (routers need only the hashes)"))
    # A TCP endpoint that is not loopback (tcp://*:..., 0.0.0.0, a host name or another address)
    # lets anyone on the network follow every tenant's cache, and the replay socket hands out the
    # last 10,000 batches: refused unless this is True (`--kv-events-allow-remote`). ipc:// and
    # inproc:// stay on this machine. The Ray replicas set it (their routers are elsewhere).
    kv_events_allow_remote: bool = option(False, Flag(
        "allow a KV event or replay endpoint other machines can reach (tcp://*, 0.0.0.0, a host name, a "
        "non-loopback address): the sockets have no authentication, and the replay socket resends the last "
        "10,000 batches (default: loopback tcp://, ipc:// and inproc:// only)"))
    # Prefix-cache block hashes start from a random per-process root, so they are never comparable
    # across processes. A seed makes them stable (the root is derived from it: every replica with
    # the same seed hashes alike, and a router can compute them from token ids); a tenant's
    # cache_salt still keeps its blocks apart.
    prefix_caching_hash_seed: str | None = option(None, Flag(
        "derive prefix-cache block hashes from this seed instead of a random per-process root, so replicas (and a "
        "router) compute the same hashes from token ids (default: ${env}, which keeps it off the command line "
        "other users can read)", env=HASH_SEED_ENV))
    # KV tiers under the pool (docs/kv_tiers.md): cached blocks the pool evicts are kept in host RAM
    # and, write-through, in files; a prefix lookup that misses the pool continues there. With
    # prefix_caching_hash_seed set the disk tier survives restarts; without, it is this process's.
    kv_host_memory: int | str | None = option(None, Flag(
        "host-RAM tier under the KV pool for evicted prefix blocks, e.g. 2GiB (default: none)"))
    kv_disk_path: str | None = option(None, Flag(
        "directory of the disk tier under the KV pool (one file per block, named by its hash; kept across "
        "restarts with --prefix-caching-hash-seed, else cleared at start; default: none)", metavar="DIR"))
    kv_disk_size: int | str = option("8GiB", Flag("the disk tier's budget, e.g. 20GiB (default: {default})"))
    # At start-up the engine times loading a block from each tier against recomputing it, and keeps
    # no tier that loses (tiny models, slow disks), saying so; False keeps the tiers as configured.
    kv_tier_probe: bool = option(True, Flag(
        "keep the KV tiers even where loading a block measures slower than recomputing it", name="--no-kv-tier-probe",
        negate=True))
    # This engine's rank among data-parallel replicas (`kvshare serve --data-parallel-size` sets it):
    # its KV event batches carry it, as vLLM's do, so a consumer of several replicas' events can
    # tell them apart. None: a single engine, batches without it.
    data_parallel_rank: int | None = option(None, Flag(
        "this engine's rank among data-parallel replicas, carried in its KV event batches (set by "
        "--data-parallel-size for each replica; default: none)"))
    # vLLM's name: this many processes each hold a shard of every layer (their heads, their part
    # of the MLP and vocabulary) and run every step together (tensor_parallel_backend says how they
    # exchange activations); this process is rank 0 and schedules (kvshare.engine.tensor_parallel).
    # Threads are split between the ranks.
    tensor_parallel_size: int = option(1, Flag(
        "split every layer across N processes on this machine; threads are divided between them "
        "(docs/tensor_parallel.md)", aliases=("-tp",), metavar="N"))
    # How the ranks exchange activations: "auto" is a shared memory segment where kvshare's C++
    # library is built (microseconds per all-reduce), else a gloo process group over loopback
    # (1-2 ms per all-reduce on a small VM: a sharded forward does two per layer); "gloo" always gloo.
    tensor_parallel_backend: str = option("auto", Flag(
        "how the ranks exchange activations: auto = shared memory (gloo where kvshare's C++ library is not "
        "built), gloo = always gloo", choices=TENSOR_PARALLEL_BACKENDS))

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            self.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(self.dtype, str(self.dtype))
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype={self.dtype!r} is invalid: allowed are 'auto', 'float32' and 'bfloat16'")
        self.dtype = resolve_dtype(self.dtype)
        if self.prefill_dtype not in _DTYPES and self.prefill_dtype != "auto":
            raise ValueError(f"prefill_dtype={self.prefill_dtype!r} is invalid: allowed are 'auto', 'float32' and "
                             f"'bfloat16'")
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            self.quantization = None
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization={self.quantization!r} is invalid: allowed are 'auto' (keep GGUF "
                             "weights quantized) and None / 'none' (dequantize: the exact path)")
        self.prefill_dtype = resolve_prefill_dtype(_canonical(self.prefill_dtype), self.dtype, self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is invalid: must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= 1")
        if self.max_lora_rank > MAX_LORA_RANK:  # the C++ delta's bound (csrc/decode_step.cpp kLoraMaxRank)
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is invalid: allowed are 1..{MAX_LORA_RANK}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} is invalid: must be an integer >= 2")
        self._check_kv_policy()
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} is invalid: must be an integer, or None for a random one")
        self._check_kv_events()
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r} is invalid: must be an integer >= 1")
        if self.tensor_parallel_backend not in TENSOR_PARALLEL_BACKENDS:
            raise ValueError(f"tensor_parallel_backend={self.tensor_parallel_backend!r} is invalid: allowed are 'auto' "
                             "(shared memory where kvshare's C++ library is built, else gloo) and 'gloo'")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self._check_kv_tiers()
        if not (0.0 < self.kv_cache_memory_fraction <= 0.95):
            raise ValueError(
                f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} is invalid: must be in (0, 0.95]"
            )

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or "://" not in v):
                raise ValueError(f"{name}={v!r} is invalid: a ZMQ endpoint such as 'tcp://127.0.0.1:5557' or "
                                 "'ipc:///tmp/kv-events'")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint: there is nothing to replay")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic={self.kv_events_topic!r} is invalid: must be a string")
        for name in ("kv_events_token_ids", "kv_events_allow_remote"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be true or false")
        if not self.kv_events_allow_remote:
            for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
                v = getattr(self, name)
                if v is not None and not local_endpoint(v):
                    raise ValueError(
                        f"{name}={v!r} can be reached from other machines, and the KV event sockets have no "
                        "authentication: use a loopback address (tcp://127.0.0.1:PORT) or ipc://PATH, or set "
                        "kv_events_allow_remote (--kv-events-allow-remote) to publish on the network")
        if self.data_parallel_rank is not None and (
                not isinstance(self.data_parallel_rank, int) or isinstance(self.data_parallel_rank, bool)
                or self.data_parallel_rank < 0):
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank!r} is invalid: must be an integer >= 0")
        if self.prefix_caching_hash_seed is not None and (
                not isinstance(self.prefix_caching_hash_seed, str) or not self.prefix_caching_hash_seed):
            raise ValueError(f"prefix_caching_hash_seed={self.prefix_caching_hash_seed!r} is invalid: must be a "
                             "non-empty string")

    def _check_kv_tiers(self) -> None:
        if self.kv_host_memory is not None:
            self.kv_host_memory = parse_bytes(self.kv_host_memory, "kv_host_memory")
        self.kv_disk_size = parse_bytes(self.kv_disk_size, "kv_disk_size")
        if self.kv_disk_path is not None and (not isinstance(self.kv_disk_path, str) or not self.kv_disk_path):
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} is invalid: must be a directory path")
        if self.kv_tiers and not self.enable_prefix_caching:
            raise ValueError("kv_host_memory / kv_disk_path keep evicted prefix-cache blocks: they need prefix caching "
                             "(drop --no-prefix-caching, or the tier flags)")
        if self.kv_tiers and self.tensor_parallel_size > 1:
            raise ValueError(f"kv_host_memory / kv_disk_path are not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet: each rank holds only its heads' KV, so every kept "
                             f"block would need one validated copy per rank (docs/kv_tiers.md); use "
                             f"tensor_parallel_size=1 with the tiers, or drop the tier flags")

    @property
    def kv_tiers(self) -> bool:
        """Whether a KV tier (host RAM or disk) is configured under the pool."""
        return self.kv_host_memory is not None or self.kv_disk_path is not None

    def _check_kv_policy(self) -> None:
        if isinstance(self.sink_max_tokens, bool) or not isinstance(self.sink_max_tokens, int) or self.sink_max_tokens < 1:
            raise ValueError(f"sink_max_tokens={self.sink_max_tokens!r} is invalid: must be an integer >= 1")
        if self.kv_policy is not None and self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy={self.kv_policy!r} is invalid: allowed are None (keep all keys) and 'sink' "
                             "(attention sinks + recent window); see docs/kv_policies.md (no 'h2o': why is there)")
        if self.kv_policy is None:
            if self.window_tokens is not None:
                raise ValueError(f"window_tokens={self.window_tokens!r} only applies with kv_policy='sink'")
            return
        bs = self.block_size
        sinks = self.sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or not 0 <= sinks <= bs:
            raise ValueError(f"sink_tokens={self.sink_tokens!r} is invalid: must be an integer in [0, block_size={bs}] "
                             "(the sinks live in the first block)")
        if self.window_tokens is None:
            raise ValueError("kv_policy='sink' needs window_tokens=N: how many recent tokens to keep besides the sinks")
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, int) or self.window_tokens < 1:
            raise ValueError(f"window_tokens={self.window_tokens!r} is invalid: must be an integer >= 1")
        if self.kv_format.quantized:
            # Every eviction re-rotates the kept keys in place: requantizing them each time would
            # pile up rounding error on every key.
            raise ValueError(f"kv_policy='sink' needs a float KV cache, not kv_cache_dtype={self.kv_cache_dtype!r}: "
                             "its keys are re-rotated in place at each eviction")

    @property
    def exact(self) -> bool:
        """The dequantized float32 path that the HF-parity tests compare against."""
        return self.quantization is None and self.dtype == "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def prefill_torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.prefill_dtype]

    @property
    def kv_format(self) -> KVFormat:
        return resolve_kv_format(resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype, self.prefill_dtype,
                                                        self.kv_policy), self.dtype)

    def settle_for_weights(self, kept_quantized: bool) -> None:
        """Called once the model is loaded (by every rank alike). `prefill_dtype` applies only to
        kept-quantized linears: a model with none (an HF checkpoint, a GGUF of F32 / F16 / BF16 or of
        types kvshare dequantizes) computes in `dtype`, and its "auto" KV cache follows `dtype`."""
        if not kept_quantized:
            self.prefill_dtype = self.dtype

    def kv_budget_bytes(self) -> int:
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        return int(available_memory_bytes() * self.kv_cache_memory_fraction)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; allowed: {sorted(known)}")
        if os.environ.get("KVSHARE_AUDIT", "") not in ("", "0") and "audit" not in kwargs:
            kwargs["audit"] = True
        env_threads = os.environ.get("KVSHARE_NUM_THREADS")
        if env_threads and "num_threads" not in kwargs:
            kwargs["num_threads"] = int(env_threads)
        return cls(**kwargs)


def engine_default(name: str):
    """EngineConfig's declared default for the field `name`. Command lines and the memory planner
    take their defaults from here, so each is written once, in EngineConfig."""
    for f in fields(EngineConfig):
        if f.name == name:
            return f.default
    raise KeyError(f"EngineConfig has no field {name!r}")
