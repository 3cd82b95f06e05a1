"""KV tiers under the pool (docs/kv_tiers.md): time to first token of returning conversations with
and without the host-RAM and disk tiers, and the first request after a restart vs cold.

A multi-turn chat workload: C conversations take turns round-robin; each turn is the whole
history so far (earlier turns' prompts and replies) plus a new user message, as a chat client
sends it. The pool is sized to hold less than the conversations' history, so a conversation that
comes back has lost its blocks from the pool: without tiers its history is recomputed, with them
it is loaded back from RAM (or disk). Half way through, both engines are restarted (new engines;
the tiered one on the same disk directory and hash seed, after a clean shutdown), each warmed up
with one short unrelated request; the first returning conversation's TTFT with the disk tier is
compared with the cold engine's. Requests run one at a time, so a TTFT is one request's alone. Greedy,
so both engines must produce the same tokens (checked: the default mode is bit-transparent).

    python benchmarks/tiered_cache.py                      # the bundled model, small settings
    python benchmarks/tiered_cache.py --model bench_out/real_shapes/llama-3.2-1b-Q4_K_M.gguf \\
        --conversations 8 --turns 4 --user-tokens 400 --reply-tokens 32 --kv-cache-memory 64MiB \\
        --kv-host-memory 2GiB

With --llama-server PATH the same returning requests (the same token ids, in the same order) also
go to llama.cpp's llama-server with --cache-ram (its host-RAM prompt cache, the kvshare RAM tier's
budget), one slot; its TTFT is the request's wall time less its generated tokens after the first
(its own per-token timing). llama-server's cache does not survive a restart: no restart row for it.

Numbers are meaningful on a quiet machine only (nothing else running).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvshare import LLM, SamplingParams  # noqa: E402
from kvshare.bench.workloads import ENGLISH_TEXT  # noqa: E402
from kvshare.config import parse_bytes  # noqa: E402
from kvshare.model.loader import bundled_model_path  # noqa: E402
from kvshare.testing.ports import free_port  # noqa: E402


def conversations_text(llm: LLM, num: int, user_tokens: int, turns: int) -> list[list[list[int]]]:
    """Each conversation's user messages (token ids), cut from the real text at different offsets
    and re-ordered per conversation, so no two conversations share a block."""
    base = llm.engine.tokenize(ENGLISH_TEXT)
    need = user_tokens * turns
    text = list(base)
    while len(text) < need * 2:
        text += base[::-1] if len(text) // len(base) % 2 else base
    out = []
    for c in range(num):
        start = (c * 131) % max(1, len(text) - need)
        msgs = [text[start + t * user_tokens:start + (t + 1) * user_tokens] for t in range(turns)]
        out.append([[(tok + c) % len(base) if c else tok for tok in m] for m in msgs])
    return out


def one(llm: LLM, prompt: list[int], reply_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT seconds, reply tokens, prompt tokens served from a cache) of one request alone."""
    params = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ttft = out.metrics.time_to_first_token if out.metrics.time_to_first_token else time.perf_counter() - t0
    return ttft, list(out.outputs[0].token_ids), out.num_cached_tokens


def build(args, tiers: bool, disk: str) -> LLM:
    opts = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    if tiers:
        opts.update(kv_host_memory=args.kv_host_memory, kv_disk_path=disk, kv_disk_size=args.kv_disk_size,
                    prefix_caching_hash_seed="tiered-cache-benchmark")
    return LLM(**opts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or model directory (default: the bundled model)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="8MiB", help="the pool: smaller than the conversations' history")
    ap.add_argument("--kv-host-memory", default="256MiB")
    ap.add_argument("--kv-disk-size", default="2GiB")
    ap.add_argument("--kv-disk-path", default=None, help="default: a new temporary directory, removed after")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="also time llama.cpp's llama-server --cache-ram on the same requests")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    disk = args.kv_disk_path or tempfile.mkdtemp(prefix="kvshare-tiers-")
    try:
        return run(args, disk)
    finally:
        if args.kv_disk_path is None:
            shutil.rmtree(disk, ignore_errors=True)


