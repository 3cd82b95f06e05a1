"""`kvshare doctor --url`: the contamination bisection from the outside, against any
OpenAI-compatible server (kvshare, vLLM, SGLang, llama-server), over its HTTP API only.

Each stage is a step of the manual recipe, aimed at one sharing path (STAGES): run requests the
way the path is exercised (concurrently, warm, after aborts, as a next turn), run each again alone
on a cold cache (a fresh `cache_salt` where the server takes one) as the reference, compare. How
equal is equal: a server that says it is bit-transparent (kvshare's /version) is held to exact
equality; any other is judged against its noise floor, measured first by repeating one greedy
request alone. A canary (a unique code a request's prompt makes the model repeat) seen in another
request's answer is contamination whatever the noise floor.

A difference beyond the noise is shrunk to the smallest case that still reproduces (the request
alone, else a pair, sequential or concurrent; each tried on a fresh salt) and written as JSONL
with a curl script to replay it (`kvshare doctor --url URL --replay FILE` checks it).
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shlex
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kvshare.doctor_http import CannotTest, Capabilities, Diff, Output, Server, compare
from kvshare.doctor_target import DoctorUsageError

# Prefix lengths (tokens) where the shared prefix ends on, just before or just after a KV block
# boundary for the block sizes servers use (16 in vLLM and kvshare, 32, 64, ... elsewhere).
BOUNDARY_LENGTHS = (16, 32, 64, 128, 256)
# The smallest logprob tolerance a server that is not bit-transparent is judged by: repeating a
# request alone measures run-to-run noise, not the rounding a different batch shape brings.
MIN_NOISE_TOL = 1e-2
TOP = 2  # top logprobs asked for, where offered: near ties are told apart from changed tokens
# How long a victim timed against another request decodes (tokens, ignore_eos where taken): the
# other request arrives after its first chunk and is served (or cut) within a few steps, so the
# victim still reads its KV for tens of steps after, crossing several block boundaries (16 tokens
# each in vLLM and kvshare), whatever the machine's speed.
TIMED_VICTIM_TOKENS = 48

STAGES = {
    "noise_floor": "none: the same greedy request alone, repeated (cold each time where cache_salt works), "
                   "streamed and not",
    "concurrency": "batching and prefix sharing between concurrent requests: batch mates sharing a prefix that "
                   "ends around KV block boundaries, an unrelated mate, n=2 forks of one prompt",
    "forks": "forks (n > 1) sharing the prompt's tail block: copy-on-write (sampled, seeded forks each compared "
             "with its choice re-run alone)",
    "cache": "the prefix cache: a full hit, a partial hit (a prompt that differs only after the shared prefix), "
             "a streamed hit; cache_salt namespaces (a hit across salts)",
    "canary": "any path that moves content between concurrent requests: each carries a unique code its answer "
              "repeats, scanned for in every other answer",
    "abort": "aborts that free shared blocks: streams cut after the first chunk, cancel-and-retry, a client "
             "timeout, a request over the context, then the survivors and what follows",
    "adapters": "LoRA adapters the server lists (/v1/models entries whose parent is the model): the same prompt "
                "under the base model and each adapter, one after another on one cache_salt, then together; each "
                "compared with itself alone (a cache key without the adapter serves one the other's KV)",
    "multi_turn": "a turn's own blocks reused by the next turn (blocks published before their KV is written): "
                  "turn 1 ends on a block boundary, turn 2 extends it",
}


@dataclass
class Req:
    name: str
    endpoint: str  # "completions" or "chat"
    body: dict  # without cache_salt; `model` only where it is not the run's (a LoRA adapter's name)
    cut_after: int | None = None  # a stream closed after this many chunks
    timeout: float | None = None  # the client gives up after this many seconds
    salt: str | None = "run"  # the same label: the same cache namespace in one run of a case; None: no salt
    compared: bool = True  # cut, timed-out and refused requests are exercised, not compared
    # Sent when this request of the same step has streamed its first chunk (it is running, its
    # prompt's KV written), not at the step's start: an order the server's speed cannot change.
    after: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "endpoint": self.endpoint, "body": self.body, "cut_after_chunks": self.cut_after,
                "timeout_s": self.timeout, "salt_label": self.salt, "after_first_chunk_of": self.after}


Case = list[list[Req]]  # steps in order; the requests of a step concurrently


@dataclass
class Finding:
    stage: str
    kind: str  # "output": differs from its cold alone run; "canary": another's canary; "salt_leak"
    victim: str
    case: Case
    expected: Output
    got: Output
    diff: Diff | None
    detail: str
    beyond_noise: bool = True

    def to_dict(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "victim": self.victim, "detail": self.detail,
                "beyond_noise": self.beyond_noise, "expected": self.expected.to_dict(), "got": self.got.to_dict(),
                "diff": self.diff.to_dict() if self.diff else None,
                "case": [[r.to_dict() for r in step] for step in self.case]}


@dataclass
class StageResult:
    name: str
    verdict: str = "clean"  # clean | within noise | contamination | error | skipped
    requests: list[dict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "path": STAGES[self.name], "verdict": self.verdict, "requests": self.requests,
                "findings": [f.to_dict() for f in self.findings], "notes": self.notes,
                "seconds": round(self.seconds, 2)}


class Run:
    """One doctor run against one server: capabilities, tolerance, cold references, the clock."""

    def __init__(self, server: Server, caps: Capabilities, concurrency: int, max_tokens: int, deadline: float,
                 tol: float | None) -> None:
        self.server, self.caps = server, caps
        self.concurrency, self.max_tokens, self.deadline = concurrency, max_tokens, deadline
        self.tag = secrets.token_hex(3)
        self.user_tol = tol
        self.tol = tol if tol is not None else 0.0
        self.noisy_tokens = False
        self.words = _words()
        self.tokens_per_word = 1.3
        self.sent = 0
        self._refs: dict[str, Output] = {}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def fresh_salt(self) -> str:
        return f"kvshare-doctor-{self.tag}-{secrets.token_hex(4)}"

    def body(self, endpoint: str, content, max_tokens: int | None = None, **extra) -> dict:
        mt = max_tokens or self.max_tokens
        if endpoint == "chat":
            b = {"messages": content, "max_tokens": mt, "temperature": 0}
            if self.caps.logprobs:
                b.update(logprobs=True, top_logprobs=TOP)
        else:
            b = {"prompt": content, "max_tokens": mt, "temperature": 0}
            if self.caps.logprobs:
                b["logprobs"] = TOP
        b.update(extra)
        return b

    def text(self, tokens: int, offset: int) -> str:
        """About `tokens` tokens of English (calibrated on this server's tokenizer), from word `offset`."""
        n = max(1, round(tokens / self.tokens_per_word))
        words = [self.words[(offset + i) % len(self.words)] for i in range(n)]
        return " ".join(words)

    def send(self, req: Req, salt: str | None, on_first_chunk=None) -> Output:
        body = dict(req.body)
        if salt is not None and self.caps.takes("cache_salt"):
            body["cache_salt"] = salt
        self.sent += 1
        return self.server.send(req.endpoint, body, req.cut_after, req.timeout, on_first_chunk)

    def run_case(self, case: Case, salts: dict[str, str] | None = None) -> dict[str, Output]:
        """Each step's requests concurrently (one whose `after` names another once that one's first
        chunk has arrived), steps in order; each salt label a fresh salt (unless `salts`, filled as
        labels are met, carries it over from an earlier call)."""
        salts = {} if salts is None else salts
        outs: dict[str, Output] = {}
        for step in case:
            for r in step:
                if r.salt is not None:
                    salts.setdefault(r.salt, self.fresh_salt())
            started = {r.name: threading.Event() for r in step}

            def send(r: Req) -> Output:
                if r.after is not None:
                    started[r.after].wait()
                try:
                    return self.send(r, salts.get(r.salt), started[r.name].set)
                finally:
                    started[r.name].set()  # not streamed, or failed first: what waits on it goes now

            with ThreadPoolExecutor(len(step)) as ex:
                futures = {r.name: ex.submit(send, r) for r in step}
            outs.update({name: f.result() for name, f in futures.items()})
        return outs

    def timed_victim(self, victim: Req) -> Req:
        """`victim` streamed and long enough to be still decoding well after a request sent after
        its first chunk has been served or cut (ignore_eos where taken, so it does not stop early)."""
        prompt_words = len(_content(victim).split())
        room = (self.caps.max_model_len or 2048) - round(prompt_words * self.tokens_per_word * 1.5) - 8
        body = {**victim.body, "stream": True,
                "max_tokens": max(victim.body.get("max_tokens") or 0, min(TIMED_VICTIM_TOKENS, room))}
        if self.caps.takes("ignore_eos"):
            body["ignore_eos"] = True
        return replace(victim, body=body, cut_after=None, timeout=None, after=None)

    def reference(self, req: Req) -> Output:
        """The request alone on a cold cache (its own fresh salt), not streamed: what it should say."""
        key = json.dumps([req.endpoint, {k: v for k, v in req.body.items() if k != "stream"}], sort_keys=True)
        if key not in self._refs:
            self._refs[key] = self.send(replace(req, body={k: v for k, v in req.body.items() if k != "stream"},
                                                cut_after=None, timeout=None), self.fresh_salt())
        return self._refs[key]

    def check(self, stage: StageResult, case: Case, outs: dict[str, Output]) -> None:
        """Every compared request of `case` against its reference; findings into `stage`."""
        for step in case:
            for r in step:
                if not r.compared:
                    continue
                ref = self.reference(r)
                if ref.error:
                    stage.findings.append(Finding(stage.name, "output", r.name, case, ref, ref, None,
                                                  f"{r.name}: sent alone, it failed: {ref.error}"))
                    continue
                got = outs[r.name]
                for i, choice in enumerate(got.choices or [got]):
                    diff = compare(choice, ref, self.tol, self.noisy_tokens)
                    if diff is not None:
                        label = r.name if len(got.choices) <= 1 else f"{r.name} (choice {i})"
                        stage.findings.append(Finding(stage.name, "output", r.name, case, ref, choice, diff,
                                                      f"{label}: {diff.why}", diff.beyond_noise))
        stage.requests += [_summary(r) for step in case for r in step]


def _words() -> list[str]:
    from kvshare.bench.workloads import ENGLISH_TEXT

    return ENGLISH_TEXT.split()


def _summary(r: Req) -> dict:
    content = r.body.get("prompt") or json.dumps(r.body.get("messages"))
    how = "streamed" if r.body.get("stream") else "not streamed"
    if r.cut_after is not None:
        how += f", cut after {r.cut_after} chunk(s)"
    if r.timeout is not None:
        how += f", client timeout {r.timeout:g} s"
    if r.after is not None:
        how += f", sent after {r.after}'s first chunk"
    if "model" in r.body:
        how += f", under {r.body['model']}"
    return {"name": r.name, "endpoint": r.endpoint, "max_tokens": r.body.get("max_tokens"), "how": how,
            "salt": r.salt, "content": content if len(content) <= 240 else content[:110] + " ... " + content[-110:]}


# -- stages --------------------------------------------------------------------------------------

def stage_noise_floor(run: Run, st: StageResult) -> None:
    prompt = f"Doctor run {run.tag}, noise floor. " + run.text(40, 0)
    base = Req("alone", "completions", run.body("completions", prompt))
    runs = [run.reference(base)] + [run.send(base, run.fresh_salt()) for _ in range(2)]
    streamed = run.send(replace(base, name="alone streamed", body={**base.body, "stream": True}), run.fresh_salt())
    st.requests += [_summary(base)] * 3 + [_summary(replace(base, name="alone streamed",
                                                            body={**base.body, "stream": True}))]
    failed = [o.error for o in runs + [streamed] if o.error]
    if failed:
        raise CannotTest(f"a greedy request alone failed: {failed[0]}")
    ref = runs[0]
    spread, flips = 0.0, []
    for other in runs[1:] + [streamed]:
        n = next((i for i, (a, b) in enumerate(zip(other.tokens, ref.tokens)) if a != b), None)
        upto = min(len(other.tokens), len(ref.tokens)) if n is None else n
        spread = max([spread] + [abs(a - b) for a, b in zip(other.logprobs[:upto], ref.logprobs[:upto])])
        if other.text != ref.text:
            flips.append((n, other))
    spread_text = f"logprob spread {spread:.3g}" if run.caps.logprobs else "no logprobs (text compared)"
    st.notes.append(f"repeated alone 4 times: {spread_text}, {len(flips)} of 3 repeats with different text")
    if run.caps.bit_transparent:
        run.tol = 0.0 if run.user_tol is None else run.user_tol
        for n, other in flips:
            diff = compare(other, ref, run.tol)
            st.findings.append(Finding(st.name, "output", "alone", [[base]], ref, other, diff,
                                       "the server says it is bit-transparent, yet the same request alone answered "
                                       f"differently: {diff.why} (what differs is left over from earlier requests)"))
        if spread > run.tol and not flips:
            diff = compare(runs[-1], ref, run.tol) or compare(streamed, ref, run.tol)
            st.findings.append(Finding(st.name, "output", "alone", [[base]], ref, runs[-1], diff,
                                       f"the server says it is bit-transparent, yet repeats alone differ in "
                                       f"logprobs by {spread:.3g}"))
        return
    for n, other in flips:
        alts = sorted(ref.top[n].values(), reverse=True) if n is not None and n < len(ref.top) else []
        if len(alts) >= 2 and alts[0] - alts[1] > 0.5:
            raise CannotTest(f"no greedy decoding: temperature 0 alone gave a different token at position {n} "
                             f"where the top two were {alts[0] - alts[1]:.2f} apart")
    run.noisy_tokens = bool(flips)
    run.tol = run.user_tol if run.user_tol is not None else max(2 * spread, MIN_NOISE_TOL)
    if flips:
        st.verdict = "within noise"


def stage_concurrency(run: Run, st: StageResult) -> None:
    limit = (run.caps.max_model_len or 2048) - 3 * run.max_tokens - 16
    lengths = [L + d for L in BOUNDARY_LENGTHS for d in (0, -1, 1) if L + d <= limit]
    lengths.sort(key=lambda L: (BOUNDARY_LENGTHS.index(min(BOUNDARY_LENGTHS, key=lambda b: abs(b - L))) // 2,
                                L % 16 != 0, L))
    for done, L in enumerate(lengths):
        if done and run.time_left() <= 0:
            st.notes.append(f"budget spent: prefix lengths {lengths[done:]} not run")
            break
        prefix = f"Doctor run {run.tag}, batch {L}. " + run.text(L - 10, 7 * done)
        mates = [Req(f"P{L}+{i}", "completions",
                     run.body("completions", prefix + " " + run.text(4 + 2 * i, 300 + 11 * i)))
                 for i in range(max(1, run.concurrency - 1))]
        mates.append(Req(f"other{L}", "completions",
                         run.body("completions", f"Unrelated {run.tag} {L}: " + run.text(20, 500 + done))))
        if not done and run.caps.takes("n"):
            mates.append(Req(f"P{L}+0 n=2", "completions", {**mates[0].body, "n": 2}))
        case = [mates]
        for r in mates:
            run.reference(r)
        run.check(st, case, run.run_case(case))


def stage_forks(run: Run, st: StageResult) -> None:
    """Greedy forks write the same token into the block they share, so a fork that writes in place
    (no copy-on-write) changes nothing visible; sampled forks diverge at once. Choice i of a seeded
    n-choice request samples as the request alone with seed + i (vLLM's convention, kvshare's too),
    so each choice has a cold reference. Prompts of three lengths: those ending inside a block put
    each fork's first sampled token into the shared tail block."""
    if not (run.caps.takes("n") and run.caps.takes("seed")):
        st.verdict = "skipped"
        st.notes.append("the server does not take both n and seed: sampled forks have no reference")
        return
    # All three lengths whatever the budget (9 short requests): one prompt may end on a block
    # boundary, or both forks may sample the same first token.
    for k in range(3):
        seed = 1000 + 7 * k
        prompt = f"Doctor run {run.tag}, forks {k}. " + run.text(20 + 13 * k, 600 + 17 * k)
        sampled = {"temperature": 1.0, "seed": seed}
        fork = Req(f"fork{k} n=2", "completions", run.body("completions", prompt, n=2, **sampled))
        alone = [Req(f"fork{k} choice {i} alone", "completions",
                     run.body("completions", prompt, **{**sampled, "seed": seed + i})) for i in range(2)]
        out = run.run_case([[fork]])[fork.name]
        st.requests += [_summary(fork)] + [_summary(r) for r in alone]
        choices = out.choices or [out]
        for i, r in enumerate(alone):
            ref = run.reference(r)
            if ref.error or i >= len(choices):
                st.notes.append(f"{r.name}: {ref.error or 'the fork request returned fewer choices'}")
                continue
            diff = compare(choices[i], ref, run.tol)
            if diff is None:
                continue
            beyond = _sampled_beyond_noise(diff, run.tol) or choices[i].error is not None
            st.findings.append(Finding(st.name, "output", fork.name, [[fork]], ref, choices[i], diff,
                                       f"{fork.name} choice {i} (against {r.name}): {diff.why}", beyond))


def _seeded_choices(body: dict) -> list[dict] | None:
    """A sampled, seeded n-choice request's choices as single requests (choice i: seed + i); None
    for any other request."""
    n, seed = body.get("n", 1), body.get("seed")
    if n <= 1 or seed is None or not body.get("temperature"):
        return None
    one = {k: v for k, v in body.items() if k not in ("n", "stream")}
    return [{**one, "seed": seed + i} for i in range(n)]


def _sampled_beyond_noise(diff: Diff, tol: float) -> bool:
    # A sampled token can flip where noise moves the sampling boundary; only a drift past the
    # tolerance (any difference when exact) says the fork read KV it does not own.
    return tol == 0 or max(diff.drift, default=0.0) > tol


def stage_cache(run: Run, st: StageResult) -> None:
    prefix = f"Doctor run {run.tag}, cache. " + run.text(56, 40)
    a = Req("A", "completions", run.body("completions", prefix + " " + run.text(6, 200)))
    b = Req("B", "completions", run.body("completions", prefix + " " + run.text(9, 260)))
    for r in (a, b):
        run.reference(r)
    case = [[a], [replace(a, name="A warm")], [b],
            [replace(b, name="B warm streamed", body={**b.body, "stream": True})]]
    outs = run.run_case(case)
    run.check(st, case, outs)
    if not run.caps.takes("cache_salt"):
        st.notes.append("cache_salt not accepted: cold references are first runs, salt isolation not checked")
        return
    reuse = outs["A warm"].cached_tokens
    if reuse is None:
        st.notes.append("the server reports no usage.prompt_tokens_details.cached_tokens: salt isolation not checked")
        return
    st.notes.append(f"A's second run reused {reuse} cached prompt tokens"
                    + (" (no prefix caching seen: the warm comparisons exercised nothing)" if not reuse else ""))
    # A salt the server takes but ignores: a prompt cached under one salt hits under another.
    b2 = replace(b, name="B salt x", salt="x")
    ignored = run.run_case([[b2], [replace(b2, name="B salt x again")], [replace(b, name="B salt y", salt="y")]])
    st.requests += [_summary(b2)] * 3
    if ignored["B salt x again"].cached_tokens and ignored["B salt y"].cached_tokens:
        run.caps.accepted["cache_salt"] = False
        run.caps.refused["cache_salt"] = "accepted but ignored: a prompt cached under one salt hit under another"
        st.notes.append("cache_salt is accepted but ignored (a prompt cached under one salt hit under another): "
                        "no cold references, no tenant isolation through it; not contamination")
        return
    # The unsalted namespace too: a lookup that drops the salt finds exactly what unsalted requests cached.
    unsalted = replace(a, name="A unsalted", salt=None)
    other = replace(a, name="A other salt", salt="other")
    leak_case = [[unsalted], [replace(a, name="A salted")], [other]]
    leak = run.run_case(leak_case)["A other salt"]
    st.requests += [_summary(r) for step in leak_case for r in step]
    if leak.cached_tokens:
        st.findings.append(Finding(st.name, "salt_leak", other.name, leak_case, Output(cached_tokens=0), leak, None,
                                   f"a request under a fresh cache_salt reused {leak.cached_tokens} prompt tokens "
                                   "cached without it or under another salt: cache_salt does not isolate tenants"))


def stage_adapters(run: Run, st: StageResult) -> None:
    names = run.caps.adapters[:max(1, run.concurrency - 1)]
    if not names:
        st.verdict = "skipped"
        st.notes.append("the server lists no LoRA adapter (no /v1/models entry has the model as its parent)")
        return
    st.notes.append(f"adapters tried: {names} (of {len(run.caps.adapters)} listed)")
    prompt = f"Doctor run {run.tag}, adapters. " + run.text(40, 320)
    base = Req("base", "completions", run.body("completions", prompt))
    under = [Req(f"adapter {n}", "completions", {**base.body, "model": n}) for n in names]
    for r in (base, *under):
        run.reference(r)
    # The base model first, so a lookup that drops the adapter finds the base model's blocks.
    case = [[base]] + [[r] for r in under] + [[replace(base, name="base again")]]
    outs = run.run_case(case)
    run.check(st, case, outs)
    if run.time_left() <= 0:
        return
    together = [[replace(r, name=f"{r.name} together") for r in (base, *under)]]
    run.check(st, together, run.run_case(together))


def stage_canary(run: Run, st: StageResult) -> None:
    rng = random.Random(run.tag)
    shared = f"Doctor run {run.tag}, canaries. Each line repeats its own code exactly."
    codes = ["".join(rng.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(4)) + str(rng.randrange(1000, 9999))
             for _ in range(max(2, run.concurrency))]
    reqs = [Req(f"canary{i}", "completions",
                run.body("completions", f"{shared}\nCode: {c}. Code: {c}. Code: {c}. Code:",
                         max_tokens=max(run.max_tokens, 16)))
            for i, c in enumerate(codes)]
    for r in reqs:
        run.reference(r)
    for rnd in range(2):
        if rnd and run.time_left() <= 0:
            break
        case = [[replace(r, name=f"{r.name}.{rnd}") for r in reqs]]
        outs = run.run_case(case)
        for i, r in enumerate(case[0]):
            out = outs[r.name]
            alts = "".join(t for top in out.top for t in top if len(t.strip()) >= 4)
            for j, code in enumerate(codes):
                if j != i and (code in out.text or code in alts):
                    st.findings.append(Finding(st.name, "canary", r.name, case, run.reference(reqs[i]), out, None,
                                               f"{r.name} answered with {case[0][j].name}'s canary {code!r}: "
                                               f"{out.text!r}"))
        run.check(st, case, outs)
    echoed = sum(c in run.reference(r).text for c, r in zip(codes, reqs))
    st.notes.append(f"{echoed} of {len(codes)} requests repeat their own canary alone")


def stage_abort(run: Run, st: StageResult) -> None:
    # The victim is running (its prompt's blocks written and cached) and keeps decoding for tens of
    # steps when the first cut lands: sent after the victim's first chunk, it shares the victim's
    # prefix (about three blocks), then goes its own way for two blocks more, and is cut after its
    # own first chunk. So an abort frees blocks the victim still holds (handed out again, to the
    # victim's next block or another's, while the victim reads them), and the cut's own new blocks
    # are allocated while the victim's cached blocks are held (an allocator that evicts a held
    # block overwrites the victim's KV). The other cuts and the timeout start with the victim:
    # what they leave in the free queue is used up before the first cut lands.
    prefix = f"Doctor run {run.tag}, aborts. " + run.text(40, 120)
    victim = run.timed_victim(Req("victim", "completions", run.body("completions", prefix + " " + run.text(20, 330))))
    cut = [Req(f"cut{i}", "completions", run.body("completions", prefix + " " + run.text(36 + 3 * i, 360 + 9 * i),
                                                   max_tokens=4 * run.max_tokens, stream=True),
               cut_after=1, compared=False, after=None if i else victim.name)
           for i in range(max(1, run.concurrency - 1))]
    timed_out = Req("timeout", "completions", run.body("completions", prefix + " " + run.text(6, 420),
                                                       max_tokens=8 * run.max_tokens),
                    timeout=0.05, compared=False)
    over = Req("over context", "completions", run.body("completions", prefix + " " + run.text(4, 450),
                                                       max_tokens=(run.caps.max_model_len or 100_000) + 1),
               timeout=2.0, compared=False)  # a server that serves it anyway is cut, not waited for
    retries = [replace(r, name=f"retry{i}", body={**r.body, "max_tokens": run.max_tokens, "stream": False},
                       cut_after=None, compared=True, after=None) for i, r in enumerate(cut)]
    short = {**victim.body, "max_tokens": run.max_tokens}  # what follows the aborts: no need to be long
    case = [[victim, *cut, timed_out, over],
            [replace(victim, name="victim again", body={**short, "stream": False}), *retries],
            [replace(victim, name="victim after", body=short)]]
    outs = run.run_case(case)
    if outs["over context"].error in (None, "client timeout"):
        st.notes.append("a request with max_tokens over the context length was served, not refused")
    run.check(st, case, outs)


def stage_multi_turn(run: Run, st: StageResult) -> None:
    endpoint = "chat" if run.caps.chat else "completions"
    if endpoint != "chat":
        st.notes.append("no chat endpoint: turns are plain completions")
    for k in range(2):
        if k and run.time_left() <= 0:
            break
        question = f"Doctor run {run.tag}, turn {k}. Tell me about this: " + run.text(12 + 9 * k, 520 + 20 * k)
        first = [{"role": "user", "content": question}] if endpoint == "chat" else question
        probe = run.send(Req("probe", endpoint, run.body(endpoint, first, max_tokens=1)), run.fresh_salt())
        if probe.error or probe.prompt_tokens is None:
            st.notes.append(f"turn 1's prompt length unknown ({probe.error or 'no usage'}): its end is not aimed "
                            "at a block boundary")
        # Turn 1 ends on a multiple of 16 tokens: the last block it fills holds the one token
        # whose KV a finished request never computes.
        m = (-(probe.prompt_tokens or 0)) % 16
        m = m + 16 if m < 3 else m
        turn1 = Req(f"turn1.{k}", endpoint, run.body(endpoint, first, max_tokens=m))
        salts: dict[str, str] = {}
        out1 = run.run_case([[turn1]], salts)[turn1.name]
        if out1.error:
            st.findings.append(Finding(st.name, "output", turn1.name, [[turn1]], Output(), out1,
                                       compare(out1, Output(), 0), f"turn 1 failed: {out1.error}"))
            continue
        if out1.finish_reason != "length":
            st.notes.append(f"turn1.{k} stopped early ({out1.finish_reason}): it may not end on a block boundary")
        if endpoint == "chat":
            follow = first + [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "Go on."}]
        else:
            follow = question + out1.text + "\nGo on:"
        turn2 = Req(f"turn2.{k}", endpoint, run.body(endpoint, follow))
        run.reference(turn2)
        turn1.compared = True
        case = [[turn1], [turn2]]
        outs = {turn1.name: out1, **run.run_case([[turn2]], salts)}
        run.check(st, case, outs)


