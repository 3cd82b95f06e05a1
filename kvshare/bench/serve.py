"""`kvshare bench serve`: a load generator for any OpenAI-compatible server.

Closed loop (N clients, each sending its next request when the last one finishes) at every
level of --concurrency, or open loop with Poisson arrivals at every --request-rate. Every request
streams, so time to first token and time per output token are measured at the client. Token
counts come from the server's usage (stream_options.include_usage); a server that sends none
is counted one token per text chunk, and its prompts by the workload's estimate.

    kvshare bench serve --base-url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,32 \\
        --workload shared --max-tokens 48 --out-json bench_out/s.json --out-png bench_out/s.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass

from kvshare.bench.report import RequestResult, find_knee, format_table, plot, summarize
from kvshare.bench.workloads import ENGLISH_TEXT

TOKENS_PER_WORD = 1.3  # English prose through a BPE vocabulary; only for servers that report no usage


@dataclass
class BenchRequest:
    prompt: str | None = None
    messages: list | None = None
    max_tokens: int = 64
    est_prompt_tokens: int = 0


# ---- workloads -------------------------------------------------------------------------------

def _words(start: int, count: int) -> str:
    words = ENGLISH_TEXT.split()
    return " ".join(words[(start + i) % len(words)] for i in range(count))


def mixed_workload(num: int, max_tokens: int, tag: str, seed: int = 0,
                   prompt_tokens: tuple[int, int] = (32, 512),
                   output_tokens: tuple[int, int] | None = None) -> list[BenchRequest]:
    """Prompts of 32-512 tokens and outputs of max_tokens/2 to max_tokens (or `output_tokens`),
    uniform; each prompt opens with its own tag so no two requests (nor two levels) share a
    cached prefix."""
    rng = random.Random(f"{seed}-{tag}")
    lo, hi = output_tokens or (max(1, max_tokens // 2), max_tokens)
    out = []
    for i in range(num):
        words = int(rng.randint(*prompt_tokens) / TOKENS_PER_WORD)
        text = f"[{tag}/{i}] " + _words(rng.randrange(10_000), words)
        out.append(BenchRequest(prompt=text, max_tokens=rng.randint(lo, hi),
                                est_prompt_tokens=int((words + 3) * TOKENS_PER_WORD)))
    return out


def shared_workload(num: int, max_tokens: int, tag: str, seed: int = 0, preamble_tokens: int = 400,
                    tail_tokens: int = 30) -> list[BenchRequest]:
    """One ~400-token preamble shared by every request, then a ~30-token tail of its own."""
    rng = random.Random(f"{seed}-{tag}")
    pre_words, tail_words = int(preamble_tokens / TOKENS_PER_WORD), int(tail_tokens / TOKENS_PER_WORD)
    preamble = _words(0, pre_words)
    out = []
    for i in range(num):
        tail = f"\n\nQuestion {tag}/{i}: " + _words(rng.randrange(10_000), tail_words)
        out.append(BenchRequest(prompt=preamble + tail, max_tokens=max_tokens,
                                est_prompt_tokens=int((pre_words + tail_words + 3) * TOKENS_PER_WORD)))
    return out


def file_workload(path: str, max_tokens: int) -> list[BenchRequest]:
    """JSONL: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens" per line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise ValueError(f"{path}:{lineno}: each line needs 'prompt' or 'messages'")
            text = obj.get("prompt") or " ".join(str(m.get("content", "")) for m in obj["messages"])
            out.append(BenchRequest(prompt=obj.get("prompt"), messages=obj.get("messages"),
                                    max_tokens=int(obj.get("max_tokens", max_tokens)),
                                    est_prompt_tokens=int(len(str(text).split()) * TOKENS_PER_WORD)))
    if not out:
        raise ValueError(f"{path}: no requests in the file")
    return out


def make_workload(name: str, num: int, max_tokens: int, tag: str, seed: int = 0,
                  prompt_tokens: tuple[int, int] = (32, 512),
                  output_tokens: tuple[int, int] | None = None) -> list[BenchRequest]:
    if name == "mixed":
        return mixed_workload(num, max_tokens, tag, seed, prompt_tokens, output_tokens)
    if name == "shared":
        return shared_workload(num, max_tokens, tag, seed)
    reqs = file_workload(name, max_tokens)
    return [reqs[i % len(reqs)] for i in range(num)]


# ---- one request -----------------------------------------------------------------------------

