"""Issue 32: multi-adapter serving. N random LoRA adapters (default 8, rank 8, on q/k/v/o and
gate/up/down) over one base GGUF, C concurrent clients (default 32), each request naming one
adapter (request i: adapter i mod N), against:

  (a) the same kvshare server, the same prompts with no adapter named (the issue's bound: the
      adapters cost <= 25% of the throughput, i.e. adapters / base >= 0.75);
  (b) llama.cpp's llama-server on the same base file with the same adapter files (`--lora
      FILE,FILE,...`, `--lora-init-without-apply`, so a request without `lora` runs the base model), each
      request choosing its adapter with llama-server's per-request `"lora": [{"id": i, "scale": 1.0}]`
      (adapters not listed get scale 0). Also without adapters, for its own cost.

The adapters are written here, into bench_out/lora_adapters/ (git-ignored), in llama.cpp's GGUF
LoRA form (the form kvshare loads too): the same files for both servers, nothing downloaded.
Every configuration gets a fresh server, two warm-up requests, then one closed loop of C clients
over the same prompts (benchmarks/serve_vs_llamacpp.py's process handling and kvshare's `bench
serve` client). After each adapter run, a check that answers are each adapter's own: one probe
prompt under every adapter and the base model, sent all at once and then each alone, twice,
greedy: the same tokens every time for the same adapter, and different adapters answer
differently (a failed check on kvshare fails the benchmark; on llama-server it is reported).

    python benchmarks/lora_serving.py
    python benchmarks/lora_serving.py --clients 8 --requests 16 --max-tokens 16     # a quick look
    python benchmarks/lora_serving.py --model bench_out/real_shapes/llama-3.2-1b-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_vs_hf import ROOT, Server  # noqa: E402
from serve_vs_llamacpp import LLAMA_SERVER  # noqa: E402

from kvshare.bench.report import summarize  # noqa: E402
from kvshare.bench.serve import closed_loop, make_workload, parse_length_range, request_body, send_one  # noqa: E402
from kvshare.model.loader import bundled_model_path  # noqa: E402
from kvshare.testing.ports import free_port  # noqa: E402

PROBE = "Write one sentence about the sea, the wind and a small boat:"
BOUND = 0.75  # the issue's: adapters cost <= 25% of the base model's throughput


def write_adapters(model: str, out_dir: str, count: int, rank: int, seed: int) -> list[str]:
    """`count` random rank-`rank` LoRA adapters on every q/k/v/o/gate/up/down of `model`, as
    llama.cpp GGUF LoRA files (lora_a [r, in], lora_b [out, r], F32; alpha = r, so scale 1)."""
    import gguf

    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.gguf_loader import config_from_gguf
    from kvshare.model.lora import GGUF_MODULES, module_shapes

    header = open_gguf_file(model)
    config = config_from_gguf(header.metadata, header, model)
    shapes = module_shapes(config)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(model))[0]
    paths = []
    for i in range(count):
        path = os.path.join(out_dir, f"{stem}.r{rank}.s{seed}.{i}.gguf")
        paths.append(path)
        if os.path.exists(path):
            continue  # the same name is the same (model, rank, seed, index): the same weights
        rng = np.random.default_rng([seed, i])
        w = gguf.GGUFWriter(path + ".tmp", header.metadata["general.architecture"])
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(rank))
        for layer in range(config.num_layers):
            for module, gguf_name in GGUF_MODULES.items():
                out_f, in_f = shapes[module]
                # A delta of about half the scale of an input row's projection: it changes answers
                # without turning them into noise.
                a = (rng.standard_normal((rank, in_f)) / np.sqrt(in_f)).astype(np.float32)
                b = (rng.standard_normal((out_f, rank)) * 0.5 / np.sqrt(rank)).astype(np.float32)
                w.add_tensor(f"blk.{layer}.{gguf_name}.weight.lora_a", a)
                w.add_tensor(f"blk.{layer}.{gguf_name}.weight.lora_b", b)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(path + ".tmp", path)
    return paths


def start(server: str, args, adapters: list[str], log_dir: str, env: dict) -> Server:
    port = free_port()
    if server == "kvshare":
        modules = [f"a{i}={p}" for i, p in enumerate(adapters)]
        cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(port), "--no-access-log",
               "--model", args.model, "--enable-lora", "--max-loras", str(len(adapters)),
               "--max-lora-rank", str(args.rank), "--lora-modules", *modules, *args.kvshare_args.split()]
        return Server(server, cmd, port, "/ready", log_dir, env)
    loras = ["--lora", ",".join(adapters)]  # (one --lora per file: llama-server keeps only the last)
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.clients),
           "-c", str(args.clients * args.ctx_per_slot), *loras, "--lora-init-without-apply",
           *args.llama_args.split()]
    return Server(server, cmd, port, "/health", log_dir, env)


def adapter_fields(server: str, adapter: int | None) -> dict:
    """What a request adds to name adapter `adapter` (None: the base model) on `server`."""
    if adapter is None:
        return {}
    return {"model": f"a{adapter}"} if server == "kvshare" else {"lora": [{"id": adapter, "scale": 1.0}]}


async def load(url: str, server: str, with_adapters: bool, args) -> dict:
    import httpx2

    reqs = make_workload("mixed", args.requests, args.max_tokens, args.tag, args.seed, args.prompt_tokens,
                         args.output_tokens)
    async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
                                  timeout=httpx2.Timeout(args.timeout, connect=30.0)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        order = {id(r): i for i, r in enumerate(reqs)}

        def sender(req):
            adapter = order[id(req)] % args.adapters if with_adapters else None
            body = request_body(req, "completions", model, 0.0, {"ignore_eos": True})
            body.update(adapter_fields(server, adapter))
            return send_one(client, url + "/v1/completions", body, {}, req.est_prompt_tokens)

        for warm in make_workload("mixed", 2, 8, "warmup", args.seed, (16, 32), (8, 8)):
            await send_one(client, url + "/v1/completions",
                           {**request_body(warm, "completions", model, 0.0, {"ignore_eos": True}),
                            **adapter_fields(server, 0 if with_adapters else None)}, {}, warm.est_prompt_tokens)
        results, duration = await closed_loop(sender, reqs, args.clients)
        summary = summarize(args.clients, "concurrency", results, duration)
        if with_adapters:
            summary["check"] = await check_outputs(client, url, server, model, args.adapters)
    return summary


async def check_outputs(client, url: str, server: str, model: str, count: int) -> dict:
    """The probe under the base model and every adapter: all at once, then each alone, twice
    (greedy, 16 tokens). Each adapter's answer must be the same every time, and the adapters'
    answers must differ from each other's and the base model's."""
    names = [None, *range(count)]

    async def ask(adapter):
        body = {"model": model, "prompt": PROBE, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
                **adapter_fields(server, adapter)}
        resp = await client.post(url + "/v1/completions", json=body)
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"]

    seen: dict = {a: [] for a in names}
    for _ in range(2):
        for a, text in zip(names, await asyncio.gather(*(ask(a) for a in names))):
            seen[a].append(text)
        for a in names:
            seen[a].append(await ask(a))
    stable = [a for a in names if len(set(seen[a])) == 1]
    distinct = len({seen[a][-1] for a in names})
    return {"ok": len(stable) == len(names) and distinct == len(names), "stable": len(stable),
            "distinct_answers": distinct, "answers": len(names),
            "unstable": [("base" if a is None else f"a{a}") for a in names if a not in stable]}


def one_config(server: str, with_adapters: bool, adapters: list[str], args, log_dir: str, env: dict) -> dict:
    srv = start(server, args, adapters, log_dir, env)
    try:
        srv.wait_ready()
        return asyncio.run(load(srv.url, server, with_adapters, args))
    finally:
        srv.stop()


def _ratio(a, b):
    return None if not a or not b else a / b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the base GGUF both servers load (default: the bundled model)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (closed loop)")
    ap.add_argument("--requests", type=int, default=None, help="requests per configuration (default: 2 x clients)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=parse_length_range, default="32,256", help="prompt lengths MIN,MAX")
    ap.add_argument("--output-tokens", type=parse_length_range, default=None,
                    help="output lengths MIN,MAX (default: max-tokens/2..max-tokens)")
    ap.add_argument("--servers", default="kvshare,llama.cpp", help="which servers to run (comma-separated)")
    ap.add_argument("--kvshare-args", default="", help="engine options for kvshare serve")
    ap.add_argument("--llama-args", default="", help="extra llama-server options")
    ap.add_argument("--llama-server", default=LLAMA_SERVER, help="the llama-server binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="llama-server: context per slot (one per client)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    ap.add_argument("--adapter-dir", default=os.path.join(ROOT, "bench_out", "lora_adapters"))
    ap.add_argument("--out-json", default=os.path.join(ROOT, "bench_out", "lora_serving.json"))
    args = ap.parse_args(argv)
    args.model = os.path.abspath(args.model) if args.model else bundled_model_path()
    args.requests = args.requests or 2 * args.clients
    args.tag = os.urandom(3).hex()  # the same prompts for every configuration, none cached from another run
    servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(servers) - {"kvshare", "llama.cpp"})
    if unknown:
        ap.error(f"--servers: unknown {unknown}; allowed: kvshare, llama.cpp")
    if "llama.cpp" in servers and not os.path.exists(args.llama_server):
        print(f"{args.llama_server} missing (run benchmarks/build_llama_cpp.sh): llama-server skipped",
              file=sys.stderr)
        servers.remove("llama.cpp")
    adapters = write_adapters(args.model, args.adapter_dir, args.adapters, args.rank, args.seed)
    print(f"{len(adapters)} rank-{args.rank} adapters on {os.path.basename(args.model)} in {args.adapter_dir}",
          flush=True)
    log_dir = os.path.dirname(os.path.abspath(args.out_json))
    os.makedirs(log_dir, exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, KVSHARE_NUM_THREADS=threads)
    results = {}
    for server in servers:
        for with_adapters in (False, True):
            name = f"{server} {'adapters' if with_adapters else 'base'}"
            s = one_config(server, with_adapters, adapters, args, log_dir, env)
            results[name] = s
            check = s.get("check")
            print(f"  {name}: {s['completed']}/{s['num_requests']} ok, {s['total_tok_s']:.1f} total tok/s, "
                  f"{s['output_tok_s']:.1f} out tok/s, TTFT p50 {(s['ttft_p50_s'] or 0) * 1e3:.0f} ms, "
                  f"TPOT p50 {(s['tpot_p50_s'] or 0) * 1e3:.1f} ms"
                  + (f"; outputs: {check['stable']}/{check['answers']} stable, {check['distinct_answers']} distinct"
                     if check else "") + (f"; errors: {s['errors']}" if s["errors"] else ""), flush=True)
    ratios = {}
    for server in servers:
        ratios[f"{server} adapters / base"] = _ratio(results[f"{server} adapters"]["total_tok_s"],
                                                     results[f"{server} base"]["total_tok_s"])
    if len(servers) == 2:
        ratios["kvshare / llama.cpp, adapters"] = _ratio(results["kvshare adapters"]["total_tok_s"],
                                                         results["llama.cpp adapters"]["total_tok_s"])
        ratios["kvshare / llama.cpp, base"] = _ratio(results["kvshare base"]["total_tok_s"],
                                                     results["llama.cpp base"]["total_tok_s"])
    print(f"\n{'configuration':<20} {'total tok/s':>11} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} "
          f"{'failed':>6}")
    for name, s in results.items():
        print(f"{name:<20} {s['total_tok_s']:>11.1f} {s['output_tok_s']:>10.1f} {(s['ttft_p50_s'] or 0) * 1e3:>12.0f} "
              f"{(s['tpot_p50_s'] or 0) * 1e3:>12.1f} {s['failed']:>6}")
    for name, r in ratios.items():
        bound = f" (issue 32's bound: >= {BOUND})" if name == "kvshare adapters / base" else ""
        print(f"{name}: {'n/a' if r is None else f'{r:.2f}x'}{bound}")
    with open(args.out_json, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/lora_serving.py", *(argv or sys.argv[1:])]),
                   "model": args.model, "adapters": adapters, "rank": args.rank, "clients": args.clients,
                   "requests": args.requests, "results": results, "ratios": ratios}, f, indent=2)
    print(f"results {args.out_json}")
    kv_check = results.get("kvshare adapters", {}).get("check")
    if kv_check is not None and not kv_check["ok"]:
        print(f"FAILED: kvshare's answers are not each adapter's own: {kv_check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
