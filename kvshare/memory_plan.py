"""Memory planning: how much KV cache a memory budget buys, and how many sequences that holds.

Pure arithmetic over a ModelArchConfig, so it plans any model from its metadata alone (a GGUF
header, an HF config.json) without loading weights. `kvshare memory` prints it; the engine sizes
its pool with the same `kv_pool_blocks` and `KVFormat.bytes_per_token`.

The budget, in order:
  usable       = memory x utilization
  weights      = parameters (from the shapes the model code needs) x dtype bytes, except, for a
                 GGUF file with quantization="auto" (the engine default), the matrices kvshare
                 keeps quantized, at their resident bytes per weight (qlinear.resident_bytes_per_weight)
  activations  = a reserve for one step's transient tensors (see `activation_bytes`)
  KV budget    = usable - weights - activations, cut into blocks of block_size tokens

Hybrid models (global and sliding-window layers) with kv_cache_groups on (the engine default):
one block holds one KV cache group's layers (kvshare.kvcache.kv_groups), a global group holds a
block per block_size tokens, a window group at most its window plus a prefill chunk; the bytes
per token are per block slot (one group's layers) and the per-group lines say what one sequence
of max_model_len costs in each group.

Requests with n > 1 or beam width w share their prompt's full blocks; each branch owns the
rest (its copy of a partial prompt block and its output). Beams often share more than that
(common output prefixes), so the figures for w > 1 are a floor.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from kvshare.config import available_memory_bytes, engine_default, parse_bytes
from kvshare.kvcache.kv_groups import KVCacheGroup, layers_per_block, one_group, plan_kv_groups
from kvshare.kvcache.kv_policy import FullAttention
from kvshare.model.config import ModelArchConfig
from kvshare.model.kv_quant import KVFormat, check_kv_cache_dtype, resolve_kv_format

WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGIT_BUFFERS = 3  # float32 logits, their log-softmax, and the sampler's sorted copy


@dataclass
class PlanConfig:
    memory: int | str | None = None  # the whole budget (device or host); None: available host memory
    utilization: float = 0.9
    dtype: str = "float32"  # weights and activations
    kv_dtype: str = engine_default("kv_cache_dtype")  # "auto": same as dtype
    block_size: int = engine_default("block_size")
    max_model_len: int | None = engine_default("max_model_len")  # None: the model's max_position_embeddings
    width: int = 1  # n or beam width: branches per request sharing one prompt
    avg_prompt_len: int | None = None  # None: min(512, max_model_len // 2)
    avg_output_len: int | None = None  # None: min(256, max_model_len - avg_prompt_len)
    concurrency: int | None = None  # requests you want in flight at once: warn when they do not fit
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    max_num_seqs: int = engine_default("max_num_seqs")
    kv_cache_groups: bool = engine_default("kv_cache_groups")  # False: one block table for every layer
    # {GGUF type name: parameters} of the matrices kept quantized (gguf_weight_formats); None or
    # empty: every weight dense in `dtype` (quantization="none", or an HF checkpoint).
    weight_formats: dict[str, int] | None = None

    def __post_init__(self) -> None:
        self.memory = parse_bytes(self.memory if self.memory is not None else available_memory_bytes(), "memory")
        if isinstance(self.utilization, bool) or not isinstance(self.utilization, (int, float)) \
                or not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"utilization={self.utilization!r} is invalid: must be in (0, 1]")
        if self.dtype not in WEIGHT_DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: allowed are {', '.join(map(repr, WEIGHT_DTYPE_BYTES))}")
        check_kv_cache_dtype(self.kv_dtype, "kv_dtype")
        minimum = {"block_size": 1, "max_model_len": 2, "width": 1, "avg_prompt_len": 1, "avg_output_len": 1,
                   "concurrency": 1, "max_num_batched_tokens": 1, "max_num_seqs": 1}
        for name, low in minimum.items():
            v = getattr(self, name)
            if v is None and name in ("max_model_len", "avg_prompt_len", "avg_output_len", "concurrency"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= {low}")

    @property
    def kv_format(self) -> KVFormat:
        return resolve_kv_format(self.kv_dtype, self.dtype, "kv_dtype")


# ---- the formulas ---------------------------------------------------------------------------
def count_parameters(arch: ModelArchConfig) -> int:
    """Parameters of the tensors the Llama-family model code holds (biases included)."""
    from kvshare.model.loader import expected_weight_shapes

    total = 0
    for shape in expected_weight_shapes(arch).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def weight_bytes(arch: ModelArchConfig, dtype: str, formats: dict[str, int] | None = None) -> int:
    total = count_parameters(arch)
    if not formats:
        return total * WEIGHT_DTYPE_BYTES[dtype]
    from kvshare.model.qlinear import resident_bytes_per_weight

    kept = sum(formats.values())
    packed = sum(n * resident_bytes_per_weight(t) for t, n in formats.items())
    return int(packed + max(0, total - kept) * WEIGHT_DTYPE_BYTES[dtype])


def gguf_weight_formats(path: str) -> dict[str, int]:
    """{GGUF type: parameters} of a GGUF file's matrices that quantization="auto" keeps packed,
    from the header alone."""
    from kvshare.model.gguf_header import read_gguf_header
    from kvshare.model.gguf_loader import hf_tensor_name
    from kvshare.model.qlinear import resident_bytes_per_weight

    out: dict[str, int] = {}
    for t in read_gguf_header(path).tensors:
        try:
            if hf_tensor_name(t.name) is None:
                continue
        except KeyError:
            continue
        if len(t.shape) != 2 or resident_bytes_per_weight(t.type_name) is None:
            continue
        out[t.type_name] = out.get(t.type_name, 0) + int(t.shape[0]) * int(t.shape[1])
    return out


def activation_bytes(arch: ModelArchConfig, dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                     max_model_len: int) -> int:
    """Transient memory of one step, reserved before the KV pool:

      b x T x (3 hidden + q + 2 kv + 3 intermediate)   hidden state, norm output, attention output,
                                                        the fused qkv output, gate+up and silu(gate)*up
      + 2 x b x kv x max_model_len                      one prefill chunk's K/V context, gathered
                                                        (and dequantized) one layer at a time
      + 4 x 3 x R x vocab                               float32 logits, log-softmax, sampler copy

    with b the dtype bytes, T = max_num_batched_tokens, q = heads x head_dim, kv = kv_heads x
    head_dim, R = min(max_num_seqs, T) rows that sample. An estimate of the large buffers, not
    a measurement: allocator slack and the pure-PyTorch decode path's padded gathers are not in it.
    """
    b = WEIGHT_DTYPE_BYTES[dtype]
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    t = max_num_batched_tokens
    rows = min(max_num_seqs, t)
    per_token = 3 * arch.hidden_size + q + 2 * kv + 3 * arch.intermediate_size
    return b * t * per_token + 2 * b * kv * max_model_len + 4 * LOGIT_BUFFERS * rows * arch.vocab_size


def kv_pool_blocks(kv_budget_bytes: int, bytes_per_token: int, block_size: int,
                   field_name: str = "kv_cache_memory") -> int:
    """Whole blocks of `block_size` tokens that fit in the KV budget; ValueError if not even one."""
    num_blocks = kv_budget_bytes // (bytes_per_token * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"{field_name}={kv_budget_bytes} bytes is too small: one block of {block_size} tokens needs "
            f"{bytes_per_token * block_size} bytes"
        )
    return num_blocks


def blocks_per_request(prompt_len: int, output_len: int, block_size: int, width: int = 1,
                       groups: list[KVCacheGroup] | None = None, chunk_tokens: int = 1) -> int:
    """Blocks one request holds at its end: the prompt's full blocks once, then per branch the
    rest of its sequence (a copy of the partial prompt block, and its own output). With KV cache
    groups, that in each global group; a window group holds at most its bound (window plus a
    prefill chunk of `chunk_tokens`) per branch."""
    shared = prompt_len // block_size
    per_branch = -(-(prompt_len + output_len) // block_size) - shared
    plain = shared + width * per_branch
    if not groups:
        return plain
    total = 0
    for g in groups:
        bound = g.policy.max_blocks_per_seq(chunk_tokens)
        total += plain if bound is None else min(plain, width * bound)
    return total


def group_summary(groups: list[KVCacheGroup], block_size: int, bytes_per_token: int, num_tokens: int,
                  chunk_tokens: int) -> list[dict]:
    """Per attention type: its groups and layers, and the blocks and bytes one sequence of
    `num_tokens` holds in them."""
    out: dict = {}
    for g in groups:
        row = out.setdefault(g.window, {"window": g.window, "groups": 0, "layers": 0, "blocks_per_seq": 0,
                                        "bytes_per_seq": 0})
        blocks = blocks_per_request(num_tokens, 0, block_size, 1, [g], chunk_tokens)
        row["groups"] += 1
        row["layers"] += g.size
        row["blocks_per_seq"] += blocks
        row["bytes_per_seq"] += blocks * block_size * bytes_per_token
    return list(out.values())


# ---- the plan -----------------------------------------------------------------------------
@dataclass
class ShapePlan:
    """The figures for one attention shape: the model's own, or its MHA / GQA / MQA variant."""

    label: str
    num_kv_heads: int
    weight_bytes: int
    activation_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    kv_formula: str
    num_blocks: int = 0
    token_slots: int = 0
    kv_pool_bytes: int = 0
    max_seqs_at_max_len: int = 0  # requests of width 1 filling max_model_len
    max_requests_at_max_len: int = 0  # average prompt, every branch running to max_model_len
    max_requests_at_avg: int = 0  # average prompt + average output per branch
    max_seqs_at_avg: int = 0  # max_requests_at_avg x width
    num_kv_groups: int = 1  # KV cache groups (hybrid models); bytes/token is then per block slot
    kv_groups: list[dict] = field(default_factory=list)  # group_summary at max_model_len
    error: str | None = None  # set when the shape does not fit at all