def request_body(req: BenchRequest, endpoint: str, model: str, temperature: float, extra: dict) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt if req.prompt is not None else "\n".join(
            str(m.get("content", "")) for m in req.messages)
    return body


async def send_one(client, url: str, body: dict, headers: dict, est_prompt_tokens: int) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start, end=start)
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}"
                await resp.aread()
                res.end = time.perf_counter()
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:200]
                    break
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        if res.first_token is None:
                            res.first_token = time.perf_counter()
                        chunks += 1
        res.end = time.perf_counter()
        res.ok = res.error is None
    except Exception as e:  # network errors count as failed requests, not as a crashed benchmark
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"[:200]
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens") or est_prompt_tokens)
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
    else:
        res.prompt_tokens, res.output_tokens = est_prompt_tokens, chunks
    return res


# ---- load shapes -----------------------------------------------------------------------------

async def closed_loop(send, reqs: list[BenchRequest], concurrency: int) -> tuple[list[RequestResult], float]:
    queue = list(reversed(reqs))
    results: list[RequestResult] = []

    async def worker():
        while queue:
            results.append(await send(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def poisson(send, reqs: list[BenchRequest], rate: float, seed: int,
                  max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req):
        if sem is None:
            return await send(req)
        async with sem:
            return await send(req)

    t0 = time.perf_counter()
    tasks = []
    for req in reqs:
        tasks.append(asyncio.create_task(one(req)))
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


# ---- a sweep ---------------------------------------------------------------------------------

@dataclass
class SweepOptions:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    workload: str = "mixed"
    levels: tuple[float, ...] = (1, 2, 4, 8, 16, 32)
    mode: str = "concurrency"  # or "rate"
    num_requests: int | None = None  # per level; None: per_level_factor x concurrency
    per_level_factor: float = 3.0
    min_requests: int = 4
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = False
    max_concurrency: int | None = None
    warmup: int = 2
    seed: int = 0
    api_key: str | None = None
    label: str = "server"
    timeout: float = 600.0
    prompt_tokens: tuple[int, int] = (32, 512)  # the mixed workload's prompt length range
    output_tokens: tuple[int, int] | None = None  # ... and its output range (None: max_tokens/2..max_tokens)
    # Prompt tags: equal tags give equal prompts (two servers compared on the same text); the
    # default is fresh per sweep, so a second sweep on the same server finds nothing cached.
    tag: str | None = None


def _num_requests(opts: SweepOptions, level: float) -> int:
    if opts.num_requests:
        return opts.num_requests
    return max(opts.min_requests, math.ceil(opts.per_level_factor * level))


class BenchError(Exception):
    """A sweep that cannot start (server unreachable, no model to send): one line, no traceback."""


async def _discover_model(client, base: str, headers: dict, model: str | None) -> str:
    """The model to send (--model, else the first of /v1/models), after checking the server answers."""
    import httpx2

    try:
        resp = await client.get(f"{base}/models", headers=headers)
    except httpx2.TransportError as e:
        raise BenchError(f"cannot reach the server at {base} ({type(e).__name__}: {e})") from None
    if model:
        return model
    try:
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx2.HTTPStatusError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"{base}/models did not name a model ({type(e).__name__}: {str(e)[:120]}); "
                         f"give --model") from None


async def kvshare_dashboard_url(client, base: str, headers: dict) -> str | None:
    """The live KV view's page when the server is kvshare (it answers /kv/snapshot with a pool),
    else None: any other server, or a kvshare one refusing this key."""
    import httpx2

    root = base[:-len("/v1")] if base.endswith("/v1") else base
    try:
        resp = await client.get(f"{root}/kv/snapshot", params={"blocks": "none"}, headers=headers)
        body = resp.json() if resp.status_code == 200 else None
    except (httpx2.HTTPError, ValueError):
        return None
    if isinstance(body, dict) and isinstance(body.get("num_blocks"), int) and isinstance(body.get("counts"), dict):
        return f"{root}/dashboard"
    return None


async def run_sweep(opts: SweepOptions, log=print) -> dict:
    import httpx2

    base = opts.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    url = f"{base}/chat/completions" if opts.endpoint == "chat" else f"{base}/completions"
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(opts.timeout, connect=30.0)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await _discover_model(client, base, headers, opts.model)
        dashboard = await kvshare_dashboard_url(client, base, headers)
        if dashboard is not None:
            key_hint = " (the browser asks for the API key: give it as the password)" if opts.api_key else ""
            log(f"  kvshare server: watch its KV cache live at {dashboard}{key_hint}")
        extra = {"ignore_eos": True} if opts.ignore_eos else {}

        def sender(req: BenchRequest):
            body = request_body(req, opts.endpoint, model, opts.temperature, extra)
            return send_one(client, url, body, headers, req.est_prompt_tokens)

        for req in make_workload(opts.workload, opts.warmup, opts.max_tokens, "warmup", opts.seed,
                                 opts.prompt_tokens, opts.output_tokens):
            await sender(req)
        levels = []
        tag = opts.tag or os.urandom(3).hex()
        for level in opts.levels:
            reqs = make_workload(opts.workload, _num_requests(opts, level), opts.max_tokens, f"{tag}-{level:g}",
                                 opts.seed, opts.prompt_tokens, opts.output_tokens)
            if opts.mode == "concurrency":
                results, duration = await closed_loop(sender, reqs, int(level))
            else:
                results, duration = await poisson(sender, reqs, level, opts.seed, opts.max_concurrency)
            s = summarize(level, opts.mode, results, duration)
            levels.append(s)
            log(f"  {opts.label} {opts.workload} {opts.mode}={level:g}: {s['completed']}/{s['num_requests']} ok, "
                f"{s['total_tok_s']:.1f} total tok/s, {s['output_tok_s']:.1f} out tok/s, "
                f"TTFT p50 {(s['ttft_p50_s'] or 0) * 1000:.0f} ms")
            errors = s["errors"]
            if errors:  # say why, or a failed sweep is a bare exit status
                log(f"    failed requests: {'; '.join(errors[:3])}")
    sweep = {"label": opts.label, "base_url": opts.base_url, "model": model, "endpoint": opts.endpoint,
             "workload": opts.workload, "mode": opts.mode, "max_tokens": opts.max_tokens, "levels": levels,
             "dashboard_url": dashboard}
    sweep["knee"] = find_knee(levels)
    return sweep


# ---- command line ----------------------------------------------------------------------------

def parse_levels(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 1,2,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: levels must be positive numbers")
    return values


def parse_length_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,MAX token counts, e.g. 32,512") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (any engine)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=parse_levels, default=None, help="closed-loop levels, e.g. 1,2,4,8,16,32")
    load.add_argument("--request-rate", type=parse_levels, default=None, help="Poisson arrival rates (req/s), e.g. 1,2,4")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight with --request-rate")
    p.add_argument("--workload", default="mixed", help="mixed | shared | FILE.jsonl")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: --requests-per-level x the level, at least 4)")
    p.add_argument("--requests-per-level", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=parse_length_range, default=(32, 512),
                   help="mixed workload: prompt length range MIN,MAX in tokens (default 32,512)")
    p.add_argument("--output-tokens", type=parse_length_range, default=None,
                   help="mixed workload: max_tokens range MIN,MAX (default: --max-tokens/2,--max-tokens)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (servers that know it)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--label", default="server", help="name of this run in the table, JSON and plot")
    p.add_argument("--out-json", default=None)
    p.add_argument("--out-png", default=None)
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    rate = args.request_rate is not None
    opts = SweepOptions(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, workload=args.workload,
        levels=args.request_rate if rate else (args.concurrency or (1, 2, 4, 8, 16, 32)),
        mode="rate" if rate else "concurrency", num_requests=args.num_requests,
        per_level_factor=args.requests_per_level, max_tokens=args.max_tokens, temperature=args.temperature,
        ignore_eos=args.ignore_eos, max_concurrency=args.max_concurrency, warmup=args.warmup, seed=args.seed,
        api_key=args.api_key, label=args.label, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
    )
    if opts.workload not in ("mixed", "shared") and not os.path.exists(opts.workload):
        raise ValueError(f"--workload {opts.workload!r}: give mixed, shared or an existing JSONL file")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request drowns the table
    try:
        sweep = asyncio.run(run_sweep(opts, log=lambda m: print(m, file=sys.stderr, flush=True)))
    except BenchError as e:
        print(f"kvshare bench serve: {e}", file=sys.stderr)
        return 2
    print(format_table(sweep))
    if args.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        with open(args.out_json, "w") as f:
            json.dump(sweep, f, indent=2)
    if args.out_png:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_png)), exist_ok=True)
        plot([sweep], args.out_png)
        print(f"plot: {args.out_png}")
    return 0 if all(s["failed"] == 0 for s in sweep["levels"]) else 1