STAGE_FUNCS = {"noise_floor": stage_noise_floor, "concurrency": stage_concurrency, "forks": stage_forks,
               "cache": stage_cache,
               "canary": stage_canary, "abort": stage_abort, "adapters": stage_adapters,
               "multi_turn": stage_multi_turn}


# -- bisection and repro -------------------------------------------------------------------------

def reproduces(run: Run, finding: Finding, case: Case, tries: int = 2, alone_seen: dict | None = None) -> bool:
    """Whether `case` (each try on fresh salts) still shows the finding on its victim: its answer
    differs from the victim sent alone on a cold cache right after (on this server, now: what a
    broken server answered alone during the run may itself be wrong), or carries another's canary.
    `alone_seen` keeps each alone answer for the later tries and candidates of one shrink."""
    alone_seen = {} if alone_seen is None else alone_seen
    victim = next(r for step in case for r in step if r.name == finding.victim)
    for _ in range(tries):
        outs = run.run_case(case)
        got = outs[finding.victim]
        if finding.kind == "salt_leak":
            if got.cached_tokens:
                return True
            continue
        if finding.kind == "canary":
            if any(c in got.text for c in _codes(case, finding.victim)):
                return True
        singles = _seeded_choices(victim.body)
        if singles is not None:  # each sampled fork against its choice alone
            for choice, body in zip(got.choices or [got], singles):
                alone = run.send(replace(victim, body=body, cut_after=None, timeout=None), run.fresh_salt())
                diff = None if alone.error else compare(choice, alone, run.tol)
                if diff is not None and (choice.error or _sampled_beyond_noise(diff, run.tol)):
                    return True
            continue
        body = {k: v for k, v in victim.body.items() if k != "stream"}
        key = json.dumps([victim.endpoint, body], sort_keys=True)
        if key not in alone_seen:
            alone_seen[key] = run.send(replace(victim, body=body, cut_after=None, timeout=None, after=None),
                                       run.fresh_salt())
        alone = alone_seen[key]
        if alone.error:
            del alone_seen[key]
            continue
        diff = compare(got, alone, run.tol, run.noisy_tokens)
        if diff is not None and diff.beyond_noise:
            return True
    return False


