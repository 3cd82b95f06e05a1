"""What the live KV view's page (/dashboard) costs the server, and how it keeps up on a big pool.

One run, a fresh `kvshare serve` per configuration:
  1. throughput: total tok/s of a shared-prefix closed loop at --concurrency (kvshare bench serve's
     sweep), with nobody watching and with the page open and live in a real headless Chromium
     (Debian's /usr/bin/chromium driven by Playwright), --repeats times each in A-B-B-A order;
     the cost is the drop of the mean in %. The browser runs on the same machine, so its own CPU
     time is part of the cost; so the same runs are also made with a stream-only client (what
     the page reads: one /kv/snapshot, then /kv/events parsed as it arrives, nothing drawn), and
     each run reports the CPU seconds the server process and the browser spent on the same
     workload: the server's extra CPU is what a dashboard costs the server wherever the
     browser runs.
  2. responsiveness: a server with a KV pool of at least --pool-blocks blocks (small blocks, so the
     pool fits in memory: --pool-block-size tokens each, the KV memory sized from the first server's
     bytes per token), the page open while the same load runs for --seconds; the frame times the
     browser reports (requestAnimationFrame) give the median and p95, and the time the page took
     to load the whole pool.

The recording run (a quiet machine, ~15 minutes):

    python benchmarks/dashboard_cost.py --concurrency 16 --requests 96 --max-tokens 64 \\
        --pool-blocks 50000 --seconds 20 --out-json bench_out/dashboard_cost.json

A smoke run (a minute or two, sizes too small to mean anything):

    python benchmarks/dashboard_cost.py --concurrency 2 --requests 4 --max-tokens 4 --repeats 1 \\
        --pool-blocks 3000 --seconds 3

--screenshot PATH saves the page as it looked a few seconds into the first watched throughput run.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

from kvshare.bench.serve import SweepOptions, run_sweep
from kvshare.config import parse_bytes
from kvshare.testing.browser import CHROMIUM, CHROMIUM_ARGS, chromium_missing
from kvshare.testing.ports import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_vs_hf import Server  # noqa: E402  (the server process the serving benchmarks share)

VIEWPORT = {"width": 1440, "height": 1000}
KEY = "dashboard-cost-key"  # the page goes through --api-key as a user's would


class ServeProcess(Server):
    """`kvshare serve` behind --api-key on a free loopback port, its log in a temporary folder
    (removed when it stops)."""

    def __init__(self, engine_args: list[str]) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="dashboard-cost-")
        port = free_port()
        cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(port), "--api-key", KEY,
               "--no-access-log", *engine_args]
        super().__init__("kvshare serve", cmd, port, "/ready", self.log_dir, dict(os.environ))

    def get_json(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout: float = 600) -> "ServeProcess":
        super().wait_ready(timeout)
        return self

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (the browser's processes below this one)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def browser_cpu_seconds() -> float:
    total = 0.0
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if "chrom" not in f.read():
                    continue
            total += cpu_seconds(pid)
        except OSError:
            continue
    return total


class StreamClient:
    """What the page reads, without the page: one /kv/snapshot, then /kv/events, each event
    batch parsed as JSON as it arrives (on a thread of its own)."""

    def __init__(self, srv: ServeProcess) -> None:
        self.events = 0
        self.snapshot_blocks = len(srv.get_json("/kv/snapshot")["blocks"])
        req = urllib.request.Request(srv.url + "/kv/events", headers={"Authorization": f"Bearer {KEY}"})
        self.resp = urllib.request.urlopen(req, timeout=600)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = self.pool.submit(self._read)

    def _read(self) -> None:
        for raw in self.resp:
            line = raw.decode()
            if line.startswith("data:"):
                batch = json.loads(line[5:])
                self.events += len(batch.get("events", ())) if isinstance(batch, dict) else 0

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def open_dashboard(browser, srv: ServeProcess):
    ctx = browser.new_context(viewport=VIEWPORT, http_credentials={"username": "bench", "password": KEY})
    page = ctx.new_page()
    t0 = time.perf_counter()
    resp = page.goto(srv.url + "/dashboard")
    if resp.status != 200:
        raise RuntimeError(f"GET /dashboard: HTTP {resp.status}")
    page.wait_for_function("() => window.kvDashboard && window.kvDashboard.ready", timeout=300_000)
    return ctx, page, time.perf_counter() - t0


def sweep_options(args, srv: ServeProcess, requests: int) -> SweepOptions:
    return SweepOptions(base_url=srv.url, workload="shared", levels=(args.concurrency,), num_requests=requests,
                        max_tokens=args.max_tokens, ignore_eos=True, warmup=2, api_key=KEY, label="kvshare")


def sweep_in_thread(opts: SweepOptions) -> concurrent.futures.Future:
    """The load on a thread of its own: Playwright's sync API keeps this thread's event loop."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(asyncio.run, run_sweep(opts, log=lambda m: print(m, file=sys.stderr, flush=True)))
    pool.shutdown(wait=False)
    return future


