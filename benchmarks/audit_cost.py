"""What audit mode costs on the offline throughput workload, and proof that audit off is free.

Three settings, each in its own process, interleaved round by round so machine noise hits all
of them alike:
  baseline   the engine before audit hooks existed (a git worktree of --baseline-rev)
  off        this tree, audit off (the default)
  on         this tree, audit on: every invariant checked twice per step

    python benchmarks/audit_cost.py                       # 3 rounds, 32 prompts, float32
    python benchmarks/audit_cost.py --rounds 5 --num-prompts 64

Prints total tok/s per setting (median of rounds) and the ratios on/off and off/baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from kvshare import LLM, SamplingParams
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from offline_throughput import build_workload  # the workload as that tree defines it
num, audit, dtype = int(sys.argv[2]), sys.argv[3] == "on", sys.argv[4]
opts = dict(kv_cache_memory="1GiB", dtype=dtype)
if audit:
    opts["audit"] = True
llm = LLM(**opts)
audit_s = [0.0]
auditor = getattr(llm.engine, "auditor", None)
if auditor is not None:  # time the invariant checks themselves: a cost figure below the machine's noise
    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                audit_s[0] += time.perf_counter() - t
        return run
    for name in ("check_state", "check_io"):  # the checkpoints and the plan-vs-tables check
        setattr(auditor, name, timed(getattr(auditor, name)))
    if hasattr(auditor, "checker"):  # the isolation state machine, fed every event
        auditor.checker.feed = timed(auditor.checker.feed)
prompts, outs = build_workload(llm.engine.tokenizer, num, 0)
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params[:4], use_tqdm=False)  # warm-up
audit_s[0] = 0.0
t0 = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
elapsed = time.perf_counter() - t0
tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
checks = llm.engine.auditor.num_checks if getattr(llm.engine, "auditor", None) is not None else 0
print(json.dumps({"elapsed": elapsed, "tokens": tokens, "checks": checks, "steps": llm.engine.step_count,
                  "audit_s": audit_s[0]}))
"""


def run_child(src: str, num: int, audit: str, dtype: str) -> dict:
    env = dict(os.environ, KVSHARE_AUDIT="0")
    out = subprocess.run([sys.executable, "-c", CHILD, src, str(num), audit, dtype], capture_output=True, text=True,
                         env=env, cwd=src)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({src}, audit {audit}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--baseline-rev", default="5b2abbd", help="commit before the audit hooks")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.baseline_rev], check=True,
                       capture_output=True)
        try:
            results: dict[str, list[float]] = {"baseline": [], "off": [], "on": []}
            checks = 0
            audit_share: list[float] = []
            for r in range(args.rounds):
                for name, src, audit in (("baseline", base, "off"), ("off", ROOT, "off"), ("on", ROOT, "on")):
                    res = run_child(src, args.num_prompts, audit, args.dtype)
                    results[name].append(res["tokens"] / res["elapsed"])
                    checks = max(checks, res["checks"])
                    if audit == "on":
                        audit_share.append(res["audit_s"] / res["elapsed"])
                    print(f"round {r + 1} {name:<8} {res['tokens'] / res['elapsed']:8.1f} tok/s "
                          f"({res['elapsed']:.1f} s, {res['steps']} steps, {res['checks']} audit checks, "
                          f"{res['audit_s']:.2f} s in them)", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print()
    print(f"total tok/s, median of {args.rounds} rounds ({args.num_prompts} prompts, {args.dtype}):")
    for k, v in med.items():
        print(f"  {k:<9} {v:8.1f}   (runs: {', '.join(f'{x:.1f}' for x in results[k])})")
    print(f"audit on / off:   {med['on'] / med['off']:.3f}  (cost {100 * (1 - med['on'] / med['off']):.1f}%)")
    print(f"off / baseline:   {med['off'] / med['baseline']:.3f}")
    print(f"time inside the audit's checks with audit on: {100 * statistics.median(audit_share):.2f}% of the run "
          f"(median; runs: {', '.join(f'{100 * x:.2f}%' for x in audit_share)})")


if __name__ == "__main__":
    main()