def _codes(case: Case, victim: str) -> list[str]:
    """The other requests' canaries in `case`."""
    out = []
    for step in case:
        for r in step:
            p = r.body.get("prompt") or ""
            if r.name != victim and "Code: " in p:
                out.append(p.rsplit("Code: ", 2)[1].rstrip(". "))
    return out


def shrink(run: Run, finding: Finding, extra_seconds: float) -> tuple[Case, bool]:
    """The smallest case that still reproduces: the victim alone, else with one other request,
    others sharing more of its prompt first. One from an earlier step goes before it (then beside
    it); one from its own step first goes timed against it (the victim streamed and long, the
    other sent after the victim's first chunk, cut as it was: harm that needs the victim to be
    running when the other arrives or is aborted, reproduced whatever the machine's speed), then
    beside it, then before it. (case, minimal?)."""
    stop = time.monotonic() + extra_seconds
    steps = {r.name: i for i, step in enumerate(finding.case) for r in step}
    reqs = {r.name: r for step in finding.case for r in step}
    victim = replace(reqs[finding.victim], after=None)
    # A victim whose own earlier turn is its prompt (multi-turn) needs that turn before it.
    # Requests the stage timed on the victim first, then those cut or timed out (an abort is the
    # likeliest harm in a case that has one).
    others = sorted((r for r in reqs.values() if r.name != victim.name),
                    key=lambda r: (r.after != victim.name, r.cut_after is None and r.timeout is None,
                                   -_common(_content(r), _content(victim))))
    # The victim alone is tried once where pairs are left to try (one that reproduces is still a
    # repro of two at most), twice where it is the only candidate.
    candidates: list[tuple[Case, int]] = [] if finding.kind == "salt_leak" else [([[victim]], 1 if others else 2)]
    for o in others[:6]:
        o = replace(o, after=None)
        before = [[o], [victim]]
        beside = [[o, victim]]
        if steps[o.name] < steps[victim.name]:
            candidates += [(before, 2), (beside, 2)]
        else:
            timed = run.timed_victim(victim)
            candidates += [([[timed, replace(o, after=timed.name)]], 2), (beside, 2), (before, 2)]
    alone_seen: dict = {}
    for cand, tries in candidates:
        if time.monotonic() > stop:
            break
        if reproduces(run, finding, cand, tries, alone_seen):
            return cand, True
    return finding.case, False