@dataclass
class MemoryPlan:
    model: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_parameters: int
    memory_bytes: int
    utilization: float
    usable_bytes: int
    dtype: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    width: int
    avg_prompt_len: int
    avg_output_len: int
    concurrency: int | None
    plan: ShapePlan
    weight_formats: dict[str, int] = field(default_factory=dict)  # GGUF type -> parameters kept quantized
    variants: list[ShapePlan] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def attention_variants(num_heads: int, num_kv_heads: int) -> list[tuple[str, int]]:
    """(label, kv_heads) for MHA, GQA and MQA versions of a shape with `num_heads` query heads.
    GQA is the model's own grouping if it has one, else the divisor of num_heads nearest
    num_heads / 4 (32 heads -> 8); a head count with no divisor between 1 and itself has none."""
    if 1 < num_kv_heads < num_heads:
        gqa = num_kv_heads
    else:
        divisors = [d for d in range(2, num_heads) if num_heads % d == 0]
        gqa = min(divisors, key=lambda d: (abs(d - num_heads / 4), d)) if divisors else None
    out = [("MHA", num_heads)]
    if gqa is not None:
        out.append(("GQA", gqa))
    out.append(("MQA", 1))
    return out


def _plan_shape(arch: ModelArchConfig, cfg: PlanConfig, label: str, max_model_len: int, prompt: int,
                output: int, bytes_per_param: float) -> ShapePlan:
    fmt = cfg.kv_format
    usable = int(cfg.memory * cfg.utilization)
    weights = int(count_parameters(arch) * bytes_per_param)
    act = activation_bytes(arch, cfg.dtype, cfg.max_num_batched_tokens, cfg.max_num_seqs, max_model_len)
    bs = cfg.block_size
    groups = (plan_kv_groups(arch.attention_windows(), bs) if cfg.kv_cache_groups
              else one_group(FullAttention(bs, arch.num_layers)))
    layers = layers_per_block(groups)
    bpt = fmt.bytes_per_token(layers, arch.num_kv_heads, arch.head_dim)
    formula = f"{fmt.formula(layers, arch.num_kv_heads, arch.head_dim)} = {bpt:,} bytes"
    # Sized per group where several tables share the blocks; one table counts every block of its
    # sequence (the plan has always sized a single table that way, window or not).
    split = groups if len(groups) > 1 else None
    if split:
        formula += f" per block slot ({len(groups)} KV cache groups of {layers} layers share the blocks)"
    sp = ShapePlan(label, arch.num_kv_heads, weights, act, usable - weights - act, bpt, formula,
                   num_kv_groups=len(groups))
    chunk = cfg.max_num_batched_tokens
    if split:
        sp.kv_groups = group_summary(groups, bs, bpt, max_model_len, chunk)
    if sp.kv_budget_bytes <= 0:
        sp.error = (f"memory={cfg.memory} bytes x utilization {cfg.utilization} = {usable:,} bytes does not hold "
                    f"the weights ({weights:,} bytes, {cfg.dtype}) and the activation reserve ({act:,} bytes)")
        return sp
    try:
        sp.num_blocks = kv_pool_blocks(sp.kv_budget_bytes, bpt, cfg.block_size, "memory")
    except ValueError as e:
        sp.error = f"after weights and activations, {e}"
        return sp
    sp.token_slots = sp.num_blocks * bs
    sp.kv_pool_bytes = sp.token_slots * bpt
    sp.max_seqs_at_max_len = sp.num_blocks // blocks_per_request(max_model_len, 0, bs, 1, split, chunk)
    sp.max_requests_at_max_len = sp.num_blocks // blocks_per_request(prompt, max_model_len - prompt, bs, cfg.width,
                                                                     split, chunk)
    sp.max_requests_at_avg = sp.num_blocks // blocks_per_request(prompt, output, bs, cfg.width, split, chunk)
    sp.max_seqs_at_avg = sp.max_requests_at_avg * cfg.width
    return sp