def run(args, disk: str) -> int:
    plain = build(args, False, disk)
    tiered = build(args, True, disk)
    convs = conversations_text(plain, args.conversations, args.user_tokens, args.turns)
    warmup = [(t + 7) % 1000 for t in convs[0][0][:16]]  # shares no block with any conversation
    one(plain, warmup, 1)  # warm-up: kernels, threads
    one(tiered, warmup, 1)
    history: dict[str, list[list[int]]] = {"plain": [[] for _ in convs], "tiered": [[] for _ in convs]}
    ttft: dict[str, list[float]] = {"plain": [], "tiered": []}
    hit_tokens = {"plain": 0, "tiered": 0}
    # Per returning request with tiers: prompt tokens / tokens it still computed (its new message):
    # the most any cache can speed it up while compute grows with the tokens computed.
    bounds: list[float] = []
    same = True
    returning: list[list[int]] = []  # the returning requests, in order (for llama-server)
    restart_turn = args.turns // 2
    restart: dict = {}
    for turn in range(args.turns):
        if turn == restart_turn and turn > 0:  # both engines restart: a cold one, and one with its disk tier
            tiered.engine.close()
            plain.engine.close()
            del tiered, plain
            gc.collect()
            t0 = time.perf_counter()
            tiered = build(args, True, disk)
            restart["start_seconds"] = time.perf_counter() - t0
            plain = build(args, False, disk)
            for llm in (plain, tiered):  # a first step's one-off costs (threads, first pages), not the cache's
                one(llm, warmup, 1)
        for c, msgs in enumerate(convs):
            replies = {}
            for name, llm in (("plain", plain), ("tiered", tiered)):
                prompt = history[name][c] + msgs[turn]
                if name == "plain" and turn > 0:
                    returning.append(prompt)
                t, reply, cached = one(llm, prompt, args.reply_tokens)
                replies[name] = reply
                history[name][c] = prompt + reply
                if turn > 0:  # a returning conversation
                    ttft[name].append(t)
                    hit_tokens[name] += cached
                    if name == "tiered":
                        bounds.append(len(prompt) / max(1, len(prompt) - cached))
                if turn == restart_turn and turn > 0 and c == 0:
                    restart[f"first_after_restart_ttft_{name}"] = t
                    restart[f"first_after_restart_cached_tokens_{name}"] = cached
                    restart["first_after_restart_prompt_tokens"] = len(prompt)
            same = same and replies["plain"] == replies["tiered"]

    stats = tiered.engine.status()
    med = {k: statistics.median(v) if v else float("nan") for k, v in ttft.items()}
    result = {
        "workload": {"conversations": args.conversations, "turns": args.turns, "user_tokens": args.user_tokens,
                     "reply_tokens": args.reply_tokens, "pool": args.kv_cache_memory,
                     "host_memory": args.kv_host_memory, "model": plain.engine.model_source,
                     "restart_before_turn": restart_turn},
        "returning_ttft_median_s": med,
        "returning_ttft_speedup": med["plain"] / med["tiered"] if med["tiered"] else float("nan"),
        "returning_cached_tokens": hit_tokens,
        "returning_speedup_bound_median": statistics.median(bounds) if bounds else float("nan"),
        "restart": {**restart, "speedup_vs_cold": (restart.get("first_after_restart_ttft_plain", float("nan"))
                                                   / restart.get("first_after_restart_ttft_tiered", float("nan")))},
        "tier_blocks": {"ram": stats.tiers.get("ram_blocks", 0), "disk": stats.tiers.get("disk_blocks", 0),
                        "tier_hit_tokens_since_restart": stats.tiers.get("hit_tokens", 0)},
        "same_tokens_with_and_without_tiers": same,
    }
    if args.llama_server:
        llama = llama_server_ttft(args, [msgs[0] for msgs in convs], returning)
        result["llama_server_cache_ram"] = llama
        result["returning_ttft_vs_llama_server"] = llama["returning_ttft_median_s"] / med["tiered"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        w = result["workload"]
        print(f"workload: {w['conversations']} conversations x {w['turns']} turns ({w['user_tokens']} user + "
              f"{w['reply_tokens']} reply tokens a turn), pool {w['pool']}, host tier {w['host_memory']}, "
              f"restart before turn {w['restart_before_turn']}, {w['model']}")
        print(f"returning conversations, median TTFT: without tiers {med['plain'] * 1e3:.1f} ms, with tiers "
              f"{med['tiered'] * 1e3:.1f} ms ({result['returning_ttft_speedup']:.2f}x); prompt tokens from cache "
              f"{hit_tokens['plain']} vs {hit_tokens['tiered']}; bound (prompt / tokens still computed, median) "
              f"{result['returning_speedup_bound_median']:.2f}x")
        if restart:
            print(f"first request after the restart: {restart['first_after_restart_ttft_tiered'] * 1e3:.1f} ms vs cold "
                  f"{restart['first_after_restart_ttft_plain'] * 1e3:.1f} ms ({result['restart']['speedup_vs_cold']:.2f}x;"
                  f" {restart['first_after_restart_cached_tokens_tiered']} of "
                  f"{restart['first_after_restart_prompt_tokens']} prompt tokens from the disk tier); engine start "
                  f"{restart['start_seconds']:.2f} s")
        print(f"same tokens with and without tiers: {same}")
        if args.llama_server:
            ll = result["llama_server_cache_ram"]
            print(f"llama-server --cache-ram {ll['cache_ram_mib']} MiB, returning conversations, median TTFT "
                  f"{ll['returning_ttft_median_s'] * 1e3:.1f} ms (kvshare with tiers: "
                  f"{result['returning_ttft_vs_llama_server']:.2f}x faster); prompt tokens from its cache "
                  f"{ll['cached_tokens']}")
    return 0 if same else 1


def llama_server_ttft(args, first_turn: list[list[int]], returning: list[list[int]]) -> dict:
    """The returning requests' TTFT on llama-server with --cache-ram (after each conversation's
    first turn, in the workload's order), one slot."""
    from serve_vs_hf import Server

    cache_mib = parse_bytes(args.kv_host_memory, "kv_host_memory") // 2**20
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="kvshare-tiers-llama-")
    cmd = [args.llama_server, "-m", args.model or bundled_model_path(), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-np", "1", "-c", str(args.max_model_len), "--cache-ram", str(cache_mib)]
    srv = Server("llama-server", cmd, port, "/health", log_dir, dict(os.environ))
    try:
        srv.wait_ready()

        def complete(prompt: list[int]) -> tuple[float, int]:
            body = json.dumps({"prompt": prompt, "n_predict": args.reply_tokens, "temperature": 0,
                               "cache_prompt": True, "ignore_eos": True}).encode()
            req = urllib.request.Request(srv.url + "/completion", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            wall = time.perf_counter() - t0
            t = out.get("timings", {})
            later = max(0, t.get("predicted_n", 1) - 1) * t.get("predicted_per_token_ms", 0.0) / 1e3
            return wall - later, len(prompt) - int(t.get("prompt_n", len(prompt)))

        complete(first_turn[0][:16])  # warm-up
        for prompt in first_turn:
            complete(prompt)
        ttfts, cached = [], 0
        for prompt in returning:
            t, c = complete(prompt)
            ttfts.append(t)
            cached += c
    finally:
        srv.stop()
    return {"cache_ram_mib": cache_mib, "returning_ttft_median_s": statistics.median(ttfts), "cached_tokens": cached}


if __name__ == "__main__":
    sys.exit(main())
