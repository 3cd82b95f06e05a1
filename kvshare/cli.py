"""Command line: `kvshare generate`, `kvshare info`, `kvshare memory`, `kvshare cache`."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from kvshare.bench.serve import add_bench_parser
from kvshare.cache_cli import add_cache_parser
from kvshare.doctor_cli import add_doctor_parsers
from kvshare.engine_args import add_engine_args, engine_options
from kvshare.memory_cli import add_memory_parser
from kvshare.server.cli import add_serve_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from kvshare import LLM, SamplingParams

    llm = LLM(**engine_options(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Hello, my name is"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            if len(prompts) > 1:
                print(f"### {prompt}")
            print(c.text if args.chat else prompt + c.text)
            m = out.metrics
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                  f"ttft={m.time_to_first_token:.3f}s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvshare.config import EngineConfig
    from kvshare.engine.llm_engine import LLMEngine
    from kvshare.kvcache.kv_groups import layers_per_block

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_options(args)))
    mc, lay = engine.model_config, engine.layout
    info = {
        "model": engine.model_source,
        "architecture": mc.architecture,
        "layers": mc.num_layers, "hidden_size": mc.hidden_size, "heads": mc.num_heads,
        "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab_size": mc.vocab_size,
        "max_position_embeddings": mc.max_position_embeddings, "dtype": engine.config.dtype,
        "quantization": engine.config.quantization or "none",
        "tensor_formats": engine.startup.format_mix(),
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        # With tensor parallelism, rank 0's shard (each rank holds its own).
        "resident_weight_bytes": engine.model.weight_bytes,
        "resident_weight_bytes_by_kernel": engine.startup.weight_bytes_by_kind(),
        "kv_cache_dtype": lay.dtype,
        "kv_bytes_per_token": lay.bytes_per_token,
        "kv_bytes_formula": engine.config.kv_format.formula(
            layers_per_block(engine.kv_groups), mc.num_kv_heads, mc.head_dim),
        "block_size": lay.block_size, "num_blocks": lay.num_blocks, "token_slots": lay.num_slots,
        "kv_pool_bytes": lay.pool_bytes, "max_model_len": lay.max_model_len,
        "max_len_sequences_that_fit": round(lay.max_len_seqs, 2),
    }
    tiers = engine.status().tiers
    if engine.config.kv_host_memory is not None:
        info["kv_tier_host_memory"] = f"{tiers['ram_capacity_blocks']} blocks ({engine.config.kv_host_memory} bytes)"
    if engine.config.kv_disk_path is not None:
        info["kv_tier_disk"] = (f"{engine.config.kv_disk_path}: {tiers['disk_capacity_blocks']} blocks "
                                f"({engine.config.kv_disk_size} bytes), {tiers['disk_blocks']} kept")
    if lay.num_kv_groups > 1:  # several tables share the blocks: say how
        from kvshare.memory_plan import group_summary

        info["kv_cache_groups"] = len(engine.kv_groups)
        info["kv_bytes_formula"] += f" per block slot ({layers_per_block(engine.kv_groups)} layers of one group)"
        for g in group_summary(engine.kv_groups, lay.block_size, lay.bytes_per_token, lay.max_model_len,
                               engine.config.max_num_batched_tokens):
            kind = "global" if g["window"] is None else f"window_{g['window']}"
            info[f"kv_group_{kind}"] = (f"{g['groups']} group(s), {g['layers']} layers, {g['blocks_per_seq']} blocks "
                                        f"= {g['bytes_per_seq']} bytes per max_model_len sequence")
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvshare import __version__

    parser = argparse.ArgumentParser(prog="kvshare", description="kvshare LLM inference engine")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (prompt = user message)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="model shape, KV layout and memory figures")
    i.add_argument("--json", action="store_true")
    add_engine_args(i)
    i.set_defaults(func=cmd_info)

    add_memory_parser(sub)
    add_cache_parser(sub)
    add_doctor_parsers(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
