"""`kvshare doctor`: the contamination bisection, run by the engine on itself.

The manual recipe when "the model glitched" is: rerun with prefix caching off, rerun one
request at a time, compare, shrink to a two-request repro. The doctor does exactly that:

  (a) as configured   every request concurrently, sharing as configured
  (b) sharing off     concurrently, prefix caching off and n > 1 run as n separate requests
  (c) one at a time   sharing off, each request alone: the reference

A request whose tokens or logprobs in (b) differ from (c) was changed by other requests
without any sharing: scheduling logic (batching, slot mapping, preemption). One that differs
only in (a): sharing logic (prefix cache, forks, copy-on-write, eviction). Then the blamed
setting is rerun with the audit on, to name the broken invariant and block, and shrunk to the
smallest set of requests (one, else a pair) that still diverges, written as JSONL to the path the
user names or else to a new temporary file (never into the current directory).

How equal is equal: a target that reports itself bit-transparent (no gaps in
`Target.transparency()`: for the engine, the default mode with token rows, where a request's
tokens and logprobs are the same bits alone, batched, on a prefix hit, however chunked) is held
to exact equality: a logprob one ulp off diverges, as a cached block's K one ulp off would show
nowhere else (planted fault h). A target with gaps (the exact mode, dense weights, tensor
parallel: kvshare.engine.model_setup.transparency_gaps) may differ by rounding wherever it shares,
so there logprobs within DEFAULT_TOL are called equal; the report names the gaps either way.
`--logprob-tol` overrides both.

The doctor drives a Target (kvshare.doctor_target): today the engine in this process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from kvshare.doctor_target import DoctorUsageError, Target  # noqa: F401 (DoctorUsageError re-exported)
from kvshare.errors import InvalidRequestError
from kvshare.sampling_params import SamplingParams

_PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "cache_salt",
                 "min_tokens", "stop_token_ids")
# Logprobs within this are called equal on a target that is not bit-transparent: rounding that
# follows the batch, the cache or the chunking stays well below it (docs/transparency.md).
DEFAULT_TOL = 2e-3
_FIELDS = {"id", "prompt", "prompt_token_ids", "delay_steps", "abort_after_steps", *_PARAM_FIELDS}


@dataclass
class DoctorRequest:
    id: str
    prompt: str | list[int]
    params: SamplingParams
    delay_steps: int = 0  # submitted once the concurrent run has taken this many steps
    abort_after_steps: int | None = None  # aborted this many steps after submission
    raw: dict = field(default_factory=dict)

    def expanded(self) -> list[tuple[tuple[str, int], "DoctorRequest"]]:
        """n > 1 as n independent single requests with the seeds the forks would have used."""
        n = self.params.n
        if n == 1:
            return [((self.id, 0), self)]
        out = []
        for i in range(n):
            p = dataclasses.replace(self.params, n=1, seed=None if self.params.seed is None else self.params.seed + i)
            out.append(((self.id, i), dataclasses.replace(self, id=f"{self.id}/{i}", params=p)))
        return out


def parse_request(obj: dict, where: str) -> DoctorRequest:
    if not isinstance(obj, dict):
        raise DoctorUsageError(f"{where}: each line must be a JSON object")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise DoctorUsageError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    prompt = obj.get("prompt_token_ids", obj.get("prompt"))
    if prompt is None:
        raise DoctorUsageError(f"{where}: needs 'prompt' or 'prompt_token_ids'")
    kw = {k: obj[k] for k in _PARAM_FIELDS if k in obj}
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0.0)
    kw["logprobs"] = 1
    try:
        params = SamplingParams(**kw)
    except (InvalidRequestError, TypeError, ValueError) as e:
        raise DoctorUsageError(f"{where}: {e}") from None
    if not params.greedy and params.seed is None:
        raise DoctorUsageError(f"{where}: sampling with temperature > 0 needs a 'seed' so runs can be compared")
    for k in ("delay_steps", "abort_after_steps"):
        v = obj.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise DoctorUsageError(f"{where}: {k}={v!r} must be an integer >= 0")
    return DoctorRequest(str(obj.get("id", where)), prompt, params, obj.get("delay_steps") or 0,
                         obj.get("abort_after_steps"), obj)


def load_workload(path: str) -> list[DoctorRequest]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
    except OSError as e:
        raise DoctorUsageError(f"workload {path!r}: {e.strerror}") from None
    reqs = []
    for i, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DoctorUsageError(f"{path}:{i}: not JSON ({e.msg})") from None
        reqs.append(parse_request(obj, f"{path}:{i}"))
    if not reqs:
        raise DoctorUsageError(f"workload {path!r} has no requests")
    if len({r.id for r in reqs}) != len(reqs):
        raise DoctorUsageError(f"workload {path!r}: request ids must be unique")
    return reqs


def builtin_workload(target: Target) -> list[DoctorRequest]:
    """Shared system prompt, forks, a second tenant, a late follow-up turn, one abort."""
    from kvshare.bench.workloads import ENGLISH_TEXT

    ids = target.tokenize(ENGLISH_TEXT) or list(range(1, 400))
    system = ids[:40]
    rows = []
    for i in range(8):
        row = {"id": f"q{i}", "prompt_token_ids": system + ids[100 + 23 * i:100 + 23 * i + 5 + 3 * i], "max_tokens": 12}
        if i in (2, 5):
            row.update(n=2, temperature=1.0, seed=10 + i)
        if i == 6:
            row["cache_salt"] = "tenant-b"
        rows.append(row)
    rows.append({"id": "followup", "prompt_token_ids": system + ids[100:105] + ids[300:330], "max_tokens": 12,
                 "delay_steps": 8})
    rows.append({"id": "aborted", "prompt_token_ids": system + ids[400:420], "max_tokens": 30, "abort_after_steps": 3})
    return [parse_request(r, r["id"]) for r in rows]


@dataclass
class RunResult:
    outputs: dict[tuple[str, int], tuple[list[int], list[float]]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    error: str | None = None
    audit: dict | None = None


def _drive(target: Target, reqs: list[DoctorRequest], one_at_a_time: bool, split_forks: bool) -> RunResult:
    from kvshare.kvcache.audit import AuditError

    res = RunResult()
    units: list[tuple[tuple[str, int] | None, DoctorRequest]] = []
    for r in reqs:
        units += r.expanded() if split_forks else [(None, r)]
    groups = [[u] for u in units] if one_at_a_time else [units]
    try:
        for group in groups:
            _run_group(target, group, res, one_at_a_time)
    except AuditError as e:
        res.audit = e.to_dict()
        res.error = f"audit: {e.invariant} on block {e.block} (owners {e.owners}) at step {e.step}"
    except Exception as e:  # a corrupted pool may crash anywhere: that is a finding, not a doctor bug
        res.error = f"{type(e).__name__}: {e}"
    return res


def _run_group(target: Target, group, res: RunResult, ignore_delays: bool) -> None:
    """Delays and aborts count the target's ticks (engine steps in process)."""
    pending = sorted(group, key=lambda u: 0 if ignore_delays else u[1].delay_steps)
    started: dict[str, int] = {}
    origin = {}
    steps = 0
    while pending or target.busy():
        while pending and (ignore_delays or pending[0][1].delay_steps <= steps):
            key, r = pending.pop(0)
            target.submit(r.id, r.prompt, r.params)
            started[r.id] = steps
            origin[r.id] = (key, r)
        for rid, t0 in list(started.items()):
            r = origin[rid][1]
            if r.abort_after_steps is not None and steps - t0 >= r.abort_after_steps and target.has_request(rid):
                target.abort(rid)
                key = origin[rid][0]
                res.aborted.add(key[0] if key is not None else rid)
                del started[rid]
        for out in target.advance():
            key, r = origin[out.request_id]
            for c in out.choices:
                k = key if key is not None else (r.id, c.index)
                res.outputs[k] = (c.token_ids, c.logprobs)
            started.pop(out.request_id, None)
        steps += 1


