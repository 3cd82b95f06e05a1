"""`kvshare memory`: the memory planner on the command line (figures in kvshare.memory_plan).

The planner is imported when the command runs, not when the parser is built. The defaults the
planner shares with the engine (block size, KV dtype, batch limits) come from EngineConfig.
"""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from kvshare.config import engine_default

if TYPE_CHECKING:
    from kvshare.memory_plan import MemoryPlan


def add_memory_parser(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("memory", help="plan KV memory: weights, activations, KV pool, sequences that fit")
    m.add_argument("--model", default=engine_default("model"),
                   help="GGUF file, HF directory, bare config.json or gemma3-270m (default: bundled SmolLM2-135M-Instruct)")
    m.add_argument("--memory", default=None, help="total budget, e.g. 24GiB (default: available host memory)")
    m.add_argument("--utilization", type=float, default=0.9, help="fraction of --memory to use (default 0.9)")
    m.add_argument("--dtype", default="float32", help="weights and activations: float32, bfloat16, float16")
    m.add_argument("--quantization", default=engine_default("quantization"), choices=["auto", "none"],
                   help="auto (the engine default): GGUF matrices counted at the bytes kvshare keeps them in; "
                        "none: every weight dequantized to --dtype")
    m.add_argument("--kv-dtype", default=engine_default("kv_cache_dtype"), help="KV cache storage: auto (= --dtype; bfloat16 for --dtype float32 --quantization auto on CPUs with avx512_bf16), float32, bfloat16, float16, int8, fp8_e4m3")
    m.add_argument("--block-size", type=int, default=engine_default("block_size"))
    m.add_argument("--max-model-len", type=int, default=engine_default("max_model_len"), help="default: the model's context length")
    m.add_argument("--n", "--beam-width", dest="width", type=int, default=1,
                   help="branches per request sharing one prompt (n > 1 or beam width)")
    m.add_argument("--avg-prompt-len", type=int, default=None)
    m.add_argument("--avg-output-len", type=int, default=None)
    m.add_argument("--concurrency", type=int, default=None, help="requests wanted in flight: warn if they do not fit")
    m.add_argument("--max-num-batched-tokens", type=int, default=engine_default("max_num_batched_tokens"))
    m.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"))
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=run)
    return m


def run(args: argparse.Namespace) -> int:
    from kvshare.config import resolve_kv_cache_dtype, resolve_prefill_dtype
    from kvshare.memory_plan import PlanConfig, load_arch_config, plan_memory

    cfg = PlanConfig(
        memory=args.memory, utilization=args.utilization, dtype=args.dtype, kv_dtype=args.kv_dtype,
        block_size=args.block_size, max_model_len=args.max_model_len, width=args.width,
        avg_prompt_len=args.avg_prompt_len, avg_output_len=args.avg_output_len, concurrency=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
    )
    arch, path = load_arch_config(args.model)
    if args.quantization == "auto" and _is_gguf(path):
        from kvshare.memory_plan import gguf_weight_formats

        cfg.weight_formats = gguf_weight_formats(path)
    # "auto" as the engine resolves it once the weights are loaded (EngineConfig.settle_for_weights):
    # bfloat16 K/V only where matrices stay quantized under float32 activations on avx512_bf16 CPUs.
    kept = "auto" if cfg.weight_formats else None
    cfg.kv_dtype = resolve_kv_cache_dtype(args.kv_dtype, args.dtype, resolve_prefill_dtype("auto", args.dtype, kept))
    plan = plan_memory(arch, cfg, model=path)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render(plan))
    return 0


def _is_gguf(path: str) -> bool:
    from kvshare.model.loader import _has_gguf_magic

    return _has_gguf_magic(path)


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:,.1f} MiB)"


def render(p: MemoryPlan) -> str:
    s = p.plan
    kind = "MHA" if p.num_kv_heads == p.num_heads else "MQA" if p.num_kv_heads == 1 else "GQA"
    rows = [
        ("model", f"{p.model}"),
        ("shape", f"{p.architecture}: {p.num_layers} layers, {p.num_heads} heads, {p.num_kv_heads} kv heads ({kind}), "
                  f"head_dim {p.head_dim}, hidden {p.hidden_size}, intermediate {p.intermediate_size}, "
                  f"vocab {p.vocab_size}"),
        ("memory", f"{p.memory_bytes:,} bytes x utilization {p.utilization} = {_mib(p.usable_bytes)}"),
        ("weights", _weights_line(p)),
        ("activation reserve", _mib(s.activation_bytes)),
        ("KV budget", f"usable - weights - activations = {_mib(s.kv_budget_bytes)}"),
        ("KV bytes per token", s.kv_formula),
        *[(f"KV group {'global' if g['window'] is None else 'window ' + str(g['window'])}",
           f"{g['groups']} group(s), {g['layers']} layers: {g['blocks_per_seq']:,} blocks = "
           f"{_mib(g['bytes_per_seq'])} per sequence of max_model_len={p.max_model_len}") for g in s.kv_groups],
        ("KV pool", f"{s.num_blocks:,} blocks x {p.block_size} tokens = {s.token_slots:,} token slots, "
                    f"{_mib(s.kv_pool_bytes)}"),
        ("at max length", f"{s.max_seqs_at_max_len:,} sequences of max_model_len={p.max_model_len}"
                          + (f"; {s.max_requests_at_max_len:,} requests of width {p.width} (prompt {p.avg_prompt_len}"
                             f" shared, each branch to {p.max_model_len})" if p.width > 1 else "")),
        ("at average length", f"{s.max_requests_at_avg:,} requests ({s.max_seqs_at_avg:,} sequences) of prompt "
                              f"{p.avg_prompt_len} + output {p.avg_output_len}, width {p.width}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", _variants_table(p)]
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def _weights_line(p: MemoryPlan) -> str:
    s = p.plan
    if not p.weight_formats:
        return (f"{p.num_parameters:,} parameters x {s.weight_bytes // p.num_parameters} bytes ({p.dtype}) = "
                f"{_mib(s.weight_bytes)}")
    from kvshare.model.qlinear import resident_bytes_per_weight

    parts = [f"{t} {n:,} x {resident_bytes_per_weight(t):.3g} B" for t, n in p.weight_formats.items()]
    rest = p.num_parameters - sum(p.weight_formats.values())
    return f"kept quantized: {', '.join(parts)}; dense {max(rest, 0):,} x {p.dtype} = {_mib(s.weight_bytes)}"


def _variants_table(p: MemoryPlan) -> str:
    cols = p.variants
    fields = [
        ("kv_heads", lambda v: str(v.num_kv_heads)),
        ("KV bytes/token", lambda v: f"{v.kv_bytes_per_token:,}"),
        ("weights MiB", lambda v: f"{v.weight_bytes / 2**20:,.1f}"),
        ("KV pool tokens", lambda v: f"{v.token_slots:,}" if v.error is None else "does not fit"),
        (f"seqs @ max len {p.max_model_len}", lambda v: f"{v.max_seqs_at_max_len:,}" if v.error is None else "-"),
        ("requests @ avg len", lambda v: f"{v.max_requests_at_avg:,}" if v.error is None else "-"),
    ]
    head = ["attention variant"] + [v.label for v in cols]
    body = [[name] + [fn(v) for v in cols] for name, fn in fields]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [head] + body)
