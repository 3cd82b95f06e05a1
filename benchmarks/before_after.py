"""Before and after a change, in one run: offline throughput and single-stream decode of two trees.

Each tree runs its OWN copy of benchmarks/offline_throughput.py and benchmarks/cpu_decode.py
(PYTHONPATH set to that tree, a fresh process per run), the trees alternating round by round so
that machine drift falls on both alike. Prints each round and the medians with after/before.

    git worktree add --detach ../before <commit>
    python benchmarks/before_after.py --before ../before                  # 3 rounds
    python benchmarks/before_after.py --before ../before --rounds 1 --num-prompts 8   # smoke

Offline: kvshare only (--skip-hf), the default mode (kept-quantized GGUF weights) and float32
(the exact path), --num-prompts of the mixed workload. Decode: cpu_decode.py's kvshare-default and
kvshare-exact engines on the bundled model, one repeat per round (the rounds give the median).
With --model (a real-shape GGUF): cpu_decode.py's default mode on that file only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tree(tree: str, script: str, args: list[str], out_flag: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "PYTHONPATH": tree}
        cmd = [sys.executable, os.path.join(tree, "benchmarks", script), *args, out_flag, out]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def measure(tree: str, args) -> dict[str, float]:
    got: dict[str, float] = {}
    if args.model is None:
        _offline(tree, args, got)
    model = ["--model", args.model] if args.model else []
    engines = "kvshare-default" if args.model else "kvshare-default,kvshare-exact"
    decode = run_tree(tree, "cpu_decode.py", ["--engines", engines, "--repeats", "1", *model], "--out-json")
    for name, r in decode["results"].items():
        got[f"decode {name} ms/token"] = statistics.median(r["tpot_ms"])
        got[f"prompt {name} tok/s"] = statistics.median(r["prefill_tok_s"])
    return got


def _offline(tree: str, args, got: dict[str, float]) -> None:
    offline = run_tree(tree, "offline_throughput.py",
                       ["--skip-hf", "--dtypes", args.offline_modes, "--num-prompts", str(args.num_prompts)],
                       "--json-out")
    for run in offline["runs"]:
        got[f"offline {run['dtype']} total tok/s"] = run["total_tok_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the tree before the change (e.g. a git worktree)")
    ap.add_argument("--after", default=HERE, help="the tree after the change (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--offline-modes", default="default,float32")
    ap.add_argument("--model", default=None,
                    help="a GGUF file (e.g. from benchmarks/real_shape_gguf.py): cpu_decode.py's default mode "
                         "only, no offline run (offline_throughput.py runs the bundled model)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.model is not None and os.path.exists(args.model):
        args.model = os.path.abspath(args.model)  # (each tree runs in its own directory)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for label, tree in trees.items():
            rounds[label].append(measure(tree, args))
            print(f"round {i + 1} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[label][-1].items()),
                  flush=True)
    print(f"\n{'metric':<36} {'before':>9} {'after':>9} {'after/before':>13}   (medians of {args.rounds})")
    table = {}
    for key in rounds["before"][0]:
        b = statistics.median(r[key] for r in rounds["before"])
        a = statistics.median(r[key] for r in rounds["after"])
        table[key] = {"before": b, "after": a, "ratio": a / b}
        print(f"{key:<36} {b:>9.1f} {a:>9.1f} {a / b:>13.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trees": trees, "rounds": rounds, "medians": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