def throughput(args, browser, client: str, screenshot: bool) -> tuple[float, dict]:
    """client: "none", "stream" (StreamClient) or "browser" (the page in Chromium)."""
    srv = ServeProcess(args.engine_args).wait_ready()
    ctx = stream = None
    watched = client == "browser"
    try:
        extra = {}
        if watched:
            ctx, page, extra["page_load_s"] = open_dashboard(browser, srv)
        elif client == "stream":
            stream = StreamClient(srv)
        server_cpu0, browser_cpu0 = cpu_seconds(srv.proc.pid), browser_cpu_seconds()
        future = sweep_in_thread(sweep_options(args, srv, args.requests))
        if watched and screenshot and args.screenshot:
            # Mid-run: the page as it looks under load.
            while not future.done() and page.evaluate("() => kvDashboard.counts.in_use + kvDashboard.counts.shared") == 0:
                time.sleep(0.2)
            time.sleep(min(3.0, args.screenshot_delay))
            os.makedirs(os.path.dirname(os.path.abspath(args.screenshot)), exist_ok=True)
            page.screenshot(path=args.screenshot, full_page=True)
            print(f"screenshot: {args.screenshot}", file=sys.stderr)
        level = future.result()["levels"][0]
        extra["server_cpu_s"] = cpu_seconds(srv.proc.pid) - server_cpu0
        extra["browser_cpu_s"] = browser_cpu_seconds() - browser_cpu0
        if level["failed"]:
            raise RuntimeError(f"{level['failed']} requests failed: {level['errors'][:3]}")
        if stream is not None:
            extra["events_read"] = stream.events
        if watched:
            extra["events_shown"] = page.evaluate("() => kvDashboard.totals.events")
            extra["frame_ms"] = frame_stats(page.evaluate("() => kvDashboard.frameTimes()"))
        return level["total_tok_s"], extra
    finally:
        if ctx is not None:
            ctx.close()
        srv.stop()
        if stream is not None:
            stream.close()


def frame_stats(times: list[float]) -> dict:
    if not times:
        return {"frames": 0}
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"frames": len(times), "median": statistics.median(times), "p95": p95, "max": ordered[-1]}


def bytes_per_token(args) -> float:
    """KV bytes per token of this model and dtype, from a server's pool size."""
    memory = next((args.engine_args[i + 1] for i, a in enumerate(args.engine_args[:-1]) if a == "--kv-cache-memory"),
                  None)
    if memory is None:
        raise SystemExit("--engine-args must name --kv-cache-memory (the big pool is sized from it)")
    srv = ServeProcess(args.engine_args).wait_ready()
    try:
        snap = srv.get_json("/kv/snapshot?blocks=none")
    finally:
        srv.stop()
    return parse_bytes(memory) / (snap["num_blocks"] * snap["block_size"])


