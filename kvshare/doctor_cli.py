"""`kvshare doctor` and `kvshare audit replay`. Exit codes: 0 clean, 1 contamination or
violation found, 2 usage error."""
from __future__ import annotations

import argparse
import json
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
    d.add_argument("--json", action="store_true")
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