def plan_memory(arch: ModelArchConfig, cfg: PlanConfig, model: str = "") -> MemoryPlan:
    """The plan for `arch` under `cfg`; ValueError, naming the field, when the model's own shape
    does not fit or the lengths are inconsistent."""
    max_len = cfg.max_model_len or arch.max_position_embeddings
    prompt = cfg.avg_prompt_len if cfg.avg_prompt_len is not None else min(512, max_len // 2)
    output = cfg.avg_output_len if cfg.avg_output_len is not None else min(256, max_len - prompt)
    if prompt >= max_len:
        raise ValueError(f"avg_prompt_len={prompt} is invalid: must be below max_model_len={max_len}")
    if prompt + output > max_len:
        raise ValueError(f"avg_output_len={output} is invalid: avg_prompt_len {prompt} + avg_output_len {output} "
                         f"exceeds max_model_len={max_len}")
    # Other attention shapes are costed at the model's own bytes per parameter (exact for the
    # model; for a variant, its k/v projections are assumed stored like the rest).
    bytes_per_param = weight_bytes(arch, cfg.dtype, cfg.weight_formats) / count_parameters(arch)
    own = _plan_shape(arch, cfg, "model", max_len, prompt, output, bytes_per_param)
    if own.error is not None:
        raise ValueError(f"the model does not fit: {own.error}")
    variants = []
    for label, kvh in attention_variants(arch.num_heads, arch.num_kv_heads):
        if kvh == arch.num_kv_heads:
            label += " (model)"
        variants.append(_plan_shape(dataclasses.replace(arch, num_kv_heads=kvh), cfg, label, max_len, prompt, output,
                                    bytes_per_param))
    plan = MemoryPlan(
        model=model or arch.name, architecture=arch.architecture, num_layers=arch.num_layers,
        num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
        num_parameters=count_parameters(arch), memory_bytes=cfg.memory, utilization=cfg.utilization,
        usable_bytes=int(cfg.memory * cfg.utilization), dtype=cfg.dtype, kv_dtype=cfg.kv_format.name,
        block_size=cfg.block_size, max_model_len=max_len, width=cfg.width, avg_prompt_len=prompt,
        avg_output_len=output, concurrency=cfg.concurrency, plan=own, variants=variants,
        weight_formats=dict(cfg.weight_formats or {}),
    )
    if own.max_seqs_at_max_len == 0:
        plan.warnings.append(f"not one sequence of max_model_len={max_len} fits in the KV pool "
                             f"({own.token_slots} token slots): lower max_model_len or raise memory")
    if cfg.concurrency is not None and cfg.concurrency > own.max_requests_at_avg:
        plan.warnings.append(
            f"requested concurrency {cfg.concurrency} does not fit: at the average length (prompt {prompt} + "
            f"output {output}, width {cfg.width}) {own.max_requests_at_avg} requests fit, at max length "
            f"{own.max_requests_at_max_len}; the rest would wait or be preempted"
        )
    return plan


# ---- reading a model's shape without its weights ------------------------------------------------
def load_arch_config(model: str | os.PathLike[str] | None) -> tuple[ModelArchConfig, str]:
    """(architecture, resolved path) from a GGUF file's metadata, an HF directory's config.json,
    or a bare config.json file; None is the bundled model. No tensor data is read."""
    from kvshare.model.loader import ModelLoadError, _has_gguf_magic, resolve_model_path

    path = os.fspath(model) if model is not None else None
    if path is not None and os.path.isfile(path) and not _has_gguf_magic(path):
        return _arch_from_config_json(path), path
    kind, path = resolve_model_path(model)
    if kind == "hf":
        return _arch_from_config_json(os.path.join(path, "config.json")), path
    from kvshare.model import gguf_loader
    from kvshare.model.gguf_header import open_gguf_file, read_gguf_header

    header = read_gguf_header(path)
    if any(t.name == "rope_freqs.weight" for t in header.tensors):
        # llama3 rope factors are a tensor: the whole header, with the tensors mapped, to read it.
        header = open_gguf_file(path)
    return gguf_loader.config_from_gguf(header.metadata, header, path), path


def _arch_from_config_json(path: str) -> ModelArchConfig:
    from kvshare.model.families import REGISTRY
    from kvshare.model.hf_loader import config_from_hf
    from kvshare.model.loader import ModelLoadError

    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model={path!r} cannot be read as a config.json ({exc}).") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"model={path!r} is JSON but not a config object.")
    directory = os.path.dirname(os.path.abspath(path))
    if REGISTRY.by_hf_model_type(cfg.get("model_type")) is not None:
        return config_from_hf(cfg, directory)
    # Planning needs only the shape: other decoder families are read from the common HF keys,
    # and their weights counted with the Llama layout (an approximation for them).
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelArchConfig(
            architecture=str(cfg.get("model_type", "unknown")), vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=str(cfg.get("_name_or_path") or os.path.basename(directory)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"model={path!r}: config.json lacks the shape key {exc}.") from exc
