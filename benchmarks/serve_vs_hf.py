"""kvshare serve vs HF `transformers serve`, same weights, same load generator, one run.

Both servers run side by side (an idle server costs no CPU); for every workload and every
concurrency level the same `kvshare bench serve` level runs against kvshare, then against HF,
so the noise of this shared machine falls on both alike. The HF server is transformers' own
`transformers serve` (its default mode: one `generate` at a time) on an HF directory exported
from the bundled GGUF: `transformers serve` cannot read that GGUF itself (its config has no
`architectures`), so the directory is written once, dequantized to float32 like kvshare loads it.

    python benchmarks/serve_vs_hf.py
    python benchmarks/serve_vs_hf.py --levels 1,4,16 --workloads shared --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

from kvshare.bench.report import find_knee, format_table, plot
from kvshare.bench.serve import SweepOptions, parse_length_range, parse_levels, run_sweep
from kvshare.model.loader import bundled_model_path
from kvshare.testing.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_hf_dir(dst: str) -> str:
    """The bundled GGUF as an HF model directory (float32 safetensors, tokenizer, chat template)."""
    if os.path.exists(os.path.join(dst, "model.safetensors")):
        return dst
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = os.path.split(bundled_model_path())
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    cfg.architectures = cfg.architectures or [type(model).__name__]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights are dequantized floats now
    os.makedirs(dst, exist_ok=True)
    cfg.save_pretrained(dst)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(dst)
    return dst


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, log_dir: str, env: dict) -> None:
        self.name, self.port, self.ready_path = name, port, ready_path
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def _ratio(a, b):
    return None if not a or not b else a / b


def compare(kv: dict, hf: dict, level: float) -> dict:
    k = next((s for s in kv["levels"] if s["level"] == level), None)
    h = next((s for s in hf["levels"] if s["level"] == level), None)
    if k is None or h is None:
        return {"level": level}
    return {
        "level": level,
        "kvshare_total_tok_s": k["total_tok_s"], "hf_total_tok_s": h["total_tok_s"],
        "total_tok_s_ratio": _ratio(k["total_tok_s"], h["total_tok_s"]),
        "output_tok_s_ratio": _ratio(k["output_tok_s"], h["output_tok_s"]),
        "kvshare_ttft_p50_s": k["ttft_p50_s"], "hf_ttft_p50_s": h["ttft_p50_s"],
        "ttft_p50_hf_over_kvshare": _ratio(h["ttft_p50_s"], k["ttft_p50_s"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=parse_levels, default="1,2,4,8,16,32")
    ap.add_argument("--workloads", default="mixed,shared")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-level", type=float, default=1.5)
    ap.add_argument("--prompt-tokens", type=parse_length_range, default="32,512",
                    help="mixed workload: prompt length range MIN,MAX")
    ap.add_argument("--output-tokens", type=parse_length_range, default=None,
                    help="mixed workload: output length range MIN,MAX (default: --max-tokens/2,--max-tokens)")
    ap.add_argument("--kvshare-args", default="--kv-cache-memory 1GiB --max-num-seqs 64",
                    help="engine options for kvshare serve")
    ap.add_argument("--hf-dir", default=os.path.join(ROOT, "bench_out", "smol-hf"))
    ap.add_argument("--out-json", default=os.path.join(ROOT, "bench_out", "serve_vs_hf.json"))
    ap.add_argument("--png-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per server (1: two servers and the client on 2 busy cores do not "
                         "fight over OpenMP barriers)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-continuous-batching", action="store_true",
                    help="run transformers serve with its --continuous-batching (paged) mode instead of the default")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    levels, prompt_tokens, output_tokens = args.levels, args.prompt_tokens, args.output_tokens
    workloads = args.workloads.split(",")
    log_dir = os.path.dirname(os.path.abspath(args.out_json))
    os.makedirs(log_dir, exist_ok=True)
    os.makedirs(args.png_dir, exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=threads,
               MKL_NUM_THREADS=threads, KVSHARE_NUM_THREADS=threads)

    servers = {}
    kv_port = free_port()
    servers["kvshare"] = Server("kvshare", [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(kv_port),
                                            "--no-access-log", *args.kvshare_args.split()],
                                kv_port, "/ready", log_dir, env)
    if not args.skip_hf:
        hf_dir = export_hf_dir(args.hf_dir)
        hf_port = free_port()
        hf_bin = os.path.join(os.path.dirname(sys.executable), "transformers")
        cb = ["--continuous-batching"] if args.hf_continuous_batching else []
        servers["hf"] = Server("hf", [hf_bin, "serve", hf_dir, "--port", str(hf_port), "--device", "cpu",
                                      "--dtype", "float32", *cb], hf_port, "/v1/models", log_dir, env)
    results: dict[str, dict[str, dict]] = {w: {} for w in workloads}
    tag = os.urandom(3).hex()  # both servers get the very same prompts
    t_start = time.monotonic()
    try:
        for s in servers.values():
            s.wait_ready()
        for name, s in servers.items():  # first requests pay one-time costs (kernels, allocator)
            asyncio.run(run_sweep(SweepOptions(base_url=s.url, workload="mixed", levels=(2,), num_requests=2,
                                               max_tokens=8, warmup=0, label=f"{name}-warmup"), log=lambda m: None))
        for wl in workloads:
            for level in levels:
                for name, s in servers.items():
                    opts = SweepOptions(base_url=s.url, workload=wl, levels=(level,), warmup=0,
                                        max_tokens=args.max_tokens, per_level_factor=args.requests_per_level,
                                        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                        label=name, tag=tag)
                    sw = asyncio.run(run_sweep(opts, log=lambda m: print(m, flush=True)))
                    if name in results[wl]:
                        results[wl][name]["levels"] += sw["levels"]
                    else:
                        results[wl][name] = sw
        for wl in workloads:
            for sw in results[wl].values():
                sw["knee"] = find_knee(sw["levels"])
    finally:
        for s in servers.values():
            s.stop()
    elapsed = time.monotonic() - t_start

    summary = {"elapsed_s": elapsed, "levels": levels, "max_tokens": args.max_tokens, "threads": args.threads,
               "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
               "command": " ".join(["python", "benchmarks/serve_vs_hf.py", *(argv or sys.argv[1:])]),
               "requests_per_level": args.requests_per_level, "kvshare_args": args.kvshare_args,
               "hf_mode": "continuous-batching" if args.hf_continuous_batching else "default (one generate at a time)",
               "workloads": {}}
    for wl in workloads:
        sweeps = list(results[wl].values())
        for sw in sweeps:
            print(format_table(sw) + "\n")
        png = os.path.join(args.png_dir, f"serve_{wl}.png")
        plot(sweeps, png, title=f"{wl} workload: kvshare vs HF transformers serve (star = knee)")
        entry = {"sweeps": results[wl], "png": os.path.relpath(png, ROOT)}
        if "hf" in results[wl]:
            kv, hf = results[wl]["kvshare"], results[wl]["hf"]
            entry["per_level"] = [compare(kv, hf, lv) for lv in levels]
            entry["at_16"] = compare(kv, hf, 16.0)
            entry["at_kvshare_knee"] = compare(kv, hf, kv["knee"]["level"])
            print(f"{wl}: level  kvshare/HF total tok/s  kvshare/HF output tok/s  HF/kvshare TTFT p50")
            for c in entry["per_level"]:
                if "total_tok_s_ratio" in c:
                    print(f"{wl}: {c['level']:>5g}  {c['total_tok_s_ratio']:>21.2f}x  {c['output_tok_s_ratio']:>22.2f}x"
                          f"  {c['ttft_p50_hf_over_kvshare'] or float('nan'):>18.2f}x")
            print(f"{wl}: kvshare knee at {kv['knee']['level']:g} ({kv['knee']['why']}), "
                  f"HF knee at {hf['knee']['level']:g} ({hf['knee']['why']})")
        print(f"{wl}: plot {png}\n")
        summary["workloads"][wl] = entry
    with open(args.out_json, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"elapsed {elapsed / 60:.1f} min; results {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
