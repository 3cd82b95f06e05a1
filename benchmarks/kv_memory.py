"""Bounded KV memory: how many long requests a fixed KV budget holds, and what that buys.

Part 1, per KV format (bfloat16, int8, fp8_e4m3; the model in bfloat16): a fixed KV budget
(default 256 MiB), requests of a 4,096-token prompt + 512 generated tokens. Max concurrency comes
from the planner (`kvshare memory`'s code) and is checked against the engine's own pool; then that
many requests run at once and throughput is measured. On 2 CPU cores the full 512-token decode
takes minutes per format, so `--gen-tokens` (default 128) shortens the measured run; the
concurrency figures are always for the full 4,096 + 512. The configurations' engines are stepped
in turn, one step each, so background load on a shared machine hits them alike; times are each
engine's own step times (prefill-step s: steps that computed prompt tokens; decode tok/s: tokens
per second over the other steps; output / total tok/s: over all its steps).

Part 2, the seed's claim: KV slot utilization of the paged pool vs contiguous per-request
allocation at max length (HF static cache), on the mixed workload of benchmarks/offline_throughput.py
(64 requests, prompts 64-512, outputs 32-128, seed 0). Computed, not run: slots holding a token /
slots reserved, summed over every decode step of every request.

Part 4, hybrid KV cache groups (computed, not run): a Gemma 3 270M-shaped model (18 layers, 1 KV
head, head_dim 256, bfloat16 KV, window 512 on 5 of every 6 layers) with one block table for all
layers vs one per KV cache group (kvshare.kvcache.kv_groups): KV bytes per sequence and sequences
that fit a KV budget (--hybrid-budget, default 4 GiB) at 4k / 16k / 32k tokens (window groups at their bound with a prefill chunk
of max_num_batched_tokens = 2,048, what the engine's intake reserves).

Part 3 (--agreement): greedy agreement of bfloat16 / int8 / fp8_e4m3 caches with a float32 cache
(the model in float32), free-running and teacher-forced, with mean |logprob delta|
(kvshare.bench.agreement), on the test's prompt set and on three sets of longer prompts.

    python benchmarks/kv_memory.py                       # both parts, 128 generated tokens measured
    python benchmarks/kv_memory.py --gen-tokens 512      # the full decode (slow)
    python benchmarks/kv_memory.py --skip-throughput     # figures only, seconds
    python benchmarks/kv_memory.py --skip-throughput --agreement
    python benchmarks/kv_memory.py --hybrid-throughput   # part 5 alone (~3 minutes)

Part 5 (--hybrid-throughput): the real Gemma 3 270M with a small KV budget (default 160 MiB),
2,048-token prompts + 64 generated: as many requests at once as fit with one table and with
groups (part 4's arithmetic for this length and chunk), stepped in turn; decode tok/s over the
steps where every request decodes together.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

from kvshare import LLM, SamplingParams
from kvshare.bench import agreement as agreement_metrics
from kvshare.bench.workloads import token_prompts
from offline_throughput import mixed_pairs  # this directory: the mixed workload's lengths
from kvshare.config import parse_bytes
from kvshare.kvcache.kv_policy import SinkWindow
from kvshare.kvcache.kv_groups import plan_kv_groups
from kvshare.memory_plan import blocks_per_request, kv_pool_blocks, load_arch_config
from kvshare.model.kv_quant import resolve_kv_format

# One row per configuration. `blocks_per_request(prompt, output, block_size)` sizes a request in
# that configuration; None leaves the concurrency to the engine option's owner.
CONFIGS = [
    {"label": "bf16 KV", "kv_cache_dtype": "bfloat16", "engine": {}},
    {"label": "int8 KV", "kv_cache_dtype": "int8", "engine": {}},
    {"label": "fp8_e4m3 KV", "kv_cache_dtype": "fp8_e4m3", "engine": {}},
    # Issue 6 items 2-3: a decoding request holds block 0 (the sinks), the blocks reaching into the
    # last 1,024 positions and the block the next token starts (66 of 16 tokens), however long it
    # grows. A prefill chunk holds more while it runs (see docs/kv_policies.md); the scheduler
    # staggers admissions, so "peak running" is what actually ran at once.
    {"label": "bf16 KV; window 1024 + 4 sinks", "kv_cache_dtype": "bfloat16",
     "engine": {"kv_policy": "sink", "sink_tokens": 4, "window_tokens": 1024},
     "blocks_per_request": lambda prompt, output, bs: min(-(-(prompt + output) // bs),
                                                          SinkWindow(4, 1024, bs, prompt + output, 1).decode_blocks)},
]


def plan_row(cfg: dict, arch, budget: int, block_size: int, prompt: int, output: int) -> dict:
    from kvshare.model.kv_quant import resolve_kv_format

    fmt = resolve_kv_format(cfg["kv_cache_dtype"], "bfloat16")
    bpt = fmt.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim)
    blocks = kv_pool_blocks(budget, bpt, block_size)
    sizer = cfg.get("blocks_per_request", blocks_per_request)
    per_req = sizer(prompt, output, block_size) if sizer is not None else None
    return {"bytes_per_token": bpt, "blocks": blocks, "blocks_per_request": per_req,
            "concurrency": blocks // per_req if per_req else None}


class Run:
    """One configuration's engine and requests. Runs are stepped in turn (one step each, round
    robin), so every configuration sees the same background load on this shared machine."""

    def __init__(self, cfg: dict, plan: dict, concurrency: int, budget: int, prompt_len: int, max_len: int,
                 gen: int) -> None:
        self.llm = LLM(dtype="bfloat16", kv_cache_dtype=cfg["kv_cache_dtype"], kv_cache_memory=budget,
                       max_model_len=max_len, enable_prefix_caching=False, max_num_seqs=max(concurrency, 1),
                       **cfg["engine"])
        eng = self.engine = self.llm.engine
        # The engine's pool is the planner's: same bytes per token, same block count.
        assert eng.layout.num_blocks == plan["blocks"], (eng.layout.num_blocks, plan["blocks"])
        assert eng.layout.bytes_per_token == plan["bytes_per_token"]
        self.concurrency, self.prompt_len, self.gen = concurrency, prompt_len, gen
        prompts = token_prompts(eng.tokenizer.encode, [prompt_len] * concurrency, offset_step=37)
        self.llm.generate([{"prompt_token_ids": prompts[0][:64]}], SamplingParams(max_tokens=4), use_tqdm=False)
        eng.stats.peak_blocks_in_use = 0
        params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"kvmem-{i}", {"prompt_token_ids": p}, params)
        self.prefill_s = self.decode_s = 0.0
        self.decode_tokens = self.peak_running = 0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> tuple[float, int | None]:
        """One engine step: (seconds, decode tokens computed; None for a step with prompt tokens)."""
        eng = self.engine
        prompt0, decode0 = eng.stats.prompt_tokens_computed, eng.stats.decode_tokens_computed
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        self.peak_running = max(self.peak_running, len(eng.scheduler.running))
        decoded = None
        if eng.stats.prompt_tokens_computed > prompt0:
            self.prefill_s += dt  # steps computing prompt tokens (decode rows of earlier requests too)
        else:
            self.decode_s += dt
            decoded = eng.stats.decode_tokens_computed - decode0
            self.decode_tokens += decoded
        for o in outs:
            if o.finished:
                assert len(o.outputs[0].token_ids) == self.gen
        return dt, decoded

    def result(self) -> dict:
        busy = self.prefill_s + self.decode_s
        return {
            "prefill_seconds": self.prefill_s,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else float("nan"),
            "output_tok_s": self.concurrency * self.gen / busy,
            "total_tok_s": self.concurrency * (self.prompt_len + self.gen) / busy,
            "peak_running": self.peak_running,
            "peak_blocks": self.engine.stats.peak_blocks_in_use,
            "preemptions": self.engine.scheduler.num_preemptions,
        }


def measure_all(runs: list[Run]) -> list[dict]:
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step()
    return [r.result() for r in runs]


def slot_utilization(block_size: int, static_reserve: int, num: int = 64, seed: int = 0) -> dict:
    """Used / reserved token slots over every decode step of every request of the mixed workload.
    Paged: a request holds ceil(tokens / block_size) blocks at each step. Contiguous: it holds
    `static_reserve` slots from admission to finish, whatever its length."""
    pairs = mixed_pairs(num, seed)
    used = paged = static = 0
    for p, o in pairs:
        for t in range(p + 1, p + o + 1):  # tokens in the cache while decoding output t - p
            used += t
            paged += -(-t // block_size) * block_size
            static += static_reserve
    return {"used": used, "paged": used / paged, "static": used / static,
            "max_request_len": max(p + o for p, o in pairs)}


# (name, prompt lengths, offset step): the first is tests/test_kv_quant.py's set.
PROMPT_SETS = [("20-80 tokens, step 41 (the test's)", [20 + 4 * i for i in range(16)], 41)] + [
    (f"24-219 tokens, step {step}", [24 + 13 * i for i in range(16)], step) for step in (41, 17, 29)]


def agreement_table(num_tokens: int = 32) -> None:
    ref_llm = LLM(kv_cache_memory="128MiB", kv_cache_dtype="float32")  # "auto" is bfloat16 on avx512_bf16 CPUs
    encode = ref_llm.engine.tokenizer.encode
    refs = [(name, agreement_metrics.reference(ref_llm, token_prompts(encode, lengths, step), num_tokens))
            for name, lengths, step in PROMPT_SETS]
    del ref_llm
    print(f"\nGreedy agreement with a float32 cache (float32 model, 16 prompts x {num_tokens} tokens per set):")
    print("prompt set | KV cache | free-running | teacher-forced | mean abs logprob delta | max")
    print("---|---|---|---|---|---")
    for kv in ("bfloat16", "int8", "fp8_e4m3"):
        llm = LLM(kv_cache_memory="128MiB", kv_cache_dtype=kv)
        for name, ref in refs:
            a = agreement_metrics.agreement(llm, ref)
            print(f"{name} | {kv} | {a.free_running:.3f} | {a.teacher_forced:.3f} | "
                  f"{a.mean_abs_logprob_delta:.4f} | {a.max_abs_logprob_delta:.3f}", flush=True)
        del llm
        gc.collect()


# Gemma 3 270M's attention shape: what KV cache groups are for (5 local : 1 global layers).
GEMMA3_270M = {"num_layers": 18, "num_kv_heads": 1, "head_dim": 256, "window": 512, "pattern": 6}


def hybrid_groups_table(budget: int, block_size: int, lengths=(4096, 16384, 32768), chunk_tokens: int = 2048,
                        shape: dict = GEMMA3_270M, kv_dtype: str = "bfloat16") -> list[dict]:
    """Per length: KV bytes per sequence and sequences that fit `budget`, one table vs groups."""
    n, p = shape["num_layers"], shape["pattern"]
    windows = [None if (i + 1) % p == 0 else shape["window"] for i in range(n)]
    groups = plan_kv_groups(windows, block_size)
    fmt = resolve_kv_format(kv_dtype, "bfloat16")
    flat_bpt = fmt.bytes_per_token(n, shape["num_kv_heads"], shape["head_dim"])
    group_bpt = fmt.bytes_per_token(groups[0].size, shape["num_kv_heads"], shape["head_dim"])
    flat_pool = kv_pool_blocks(budget, flat_bpt, block_size)
    group_pool = kv_pool_blocks(budget, group_bpt, block_size)
    rows = []
    for length in lengths:
        flat_blocks = blocks_per_request(length, 0, block_size)
        group_blocks = blocks_per_request(length, 0, block_size, 1, groups, chunk_tokens)
        rows.append({"length": length, "ungrouped_bytes": flat_blocks * block_size * flat_bpt,
                     "grouped_bytes": group_blocks * block_size * group_bpt,
                     "ungrouped_fit": flat_pool // flat_blocks, "grouped_fit": group_pool // group_blocks})
    return rows


class HybridRun(Run):
    """Gemma 3 270M (the packaged model, kept quantized) with KV cache groups on or off: as many
    requests as fit the budget at once, each `prompt_len` tokens then `gen` greedy tokens."""

    def __init__(self, grouped: bool, concurrency: int, budget: int, prompt_len: int, gen: int,
                 chunk_tokens: int, block_size: int) -> None:
        self.llm = LLM(model="gemma3-270m", kv_cache_dtype="bfloat16", kv_cache_memory=budget,
                       max_model_len=prompt_len + gen, enable_prefix_caching=False, max_num_seqs=concurrency,
                       max_num_batched_tokens=chunk_tokens, block_size=block_size, kv_cache_groups=grouped)
        self.engine = self.llm.engine
        self.concurrency, self.gen = concurrency, gen
        prompts = token_prompts(self.engine.tokenizer.encode, [prompt_len] * concurrency, offset_step=37)
        params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.engine.add_request(f"hybrid-{i}", {"prompt_token_ids": p}, params)
        self.prefill_s = self.decode_s = 0.0
        self.decode_tokens = self.peak_running = self.full_batch_steps = 0
        self.full_batch_s = 0.0

    def step(self) -> tuple[float, int | None]:
        dt, decoded = super().step()
        if decoded == self.concurrency:  # every request decoding at once: the batch the budget allows
            self.full_batch_steps += 1
            self.full_batch_s += dt
        return dt, decoded

    def result(self) -> dict:
        return {"prefill_seconds": self.prefill_s, "peak_running": self.peak_running,
                "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else float("nan"),
                "full_batch_tok_s": (self.full_batch_steps * self.concurrency / self.full_batch_s
                                     if self.full_batch_s else float("nan")),
                "full_batch_steps": self.full_batch_steps,
                "preemptions": self.engine.scheduler.num_preemptions}


def hybrid_throughput(budget: int, prompt_len: int, gen: int, chunk_tokens: int, block_size: int) -> None:
    """Part 5: decode throughput at the largest batch that fits, grouped vs one table."""
    fit = hybrid_groups_table(budget, block_size, lengths=(prompt_len + gen,), chunk_tokens=chunk_tokens)[0]
    runs = {"one table": HybridRun(False, fit["ungrouped_fit"], budget, prompt_len, gen, chunk_tokens, block_size),
            "groups": HybridRun(True, fit["grouped_fit"], budget, prompt_len, gen, chunk_tokens, block_size)}
    results = measure_all(list(runs.values()))
    print(f"\nGemma 3 270M (packaged Q4_K_M, kept quantized), bfloat16 KV, {budget / 2**20:.0f} MiB budget, "
          f"{prompt_len} prompt + {gen} generated tokens per request, chunk {chunk_tokens}, block size {block_size}:")
    print("KV layout | requests at once (fit) | peak running | preempt | prefill-step s | decode tok/s (all decode "
          "steps) | decode tok/s (full-batch steps) | full-batch steps")
    print("---|---|---|---|---|---|---|---")
    for (label, run), m in zip(runs.items(), results):
        print(f"{label} | {run.concurrency} | {m['peak_running']} | {m['preemptions']} | {m['prefill_seconds']:.1f} | "
              f"{m['decode_tok_s']:.1f} | {m['full_batch_tok_s']:.1f} | {m['full_batch_steps']}", flush=True)
    a, b = results
    print(f"groups / one table, decode tok/s at the full batch: {b['full_batch_tok_s'] / a['full_batch_tok_s']:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-budget", default="256MiB")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=512, help="generated tokens the concurrency is sized for")
    ap.add_argument("--gen-tokens", type=int, default=128, help="generated tokens in the measured run")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--configs", default="bf16 KV,int8 KV,fp8_e4m3 KV,bf16 KV; window 1024 + 4 sinks",
                    help="comma-separated labels from CONFIGS to measure")
    ap.add_argument("--sink-concurrency", type=int, default=None,
                    help="requests to run for the window + sinks row instead of its planned max concurrency")
    ap.add_argument("--hybrid-budget", default="4GiB", help="KV budget of part 4 (hybrid KV cache groups)")
    ap.add_argument("--hybrid-throughput", action="store_true",
                    help="only part 5: Gemma 3 270M decode throughput at the largest batch, grouped vs one table")
    ap.add_argument("--hybrid-throughput-budget", default="160MiB")
    ap.add_argument("--hybrid-prompt-len", type=int, default=2048)
    ap.add_argument("--hybrid-gen-tokens", type=int, default=64)
    ap.add_argument("--hybrid-chunk", type=int, default=512, help="max_num_batched_tokens of part 5")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--agreement", action="store_true", help="also part 3: greedy agreement of the KV formats")
    args = ap.parse_args(argv)

    if args.hybrid_throughput:
        hybrid_throughput(parse_bytes(args.hybrid_throughput_budget, "--hybrid-throughput-budget"),
                          args.hybrid_prompt_len, args.hybrid_gen_tokens, args.hybrid_chunk, args.block_size)
        return 0
    budget = parse_bytes(args.kv_budget, "--kv-budget")
    arch, _ = load_arch_config(None)
    max_len = args.prompt_len + args.output_len
    wanted = {s.strip() for s in args.configs.split(",")}
    if args.sink_concurrency:
        wanted.add(CONFIGS[3]["label"])
    print(f"KV budget {budget / 2**20:.0f} MiB, requests of {args.prompt_len} prompt + {args.output_len} generated "
          f"tokens, block size {args.block_size}, model in bfloat16; measured runs generate {args.gen_tokens} tokens")
    header = ("config", "KV B/token", "pool blocks", "blocks/request", "max concurrency", "peak running",
              "preempt", "prefill-step s", "decode tok/s", "output tok/s", "total tok/s")
    print(" | ".join(header))
    print("|".join("---" for _ in header), flush=True)
    rows, runs = [], []
    for cfg in CONFIGS:
        plan = plan_row(cfg, arch, budget, args.block_size, args.prompt_len, args.output_len)
        conc = args.sink_concurrency if args.sink_concurrency and cfg is CONFIGS[3] else plan["concurrency"]
        row = [cfg["label"], f"{plan['bytes_per_token']:,}", f"{plan['blocks']:,}",
               str(plan["blocks_per_request"] or "hook"), str(plan["concurrency"] or "hook")]
        rows.append(row)
        if args.skip_throughput or cfg["label"] not in wanted or not conc:
            row += ["-"] * 6
            continue
        try:
            runs.append((row, Run(cfg, plan, conc, budget, args.prompt_len, max_len, args.gen_tokens)))
        except (TypeError, ValueError) as e:  # e.g. an engine option that does not exist yet
            row += [f"not run: {e}"] + ["-"] * 5
    for (row, _), m in zip(runs, measure_all([r for _, r in runs])):
        row += [str(m["peak_running"]), str(m["preemptions"]), f"{m['prefill_seconds']:.1f}",
                f"{m['decode_tok_s']:.1f}", f"{m['output_tok_s']:.2f}", f"{m['total_tok_s']:.1f}"]
    for row in rows:
        print(" | ".join(row), flush=True)

    u_model = slot_utilization(args.block_size, arch.max_position_embeddings)
    u_work = slot_utilization(args.block_size, slot_utilization(args.block_size, 1)["max_request_len"])
    print()
    print(f"KV slot utilization on the mixed workload (64 requests, prompts 64-512, outputs 32-128, seed 0), "
          f"used / reserved slots over all decode steps:")
    print(f"  paged, block size {args.block_size}: {u_model['paged']:.3f}")
    print(f"  contiguous, reserved at the model's max length {arch.max_position_embeddings}: {u_model['static']:.3f}")
    print(f"  contiguous, reserved at the workload's longest request {u_work['max_request_len']}: {u_work['static']:.3f}")
    print()
    hybrid_budget = parse_bytes(args.hybrid_budget, "--hybrid-budget")
    print(f"Hybrid KV cache groups, Gemma 3 270M shape (18 layers, 1 KV head, head_dim 256, window 512, 5:1), "
          f"bfloat16 KV, {hybrid_budget / 2**20:.0f} MiB budget, block size {args.block_size}:")
    print("length | KV MiB/seq one table | KV MiB/seq groups | seqs fit one table | seqs fit groups | ratio")
    print("---|---|---|---|---|---")
    for r in hybrid_groups_table(hybrid_budget, args.block_size):
        ratio = r["grouped_fit"] / r["ungrouped_fit"] if r["ungrouped_fit"] else float("inf")
        print(f"{r['length']} | {r['ungrouped_bytes'] / 2**20:.1f} | {r['grouped_bytes'] / 2**20:.1f} | "
              f"{r['ungrouped_fit']} | {r['grouped_fit']} | {ratio:.2f}x")
    if args.agreement:
        agreement_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
