"""Single-stream CPU speed on a GGUF (the bundled one, or --model): kvshare default, kvshare
exact, llama.cpp.

Each engine runs in its own fresh process (so load time and RSS are its own), one after the
other, on the same token ids:
- load: seconds from the constructor call until it returns (and kvshare's first token after a
  one-token prompt, the "ready" time);
- RSS after load (VmRSS) and the process's peak (VmHWM) at the end;
- prompt tok/s on a 512-token prompt (median of --repeats);
- ms per output token at batch 1: 128 greedy tokens after a 400-token prompt (median of
  --repeats), sampling included.
llama.cpp is llama-cpp-python's Python API (n_threads=2) from the separate venv that
benchmarks/build_llama_cpp.sh builds (never a kvshare dependency).

    python benchmarks/cpu_decode.py                 # all three, ratios printed
    python benchmarks/cpu_decode.py --model gemma3-270m   # any model kvshare's --model accepts (GGUF)
    python benchmarks/cpu_decode.py --kernels       # also: packed kernel vs dequantize+dense by rows
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_PY = os.path.join(ROOT, "bench_out", "llama_cpp", "venv", "bin", "python")
ENGINES = {
    "kvshare-default": {},
    "kvshare-exact": {"dtype": "float32", "quantization": None},
}


def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _model_path(model: str | None) -> str:
    """The GGUF file `--model` names (None: the bundled model), as kvshare resolves it."""
    from kvshare.model.loader import resolve_model_path

    kind, path = resolve_model_path(model)
    if kind != "gguf":
        raise SystemExit(f"--model {model!r} is an HF directory; llama.cpp needs a GGUF file")
    return path


def _tokens(model: str | None, n_decode_prompt: int, n_prefill: int) -> tuple[list[int], list[int]]:
    from kvshare.bench.workloads import ENGLISH_TEXT
    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(open_gguf_file(_model_path(model)).metadata)
    ids = tok.encode(ENGLISH_TEXT * 4)
    assert len(ids) >= 1000 + n_prefill, len(ids)
    return ids[:n_decode_prompt], ids[1000:1000 + n_prefill]


def worker_kvshare(name: str, args) -> dict:
    t_import = time.perf_counter()
    from kvshare import LLM, SamplingParams

    t0 = time.perf_counter()  # load and ready count from the LLM() call (imports listed apart)
    import_s = t0 - t_import
    llm = LLM(model=args.model, kv_cache_memory="256MiB", enable_prefix_caching=False, **ENGINES[name])
    load_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [1]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ready_s = time.perf_counter() - t0
    rss_after_load = _rss()["VmRSS"]
    decode_ids, prefill_ids = _tokens(args.model, 400, 512)
    prefill, tpot = [], []
    for _ in range(args.repeats):
        out = llm.generate([{"prompt_token_ids": prefill_ids}], SamplingParams(temperature=0, max_tokens=1),
                           use_tqdm=False)[0]
        prefill.append(len(prefill_ids) / out.metrics.time_to_first_token)
        out = llm.generate([{"prompt_token_ids": decode_ids}],
                           SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        m = out.metrics
        tpot.append((m.finished_time - m.first_token_time) / (args.decode_tokens - 1) * 1e3)
    return {"engine": name, "import_s": import_s, "load_s": load_s, "ready_s": ready_s,
            "rss_after_load": rss_after_load,
            "peak_rss": _rss()["VmHWM"], "prefill_tok_s": prefill, "tpot_ms": tpot,
            "startup": llm.engine.startup.lines(), "weight_bytes": llm.engine.model.weight_bytes}


LLAMA_WORKER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
def rss():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out
t_import = time.perf_counter()
from llama_cpp import Llama
t0 = time.perf_counter()
import_s = t0 - t_import
llm = Llama(model_path=args["model"], n_threads=2, n_threads_batch=2, n_ctx=2048, n_batch=512, verbose=False)
load_s = time.perf_counter() - t0
llm.reset(); llm.eval([1]); llm.sample(temp=0.0)
ready_s = time.perf_counter() - t0
rss_after_load = rss()["VmRSS"]
prefill, tpot = [], []
for _ in range(args["repeats"]):
    llm.reset()
    t = time.perf_counter(); llm.eval(args["prefill_ids"]); llm.sample(temp=0.0)
    prefill.append(len(args["prefill_ids"]) / (time.perf_counter() - t))
    llm.reset(); llm.eval(args["decode_ids"]); tok = llm.sample(temp=0.0)
    t = time.perf_counter()
    for _ in range(args["decode_tokens"] - 1):
        llm.eval([tok]); tok = llm.sample(temp=0.0)
    tpot.append((time.perf_counter() - t) / (args["decode_tokens"] - 1) * 1e3)
print(json.dumps({"engine": "llama.cpp", "import_s": import_s, "load_s": load_s, "ready_s": ready_s, "rss_after_load": rss_after_load,
                  "peak_rss": rss()["VmHWM"], "prefill_tok_s": prefill, "tpot_ms": tpot}))
"""