def responsiveness(args, browser, per_token: float) -> dict:
    memory = math.ceil(args.pool_blocks * args.pool_block_size * per_token * 1.01 / 2**20)
    engine = [a for a in args.engine_args]
    i = engine.index("--kv-cache-memory")
    engine[i + 1] = f"{memory}MiB"
    srv = ServeProcess([*engine, "--block-size", str(args.pool_block_size)]).wait_ready()
    ctx = None
    try:
        num_blocks = srv.get_json("/kv/snapshot?blocks=none")["num_blocks"]
        if num_blocks < args.pool_blocks:
            raise RuntimeError(f"the pool has {num_blocks} blocks, fewer than --pool-blocks {args.pool_blocks}")
        ctx, page, load_s = open_dashboard(browser, srv)
        before = len(page.evaluate("() => kvDashboard.frameTimes()"))
        # Enough requests to keep --concurrency busy for --seconds; the frames counted are those
        # of --seconds from the start of the load.
        future = sweep_in_thread(sweep_options(args, srv, 10_000))
        time.sleep(args.seconds)
        times = page.evaluate("() => kvDashboard.frameTimes()")
        info = {"num_blocks": num_blocks, "blocks_per_cell": page.evaluate("() => kvDashboard.blocksPerCell"),
                "page_load_s": load_s, "events_shown": page.evaluate("() => kvDashboard.totals.events"),
                "frame_ms": frame_stats(times[before:] if len(times) > before else times)}
        srv.stop()  # ends the load (its requests fail, which is expected here)
        try:
            future.result(timeout=120)
        except Exception:  # noqa: BLE001 - the sweep's requests die with the server, by design
            pass
        return info
    finally:
        if ctx is not None:
            ctx.close()
        if srv.proc.poll() is None:
            srv.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=96, help="requests per throughput run")
    p.add_argument("--repeats", type=int, default=2,
                   help="throughput runs per configuration, in A-B-B-A order (each on a fresh server)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pool-blocks", type=int, default=50_000, help="at least this many blocks in the big pool")
    p.add_argument("--pool-block-size", type=int, default=1, help="tokens per block in the big pool")
    p.add_argument("--seconds", type=float, default=20.0, help="how long frame times are recorded under load")
    p.add_argument("--engine-args", default="--kv-cache-memory 512MiB --max-model-len 1024",
                   help="kvshare serve engine options for every server (must name --kv-cache-memory)")
    p.add_argument("--screenshot", default=None, help="save the page under load here (PNG)")
    p.add_argument("--screenshot-delay", type=float, default=3.0, help="seconds into the load to take it")
    p.add_argument("--out-json", default=None)
    args = p.parse_args(argv)
    args.engine_args = args.engine_args.split()
    if min(args.concurrency, args.requests, args.repeats, args.max_tokens, args.pool_blocks,
           args.pool_block_size) < 1 \
            or args.seconds <= 0:
        p.error("sizes must be positive")
    if chromium_missing() is not None:
        p.error(chromium_missing())

    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
        try:
            # A-B-B-A...: a drift of the machine over the run (clock, heat, neighbours) falls on both.
            kinds = ("none", "stream", "browser")
            order = [k for i in range(args.repeats) for k in (kinds if i % 2 == 0 else kinds[::-1])]
            runs = {k: [] for k in kinds}
            infos = {k: [] for k in kinds}
            for kind in order:
                tok_s, info = throughput(args, browser, kind, screenshot=not runs["browser"])
                runs[kind].append(tok_s)
                infos[kind].append(info)
            big = responsiveness(args, browser, bytes_per_token(args))
        finally:
            browser.close()
    tok = {k: statistics.mean(v) for k, v in runs.items()}
    cpu = {k: statistics.mean(i["server_cpu_s"] for i in infos[k]) for k in infos}
    bcpu = {k: statistics.mean(i["browser_cpu_s"] for i in infos[k]) for k in infos}
    cost = {k: 100.0 * (tok["none"] - tok[k]) / tok["none"] for k in kinds}
    server_cost = {k: 100.0 * (cpu[k] - cpu["none"]) / cpu["none"] for k in kinds}
    result = {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
              "total_tok_s": tok, "runs": runs, "throughput_cost_pct": cost, "server_cpu_s": cpu,
              "server_cpu_cost_pct": server_cost, "browser_cpu_s": bcpu, "run_info": infos, "big_pool": big}
    print(f"throughput, shared prefix, concurrency {args.concurrency}, {args.requests} requests x "
          f"{args.max_tokens} tokens (the same work in every run):")
    each = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    label = {"none": "no client", "stream": "stream-only client", "browser": "page in Chromium"}
    for k in kinds:
        print(f"  {label[k]:20s} {tok[k]:8.1f} total tok/s (mean of {each(runs[k])})  cost {cost[k]:5.1f} %   "
              f"server CPU {cpu[k]:6.1f} s ({server_cost[k]:+5.1f} %)  browser CPU {bcpu[k]:5.1f} s")
    fm = big["frame_ms"]
    print(f"responsiveness, pool of {big['num_blocks']} blocks ({big['blocks_per_cell']} per cell), "
          f"{args.seconds:g} s under load: page loaded in {big['page_load_s']:.2f} s, showed {big['events_shown']} events")
    if fm["frames"]:
        print(f"  frame time         median {fm['median']:.1f} ms, p95 {fm['p95']:.1f} ms, max {fm['max']:.1f} ms "
              f"over {fm['frames']} frames")
    else:
        print("  frame time         no frames recorded")
    if args.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