def compare(run: RunResult, ref: RunResult, tol: float, basis: str | None = None) -> dict[str, str]:
    """Request id -> how it diverged (requests aborted in either run are not compared). tol 0:
    exact equality (any logprob difference diverges); `basis` says why, in the message."""
    bad: dict[str, str] = {}
    for key, (toks, lps) in ref.outputs.items():
        rid, idx = key
        if rid in run.aborted or rid in ref.aborted or rid in bad:
            continue
        got = run.outputs.get(key)
        if got is None:
            bad[rid] = f"choice {idx}: no output ({run.error or 'missing'})"
            continue
        gt, gl = got
        n = min(len(gt), len(toks))
        first = next((i for i in range(n) if gt[i] != toks[i]), None)
        if first is not None or len(gt) != len(toks):
            pos = first if first is not None else n
            bad[rid] = f"choice {idx}: tokens differ from position {pos}"
            continue
        delta = max((abs(a - b) for a, b in zip(gl, lps)), default=0.0)
        if delta > tol:
            rule = f"tolerance {tol:.0e}" if tol else "exact equality required"
            bad[rid] = f"choice {idx}: logprobs differ by up to {delta:.2e} ({rule}{': ' + basis if basis else ''})"
    return bad


def comparison(target: Target, tol: float | None = None) -> dict:
    """How the doctor compares on `target`: the logprob tolerance (0: exact equality), why, and
    the target's transparency gaps (None: it does not say)."""
    ask = getattr(target, "transparency", None)
    gaps = ask() if ask is not None else None
    gaps = None if gaps is None else list(gaps)
    if tol is not None:
        why = f"logprob tolerance {tol:g} set by the user" if tol else "exact equality set by the user"
    elif gaps is None:
        tol, why = DEFAULT_TOL, "the target does not say whether it is bit-transparent"
    elif gaps:
        tol, why = DEFAULT_TOL, "the engine is not bit-transparent: " + "; ".join(gaps)
    else:
        tol, why = 0.0, "the engine is bit-transparent"
    return {"tolerance": tol, "exact": tol == 0, "why": why, "transparency_gaps": gaps}