def _content(r: Req) -> str:
    return r.body.get("prompt") or json.dumps(r.body.get("messages"))


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_repro(path: str | None, server: Server, case: Case, finding: Finding) -> tuple[str, str]:
    """The case as JSONL (one request a line, with the victim's expected answer) and a curl
    script; the two paths."""
    if path is None:
        fd, path = tempfile.mkstemp(prefix="kvshare-doctor-repro-", suffix=".jsonl")
        os.close(fd)
    salts = {}
    lines = []
    for i, step in enumerate(case):
        for r in step:
            salt = None if r.salt is None else salts.setdefault(r.salt, f"repro-{secrets.token_hex(4)}")
            line = {"step": i, **r.to_dict(), "model": r.body.get("model", server.model), "cache_salt": salt,
                    "victim": r.name == finding.victim}
            if r.name == finding.victim:
                line.update(kind=finding.kind, expect=finding.expected.to_dict(), detail=finding.detail)
            lines.append(line)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    script = os.path.splitext(path)[0] + ".sh"
    with open(script, "w", encoding="utf-8") as f:
        f.write(curl_script(server, lines))
    return path, script


def curl_script(server: Server, lines: list[dict]) -> str:
    """The repro as a shell script: one function per request (a stream cut after k chunks closes
    once its k-th `data:` line is read), each step's requests together, a request timed on another
    started by that one's first streamed chunk (`after_first_chunk`), then `wait`."""
    out = ["#!/bin/sh", "# kvshare doctor repro: run twice with a new cache_salt each time (sed -i s/repro-/repro2-/)",
           "# (the server caches what the first run sent); compare the victim's answer with 'expect' in the JSONL.",
           'KEY="${OPENAI_API_KEY:-}"',
           "# Print a stream as it comes; at its first data: line start the functions named (in the background).",
           "after_first_chunk() {",
           "  go=",
           "  while IFS= read -r line; do",
           "    printf '%s\\n' \"$line\"",
           "    case \"$line\" in data:*) if [ -z \"$go\" ]; then go=1; for f in \"$@\"; do \"$f\" & done; fi;; esac",
           "  done",
           "  if [ -z \"$go\" ]; then for f in \"$@\"; do \"$f\" & done; fi  # not streamed: after its answer",
           "  wait",
           "}"]
    func = {}
    for k, line in enumerate(lines):
        func[(line["step"], line["name"])] = f"req{k}"
        path = "/v1/chat/completions" if line["endpoint"] == "chat" else "/v1/completions"
        body = {"model": line["model"], **line["body"]}
        if line.get("salt_label") is not None:
            body["cache_salt"] = line["cache_salt"]
        limit = f" --max-time {line['timeout_s']}" if line.get("timeout_s") else ""
        stream = " -N" if body.get("stream") else ""
        cut = (f" | awk '/^data:/ {{ print; if (++n >= {int(line['cut_after_chunks'])}) exit }}'"
               if line.get("cut_after_chunks") else "")
        out.append(f"# {line['name']}" + (" (victim)" if line["victim"] else ""))
        out.append(f"req{k}() {{ curl -sS{stream}{limit} {shlex.quote(server.root + path)} "
                   f"-H 'Content-Type: application/json' -H \"Authorization: Bearer $KEY\" "
                   f"-d {shlex.quote(json.dumps(body))}{cut}; echo; }}")
    for step in sorted({line["step"] for line in lines}):
        here = [line for line in lines if line["step"] == step]
        out.append(f"# step {step}" + (" (together)" if len(here) > 1 else ""))
        for line in here:
            if line.get("after_first_chunk_of"):
                continue  # started by the one it is timed on
            waiting = [func[(step, w["name"])] for w in here if w.get("after_first_chunk_of") == line["name"]]
            call = func[(step, line["name"])]
            if waiting:
                call += " | after_first_chunk " + " ".join(waiting)
                out.append(f"# {', '.join(w['name'] for w in here if w.get('after_first_chunk_of') == line['name'])}"
                           f" sent after {line['name']}'s first streamed chunk")
            out.append(call + (" &" if len(here) > 1 else ""))
        if len(here) > 1:
            out.append("wait")
    return "\n".join(out) + "\n"


