"""Data-parallel routing: prefix_aware vs round_robin vs least_loaded on a multi-tenant workload,
with one replica as the hit-rate reference (issue 14: prefix-aware's hit rate within 5 points of
one replica's, and total throughput >= 1.2x round-robin's).

Workload: --tenants system prompts of ~--system-tokens tokens (8 x ~400 by default), each asked
--requests-per-tenant questions (16), all in one random order (--seed), sent as streamed chat
completions through the real server, --concurrency at a time (closed loop), --max-tokens each
(ignore_eos). Every policy gets a fresh `kvshare serve --data-parallel-size 2` (so no run
inherits a warm cache), the reference a fresh single-replica `kvshare serve`.

Memory: each replica gets --kv-cache-memory-per-replica (120MiB by default: about 170 blocks of
the bundled model, room for roughly half the tenants' prefixes besides the running requests);
the single replica gets the replicas' total, so every run has the same KV memory. Under that
pressure round-robin spreads every tenant over both replicas and they evict each other, while
prefix-aware keeps each tenant on one. With pools large enough for every prefix everywhere the
policies' hit rates converge and only the cold misses differ.

Reported per run: prefix-cache hit rate (the replicas' own vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total over the run), total tok/s (prompt + generated tokens / wall
time), TTFT p50/p99 (arrival at the front end to the first content chunk, client side), and for
the data-parallel runs the ratios to round-robin.

The full run (the lead records it on a quiet machine):

    python benchmarks/routing.py --json benchmarks/results/routing.json

A smoke run (seconds of work, numbers meaningless):

    python benchmarks/routing.py --tenants 2 --requests-per-tenant 2 --system-tokens 64 --max-tokens 2 --concurrency 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.model.loader import load_tokenizer
from kvshare.testing.ports import free_port

POLICIES = ("prefix_aware", "round_robin", "least_loaded")


def tenant_prompts(tokenizer, tenants: int, system_tokens: int) -> list[str]:
    """One system prompt per tenant, ~system_tokens long, different from its first block on."""
    words = ENGLISH_TEXT.split()
    out = []
    for t in range(tenants):
        rotated = words[(t * 37) % len(words):] + words[:(t * 37) % len(words)]
        text = f"You are the support assistant of customer {t}. Follow these notes:"
        i = 0
        while len(tokenizer.encode(text)) < system_tokens:
            text += " " + " ".join(rotated[i % len(rotated):i % len(rotated) + 16])
            i += 16
        out.append(text)
    return out


def workload(tokenizer, opts) -> list[tuple[int, list[dict]]]:
    systems = tenant_prompts(tokenizer, opts.tenants, opts.system_tokens)
    reqs = [(t, [{"role": "system", "content": systems[t]},
                 {"role": "user", "content": f"Question {q} from customer {t}: what should I check first?"}])
            for t in range(opts.tenants) for q in range(opts.requests_per_tenant)]
    random.Random(opts.seed).shuffle(reqs)
    return reqs


class Server:
    def __init__(self, label: str, extra: list[str], kv_memory: str, log_dir: str) -> None:
        self.label = label
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"{label}.log")
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(self.port), "--kv-cache-memory",
               kv_memory, "--no-access-log", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label}: server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx2.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label}: not ready after {timeout}s; see {self.log_path}")

    def prefix_counters(self) -> tuple[float, float]:
        """(hits, queries) in tokens, summed over the replicas."""
        text = httpx2.get(self.url + "/metrics", timeout=30).text
        hits = queries = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
        return hits, queries

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


async def one_request(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,  # model: the served one
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("message", "error event")}
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if usage is None:
        return {"error": "no usage chunk"}
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


async def drive(url: str, reqs, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    queue = list(reqs)
    results: list[dict] = []
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(600, connect=30), limits=limits) as client:
        async def worker():
            while queue:
                _, messages = queue.pop(0)
                results.append(await one_request(client, url, messages, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def run_one(label: str, extra: list[str], kv_memory: str, reqs, opts, log_dir: str) -> dict:
    server = Server(label, extra, kv_memory, log_dir)
    try:
        server.wait_ready()
        hits0, queries0 = server.prefix_counters()
        results, wall = asyncio.run(drive(server.url + "/v1/chat/completions", reqs, opts.concurrency,
                                          opts.max_tokens))
        hits1, queries1 = server.prefix_counters()
    finally:
        server.stop()
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = [r["ttft"] for r in ok]
    queries = queries1 - queries0
    row = {"label": label, "requests": len(results), "completed": len(ok), "errors": errors[:5],
           "hit_rate": (hits1 - hits0) / queries if queries else 0.0, "wall_s": wall,
           "total_tok_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
           "ttft_p50_s": percentile(ttfts, 0.50), "ttft_p99_s": percentile(ttfts, 0.99)}
    print(f"  {label:<14} {row['completed']}/{row['requests']} ok  hit rate {row['hit_rate'] * 100:5.1f}%  "
          f"{row['total_tok_s']:8.1f} total tok/s  TTFT p50 {(row['ttft_p50_s'] or 0) * 1000:7.0f} ms  "
          f"p99 {(row['ttft_p99_s'] or 0) * 1000:7.0f} ms", flush=True)
    if errors:
        print(f"    failed: {'; '.join(errors[:3])}", flush=True)
    return row


def _bytes_times(value: str, n: int) -> str:
    from kvshare.config import parse_bytes

    return str(parse_bytes(value, "kv_cache_memory_per_replica") * n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--requests-per-tenant", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--data-parallel-size", type=int, default=2)
    ap.add_argument("--kv-cache-memory-per-replica", default="120MiB")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from " + ", ".join(POLICIES))
    ap.add_argument("--no-single", action="store_true", help="skip the single-replica reference run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    opts = ap.parse_args(argv)
    policies = [p for p in opts.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        ap.error(f"--policies: {', '.join(bad)} unknown; allowed are {', '.join(POLICIES)}")
    for name in ("tenants", "requests_per_tenant", "system_tokens", "max_tokens", "concurrency",
                 "data_parallel_size"):
        if getattr(opts, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(opts, name)} is invalid: must be >= 1")

    tokenizer = load_tokenizer(None)
    reqs = workload(tokenizer, opts)
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="kvshare-routing-bench-")
    n = opts.data_parallel_size
    print(f"{len(reqs)} requests: {opts.tenants} tenants x {opts.requests_per_tenant}, ~{opts.system_tokens}-token "
          f"system prompts, {opts.max_tokens} output tokens, concurrency {opts.concurrency}; "
          f"{opts.kv_cache_memory_per_replica} KV per replica; server logs in {log_dir}", flush=True)
    rows = {}
    if not opts.no_single:
        rows["single"] = run_one("single", [], _bytes_times(opts.kv_cache_memory_per_replica, n), reqs, opts,
                                 log_dir)
    for policy in policies:
        rows[policy] = run_one(policy, ["--data-parallel-size", str(n), "--routing-policy", policy],
                               opts.kv_cache_memory_per_replica, reqs, opts, log_dir)
    rr = rows.get("round_robin")
    if rr is not None:
        print("vs round_robin:")
        for label, row in rows.items():
            if label == "round_robin":
                continue
            tput = row["total_tok_s"] / rr["total_tok_s"] if rr["total_tok_s"] else float("nan")
            p50 = (row["ttft_p50_s"] / rr["ttft_p50_s"]) if row["ttft_p50_s"] and rr["ttft_p50_s"] else float("nan")
            p99 = (row["ttft_p99_s"] / rr["ttft_p99_s"]) if row["ttft_p99_s"] and rr["ttft_p99_s"] else float("nan")
            row["vs_round_robin"] = {"total_tok_s": tput, "ttft_p50": p50, "ttft_p99": p99}
            print(f"  {label:<14} throughput x{tput:.2f}  TTFT p50 x{p50:.2f}  p99 x{p99:.2f}")
    if "single" in rows and "prefix_aware" in rows:
        gap = (rows["single"]["hit_rate"] - rows["prefix_aware"]["hit_rate"]) * 100
        print(f"prefix_aware hit rate is {gap:.1f} points below one replica's (target: within 5)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"options": vars(opts), "runs": rows}, f, indent=2)
    failed = any(row["completed"] < row["requests"] for row in rows.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
