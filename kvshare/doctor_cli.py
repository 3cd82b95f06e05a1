"""`kvshare doctor` and `kvshare audit replay`. Exit codes: 0 clean, 1 contamination or
violation found, 2 usage error."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from kvshare.engine_args import add_engine_args, engine_options


def add_doctor_parsers(sub) -> None:
    d = sub.add_parser("doctor", help="find cross-request KV contamination by bisection (exit 1 if found)")
    d.add_argument("--workload", default=None,
                   help="JSONL, one request per line: prompt or prompt_token_ids, max_tokens, n, temperature, seed, "
                        "cache_salt, delay_steps, abort_after_steps (default: a built-in shared-prefix workload)")
    d.add_argument("--repro-out", default=None, metavar="PATH",
                   help="where the minimal repro is written (default: a new temporary file, its path printed)")
    d.add_argument("--logprob-tol", "--tolerance", dest="logprob_tol", type=float, default=None, metavar="TOL",
                   help="largest logprob difference still called equal (default: 0, exact equality, when the engine "
                        "is bit-transparent, as the default mode is; else 2e-3; the report says which and why)")
    d.add_argument("--json", nargs="?", const=True, default=False, metavar="OUT.json",
                   help="print the report as JSON; with --url, a path writes it there instead")
    u = d.add_argument_group("black-box mode: any OpenAI-compatible server (vLLM, SGLang, llama-server, kvshare)")
    u.add_argument("--url", default=None, help="the server to test, e.g. http://127.0.0.1:8000; --model M then "
                   "names the model to ask for (default: the first /v1/models lists), the other engine options "
                   "are unused")
    u.add_argument("--api-key", default=None, metavar="KEY", help="the server's key (default: $OPENAI_API_KEY)")
    u.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight at once (default: 4)")
    u.add_argument("--budget", type=float, default=120.0, metavar="SECONDS",
                   help="time for the stages; each runs at least its first group, shrinking may add as much again "
                        "(default: 120)")
    u.add_argument("--stages", default=None, metavar="LIST",
                   help="comma-separated stages to run (default: all: noise_floor, concurrency, cache, canary, "
                        "abort, multi_turn; the noise floor always runs first)")
    u.add_argument("--max-tokens", type=int, default=16, help="tokens per compared answer (default: 16)")
    u.add_argument("--report", default=None, metavar="OUT.html", help="write the HTML report there")
    u.add_argument("--replay", default=None, metavar="REPRO.jsonl",
                   help="replay a repro the doctor wrote: exit 1 if it still reproduces, 0 if not")
    # Test-only: plant a known bug class (kvshare.testing.faults) to prove the doctor finds it;
    # refused without KVSHARE_TESTING=1 (kvshare.testing.environment).
    d.add_argument("--inject-fault", action="append", default=[], help=argparse.SUPPRESS)
    add_engine_args(d)
    d.set_defaults(func=cmd_doctor)

    a = sub.add_parser("audit", help="offline audit tools")
    asub = a.add_subparsers(dest="audit_command", required=True)
    r = asub.add_parser("replay", help="re-check a recorded --kv-event-log file; exit 1 on a violation")
    r.add_argument("file")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_replay)


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.url is not None:
        return cmd_doctor_url(args)
    for name in ("report", "replay"):
        if getattr(args, name) is not None:
            print(f"error: --{name} needs --url (the in-process doctor prints its report)", file=sys.stderr)
            return 2
    from kvshare.config import EngineConfig
    from kvshare.doctor import Doctor, DoctorUsageError, builtin_workload, format_report, load_workload
    from kvshare.doctor_target import InProcessTarget
    from kvshare.testing.environment import require_testing
    from kvshare.testing.faults import FAULTS

    for f in args.inject_fault:
        try:
            require_testing(f"--inject-fault {f}")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if f not in FAULTS:
            print(f"error: --inject-fault {f!r} is unknown; known: {sorted(FAULTS)}", file=sys.stderr)
            return 2
    if args.logprob_tol is not None and not args.logprob_tol >= 0:
        print(f"error: --logprob-tol {args.logprob_tol} must be >= 0", file=sys.stderr)
        return 2
    try:
        config = EngineConfig.from_kwargs(**engine_options(args))
        doctor = Doctor(InProcessTarget(config, args.inject_fault), args.logprob_tol)
        reqs = load_workload(args.workload) if args.workload else builtin_workload(doctor.target)
        report = doctor.diagnose(reqs, args.repro_out)
    except DoctorUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["blamed_setting"] is None else 1


def cmd_doctor_url(args: argparse.Namespace) -> int:
    """Exit 0 nothing found, 1 contamination (or a replayed repro that still fails), 2 cannot test."""
    import os

    from kvshare.doctor_http import CannotTest
    from kvshare.doctor_report import format_html, format_text
    from kvshare.doctor_target import DoctorUsageError
    from kvshare.doctor_url import diagnose, open_run, read_repro, reproduces

    if args.inject_fault or args.workload:
        print("error: --url tests a running server: --workload and --inject-fault apply to the in-process "
              "doctor only", file=sys.stderr)
        return 2
    for name, value, ok in (("--concurrency", args.concurrency, args.concurrency >= 1),
                            ("--budget", args.budget, args.budget > 0), ("--max-tokens", args.max_tokens,
                                                                         args.max_tokens >= 1),
                            ("--logprob-tol", args.logprob_tol, args.logprob_tol is None or args.logprob_tol >= 0)):
        if not ok:
            print(f"error: {name} {value} is out of range (concurrency and max-tokens >= 1, budget > 0, "
                  "tolerance >= 0)", file=sys.stderr)
            return 2
    model = args.model
    from kvshare.doctor_url import STAGE_FUNCS

    unknown = sorted(set(args.stages.split(",") if args.stages else []) - set(STAGE_FUNCS))
    if unknown:
        print(f"error: --stages: unknown stage(s) {unknown}; known: {list(STAGE_FUNCS)}", file=sys.stderr)
        return 2
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request drowns the report
    try:
        run = open_run(args.url, model, args.api_key or os.environ.get("OPENAI_API_KEY"), args.concurrency,
                       args.budget, args.max_tokens, args.logprob_tol)
        if args.replay:
            case, finding = read_repro(args.replay)
            run.tol = 0.0 if run.caps.bit_transparent and args.logprob_tol is None else (
                args.logprob_tol if args.logprob_tol is not None else max(run.tol, 1e-2))
            still = reproduces(run, finding, case, tries=3)
            print(f"{'still reproduces' if still else 'does not reproduce'}: {finding.detail}")
            return 1 if still else 0
        report = diagnose(run, args.repro_out, args.stages.split(",") if args.stages else None)
    except CannotTest as e:
        print(f"cannot test: {e}", file=sys.stderr)
        return 2
    except DoctorUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            f.write(format_html(report))
    if isinstance(args.json, str):
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1) if args.json is True else format_text(report))
    return report["exit_code"]


def cmd_replay(args: argparse.Namespace) -> int:
    from kvshare.kvcache.replay import replay

    try:
        verdict = replay(args.file)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot replay {args.file!r}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict.to_dict()))
    elif verdict.clean:
        print(f"no violation in {verdict.events_checked} events")
    else:
        print(f"violation of {verdict.invariant!r} at step {verdict.step}, block {verdict.block}: {verdict.detail} "
              f"(event {verdict.events_checked})")
    return 0 if verdict.clean else 1