class Doctor:
    def __init__(self, target: Target, tol: float | None = None) -> None:
        """tol None: exact equality when the target reports no transparency gaps, else DEFAULT_TOL."""
        self.target = target
        self.comparison = comparison(target, tol)
        self.tol = self.comparison["tolerance"]
        # A divergence message's reason (exact equality's: the why; a tolerance's speaks for itself).
        self._basis = self.comparison["why"] if self.tol == 0 else None

    def run(self, reqs: list[DoctorRequest], setting: str, audit: bool = False) -> RunResult:
        self.target.reset(sharing=setting == "configured", audit=audit)
        return _drive(self.target, reqs, setting == "one_at_a_time", setting != "configured")

    def diagnose(self, reqs: list[DoctorRequest], repro_path: str | None = None) -> dict:
        """The three settings compared, the layer blamed, and a minimal repro written to
        `repro_path` (None: a new temporary file, named in the report)."""
        ref = self.run(reqs, "one_at_a_time")
        if ref.error:
            raise RuntimeError(f"the one-at-a-time reference run failed: {ref.error}")
        settings = {}
        for name in ("configured", "sharing_off"):
            # Outputs can agree while isolation is still broken (a tenant served another
            # tenant's identical prefix): the audit is the second witness. It only observes, so a
            # clean audited run is also the outputs; one it stopped is rerun unaudited for them.
            audited = self.run(reqs, name, audit=True)
            res = audited if audited.audit is None else self.run(reqs, name)
            settings[name] = {"diverged": compare(res, ref, self.tol, self._basis), "error": res.error,
                              "audit": audited.audit}
        def broken(name):
            s = settings[name]
            return bool(s["diverged"] or s["error"] or s["audit"])

        if broken("sharing_off"):
            conclusion, blamed = "scheduling logic", "sharing_off"
        elif broken("configured"):
            conclusion, blamed = "sharing logic", "configured"
        else:
            conclusion, blamed = "no contamination found", None
        report = {"requests": len(reqs), "comparison": self.comparison, "settings": settings,
                  "conclusion": conclusion, "blamed_setting": blamed,
                  "repro": None}
        if blamed is not None:
            s = settings[blamed]
            first = next(iter(s["diverged"]), None) or _audit_request(s["audit"], reqs)
            if first is not None:
                repro = self._shrink(reqs, first, blamed, ref)
                report["repro"] = {"requests": [r.id for r in repro], "path": _write_repro(repro, repro_path)}
        return report

    def _shrink(self, reqs, rid: str, setting: str, ref: RunResult) -> list[DoctorRequest]:
        """Smallest subset around `rid` that still diverges: alone, else paired with the requests
        sharing most of its prompt. Diverging outputs are the stronger evidence, so a subset
        only the audit objects to is tried after those."""
        target = next(r for r in reqs if r.id == rid)

        def shared_prefix(r):
            a, b = r.prompt, target.prompt
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        others = sorted((r for r in reqs if r.id != rid), key=lambda r: -shared_prefix(r))[:16]
        subsets = [[target]] + [sorted([o, target], key=reqs.index) for o in others]
        for audited in (False, True):
            for subset in subsets:
                if self._diverges(subset, setting, ref, audited):
                    return subset
        return list(reqs)

    def _diverges(self, subset, setting, ref, audited: bool) -> bool:
        if audited:
            return self.run(subset, setting, audit=True).audit is not None
        ids = {r.id for r in subset}
        sub_ref = RunResult({k: v for k, v in ref.outputs.items() if k[0] in ids}, ref.aborted)
        res = self.run(subset, setting)
        return bool(res.error or compare(res, sub_ref, self.tol, self._basis))