def read_repro(path: str) -> tuple[Case, Finding]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise DoctorUsageError(f"--replay {path}: {e}") from None
    case: Case = []
    victim = None
    for line in lines:
        try:
            r = Req(line["name"], line["endpoint"], line["body"], line.get("cut_after_chunks"), line.get("timeout_s"),
                    line.get("salt_label"), after=line.get("after_first_chunk_of"))
        except KeyError as e:
            raise DoctorUsageError(f"--replay {path}: a line lacks {e}") from None
        while len(case) <= line["step"]:
            case.append([])
        case[line["step"]].append(r)
        if line.get("victim"):
            victim = line
    if victim is None:
        raise DoctorUsageError(f"--replay {path}: no line is marked as the victim")
    for step in case:
        names = {r.name for r in step}
        for r in step:
            if r.after is not None and (r.after not in names or r.after == r.name):
                raise DoctorUsageError(f"--replay {path}: {r.name}'s after_first_chunk_of {r.after!r} is not another "
                                       f"request of its step (step {case.index(step)}: {sorted(names)})")
    exp = Output.from_dict(victim["expect"])
    return case, Finding("replay", victim["kind"], victim["name"], case, exp, exp, None, victim.get("detail", ""))


# -- the run -------------------------------------------------------------------------------------