def run_llama(args) -> dict | None:
    if not os.path.exists(args.llama_python):
        print(f"llama.cpp venv missing ({args.llama_python}): run benchmarks/build_llama_cpp.sh", file=sys.stderr)
        return None
    decode_ids, prefill_ids = _tokens(args.model, 400, 512)
    payload = json.dumps({"model": _model_path(args.model), "repeats": args.repeats, "decode_tokens": args.decode_tokens,
                          "decode_ids": decode_ids, "prefill_ids": prefill_ids})
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run([args.llama_python, "-c", LLAMA_WORKER, payload], capture_output=True, text=True, env=env)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_kvshare(name: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    model = ["--model", args.model] if args.model else []
    r = subprocess.run([sys.executable, __file__, "--worker", name, "--repeats", str(args.repeats),
                        "--decode-tokens", str(args.decode_tokens), *model],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def kernel_crossover() -> None:
    """ms per call of each linear path by row count, on the bundled model's layer shapes."""
    import torch

    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.gguf_quants import to_group_affine
    from kvshare.model.kernels import qmatmul
    from kvshare.model.loader import bundled_model_path
    from kvshare.model.qlinear import DequantScratch, GroupInt4Linear, GroupInt8Linear

    qmatmul.QMATMUL.wait_until_built()
    f = open_gguf_file(bundled_model_path())
    t = f.tensor("blk.0.ffn_down.weight")
    w = to_group_affine(t.data, t.tensor_type, t.rows_shape)

    def bench(fn, n=10):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    print(f"\nkernels on {t.name} {t.rows_shape} ({t.type_name}), torch {torch.__version__}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'dtype':>9} {'kvshare int8':>13} {'kvshare int4':>13} {'torch int4':>11} "
          f"{'dequant+dense':>14} {'dense only':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        i8 = GroupInt8Linear(w, dtype, DequantScratch())
        g4 = GroupInt4Linear(w, dtype, DequantScratch())
        # torch's int4 kernel for comparison, packed by torch's own converter (its layout depends
        # on the CPU): w = (q - 8) * s + (z + 8 s) per 32.
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
        scales_zeros = torch.stack([w.scale, w.zero + 8 * w.scale], -1).transpose(0, 1).to(dtype).contiguous()
        dense = i8.dense()
        scratch = torch.empty_like(dense)
        for rows in (1, 4, 16, 32, 64, 256, 1024):
            x = torch.randn(rows, w.shape[1]).to(dtype)
            a = bench(lambda: i8._kernel(x))  # (in VNNI blocks on AVX-512 VNNI CPUs)
            a4 = bench(lambda: g4._kernel(x))
            b = bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packed, 32, scales_zeros))
            c = bench(lambda: torch.nn.functional.linear(x, g4.dense(scratch)))
            d = bench(lambda: torch.nn.functional.linear(x, dense))
            print(f"{rows:>5} {str(dtype).split('.')[-1]:>9} {a:>13.3f} {a4:>13.3f} {b:>11.3f} {c:>14.3f} {d:>11.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a GGUF kvshare's --model accepts, e.g. gemma3-270m (default: the bundled model)")
    ap.add_argument("--llama-python", default=LLAMA_PY,
                    help="python of the llama-cpp-python venv (default: the one build_llama_cpp.sh makes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--engines", default="kvshare-default,kvshare-exact,llama.cpp")
    ap.add_argument("--kernels", action="store_true", help="also time the linear kernels by row count")
    ap.add_argument("--out-json", default=os.path.join(ROOT, "bench_out", "cpu_decode.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_kvshare(args.worker, args)))
        return 0
    results = {}
    for name in args.engines.split(","):
        res = run_llama(args) if name == "llama.cpp" else run_kvshare(name, args)
        if res is not None:
            results[name] = res
            print(f"{name}: done", flush=True)
    print(f"\n{'engine':<17} {'import s':>8} {'load s':>7} {'ready s':>8} {'RSS MiB':>8} {'peak MiB':>9} "
          f"{'prompt tok/s':>13} {'ms/token':>9}")
    for name, r in results.items():
        print(f"{name:<17} {r['import_s']:>8.2f} {r['load_s']:>7.2f} {r['ready_s']:>8.2f} {r['rss_after_load'] / 2**20:>8.0f} "
              f"{r['peak_rss'] / 2**20:>9.0f} {statistics.median(r['prefill_tok_s']):>13.1f} "
              f"{statistics.median(r['tpot_ms']):>9.2f}")
    base = results.get("llama.cpp")
    if base:
        print("\nratios vs llama.cpp (kvshare / llama.cpp; ms/token and RSS: lower is better)")
        for name, r in results.items():
            if name == "llama.cpp":
                continue
            print(f"{name:<17} ms/token {statistics.median(r['tpot_ms']) / statistics.median(base['tpot_ms']):.2f}x  "
                  f"prompt tok/s {statistics.median(r['prefill_tok_s']) / statistics.median(base['prefill_tok_s']):.2f}x  "
                  f"RSS {r['rss_after_load'] / base['rss_after_load']:.2f}x  load {r['load_s'] / base['load_s']:.2f}x")
    for name, r in results.items():
        if "startup" in r:
            print(f"\n{name} start-up block:\n  " + "\n  ".join(r["startup"]))
    os.makedirs(os.path.dirname(args.out_json), exist_ok=True)
    with open(args.out_json, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/cpu_decode.py", *(argv or sys.argv[1:])]),
                   "results": results}, f, indent=2)
    if args.kernels:
        kernel_crossover()
    return 0


if __name__ == "__main__":
    sys.exit(main())