def _write_repro(repro: list[DoctorRequest], path: str | None) -> str:
    if path is None:
        fd, path = tempfile.mkstemp(prefix="kvshare-doctor-repro-", suffix=".jsonl")
        os.close(fd)
    with open(path, "w", encoding="utf-8") as f:
        for r in repro:
            f.write(json.dumps(r.raw) + "\n")
    return path


def _audit_request(audit: dict | None, reqs: list[DoctorRequest]) -> str | None:
    """The request named by an audit finding (owners are sequence ids: request or request#i)."""
    if not audit:
        return None
    ids = {r.id for r in reqs}
    for owner in audit["owners"]:
        rid = owner.split("#")[0].split("/")[0]
        if rid in ids:
            return rid
    return None


def format_report(report: dict) -> str:
    lines = [f"kvshare doctor: {report['requests']} requests, three settings compared"]
    c = report.get("comparison")
    if c is not None:
        rule = "exact equality" if c["exact"] else f"logprobs within {c['tolerance']:g}"
        lines.append(f"  compared by {rule}: {c['why']}")
    names = {"configured": "(a) as configured", "sharing_off": "(b) sharing off"}
    for name, s in report["settings"].items():
        status = "matches" if not s["diverged"] and not s["error"] else "DIVERGES"
        if s["audit"]:
            status += ", audit finds a violation"
        lines.append(f"  {names[name]:<20} vs (c) one at a time: {status}")
        for rid, why in s["diverged"].items():
            lines.append(f"      request {rid}: {why}")
        if s["error"]:
            lines.append(f"      run failed: {s['error']}")
    lines.append(f"conclusion: {report['conclusion']}")
    for name, s in report["settings"].items():
        a = s["audit"]
        if a:
            lines.append(f"audit under {names[name]}: invariant {a['invariant']!r} broken at step {a['step']}, "
                         f"block {a['block']}, owners {a['owners']}: {a['detail']}")
    if report["repro"]:
        r = report["repro"]
        lines.append(f"minimal repro: requests {r['requests']}" + (f" written to {r['path']}" if r["path"] else ""))
    return "\n".join(lines)