def open_run(url: str, model: str | None, api_key: str | None, concurrency: int, budget: float, max_tokens: int,
             tol: float | None) -> Run:
    server = Server(url, model, api_key)
    caps = server.probe()
    run = Run(server, caps, concurrency, max_tokens, time.monotonic() + budget, tol)
    if caps.takes("cache_salt"):
        calib = run.send(Req("calibrate", "completions", run.body("completions", run.text(100, 0), max_tokens=1)),
                         run.fresh_salt())
        if calib.prompt_tokens:
            run.tokens_per_word = calib.prompt_tokens / len(run.text(100, 0).split())
    return run


def diagnose(run: Run, repro_path: str | None, only: list[str] | None = None) -> dict:
    """Every stage (or those in `only`; the noise floor always), then the first finding shrunk."""
    unknown = sorted(set(only or []) - set(STAGE_FUNCS))
    if unknown:
        raise DoctorUsageError(f"--stages: unknown stage(s) {unknown}; known: {list(STAGE_FUNCS)}")
    start = time.monotonic()
    budget = run.deadline - start
    stages = []
    for name, func in STAGE_FUNCS.items():
        if only and name != "noise_floor" and name not in only:
            continue
        if name == "adapters" and not run.caps.adapters and not only:
            continue  # nothing to exercise; the capabilities say no adapter is listed
        st = StageResult(name)  # each runs at least its first group, however much of the budget is left
        t0 = time.monotonic()
        func(run, st)
        st.seconds = time.monotonic() - t0
        errors = [f for f in st.findings if f.got.error and f.kind == "output"]
        if any(f.beyond_noise and not f.got.error for f in st.findings):
            st.verdict = "contamination"
        elif errors:
            st.verdict = "error"
        elif st.findings and st.verdict == "clean":
            st.verdict = "within noise"
        stages.append(st)
    caps = run.caps
    comparison = {"tolerance": run.tol, "exact": run.tol == 0,
                  "why": ("the server says it is bit-transparent (/version)" if caps.bit_transparent and run.user_tol
                          is None else "set by the user" if run.user_tol is not None else
                          "the noise floor measured alone (at least %g)" % MIN_NOISE_TOL)}
    found = [f for st in stages for f in st.findings if f.beyond_noise and not f.got.error]
    order = {"canary": 0, "salt_leak": 1, "output": 2}
    found.sort(key=lambda f: order[f.kind])
    report = {"url": run.server.root, "model": caps.model, "capabilities": caps.to_dict(), "comparison": comparison,
              "stages": [s.to_dict() for s in stages], "requests_sent": run.sent, "budget_s": round(budget, 1),
              "repro": None}
    if found:
        first = found[0]
        case, minimal = shrink(run, first, max(budget, 60.0))
        path, script = write_repro(repro_path, run.server, case, first)
        report["repro"] = {"stage": first.stage, "kind": first.kind, "victim": first.victim, "detail": first.detail,
                           "requests": sum(len(s) for s in case), "minimal": minimal, "path": path, "curl": script,
                           "case": [[r.to_dict() for r in step] for step in case]}
        report["verdict"] = "contamination"
        report["exit_code"] = 1
        report["summary"] = (f"contamination: stage {first.stage} ({first.kind}): {first.detail}")
    elif any(s.verdict == "error" for s in stages):
        bad = next(s for s in stages if s.verdict == "error")
        err = next(f.got.error for f in bad.findings if f.got.error)
        report.update(verdict="server failed", exit_code=2,
                      summary=f"cannot test: the server failed requests in stage {bad.name} ({err}); no wrong "
                              "answer was seen, so this is not shown to be contamination")
    else:
        report.update(verdict="no contamination found", exit_code=0,
                      summary=f"no contamination found in {len(stages)} stages ({run.sent} requests)")
    report["elapsed_s"] = round(time.monotonic() - start, 2)
    return report
