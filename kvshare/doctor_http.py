"""`kvshare doctor --url`: the client side. What the server offers (found by trying), one request
sent the OpenAI way (completions or chat, streamed or not, a stream cut early, a client timeout),
its answer as the doctor compares it, and the comparison itself.

Why not a `kvshare.doctor_target.Target`: a Target is driven in ticks (submit, advance one engine
step, abort after k steps) and reset to an empty cache before each run. Over HTTP there are no
ticks (requests overlap in wall-clock time, and what shares a step is the server's business), and
nothing resets a remote server's cache: isolation from earlier traffic comes from a fresh
`cache_salt` where the server takes one, else from prompts no earlier request sent. So the
black-box doctor is its own driver (kvshare.doctor_url), built on this client; the in-process
doctor keeps its Target.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

import httpx2

from kvshare.doctor_target import DoctorUsageError

# Optional request fields the doctor uses where the server takes them, each tried once.
OPTIONAL_FIELDS = ("logprobs", "cache_salt", "seed", "ignore_eos", "n")


class CannotTest(DoctorUsageError):
    """The server cannot be tested (unreachable, 401, no greedy decoding, never streams): exit 2."""


@dataclass
class Output:
    """One choice of one answer: text, and per generated token its string and logprob (empty when
    the server gave none) and its top alternatives."""
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None  # the request failed (HTTP status and message, or the transport error)
    choices: list["Output"] = field(default_factory=list)  # n > 1: every choice (self is choice 0)

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "cached_tokens": self.cached_tokens, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict) -> "Output":
        return cls(text=d.get("text", ""), tokens=list(d.get("tokens", [])), logprobs=list(d.get("logprobs", [])))


@dataclass
class Capabilities:
    model: str
    bit_transparent: bool | None  # None: the server does not say
    transparency_gaps: list[str] | None
    logprobs: bool
    top_logprobs: bool
    streams: bool
    chat: bool
    accepted: dict[str, bool]  # optional field -> the server took it (it may still ignore it)
    refused: dict[str, str]  # optional field -> the server's error
    max_model_len: int | None
    cached_tokens_reported: bool
    # LoRA adapters the server serves over the model: /v1/models entries whose `parent` is the
    # model (vLLM's and kvshare's listing); a request names one in its `model`.
    adapters: list[str] = field(default_factory=list)

    def takes(self, name: str) -> bool:
        return self.accepted.get(name, False)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _error_text(resp) -> str:
    try:
        body = resp.json()
        msg = body.get("error", body) if isinstance(body, dict) else body
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except ValueError:
        msg = resp.text
    return f"HTTP {resp.status_code}: {str(msg)[:300]}"


class Server:
    """An OpenAI-compatible server at `url` (with or without the /v1 suffix)."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise DoctorUsageError(f"--url {url!r} must start with http:// or https://")
        base = url.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx2.Client(base_url=self.root, headers=headers, timeout=timeout)
        self.model = model
        self.timeout = timeout

    def close(self) -> None:
        self.client.close()

    # -- probing ---------------------------------------------------------------------------------
    def probe(self) -> Capabilities:
        """What the server offers, found by trying; CannotTest when it cannot be tested at all."""
        try:
            resp = self.client.get("/v1/models", timeout=10)
        except httpx2.TransportError as e:
            raise CannotTest(f"cannot reach {self.root}: {type(e).__name__}: {e}") from None
        if resp.status_code in (401, 403):
            raise CannotTest(f"{self.root} answered {resp.status_code} (unauthorized): pass the server's key "
                             "with --api-key")
        max_model_len = None
        adapters: list[str] = []
        if resp.status_code == 200:
            cards = resp.json().get("data") or []
            if self.model is None and cards:
                self.model = cards[0].get("id")
            card = next((c for c in cards if c.get("id") == self.model), None)
            max_model_len = (card or {}).get("max_model_len")
            adapters = [c["id"] for c in cards if isinstance(c.get("id"), str) and c["id"] != self.model
                        and c.get("parent") == self.model]
        if self.model is None:
            raise CannotTest(f"{self.root}/v1/models names no model ({_error_text(resp)}): pass --model")
        transparent, gaps = None, None
        try:
            v = self.client.get("/version", timeout=10)
            if v.status_code == 200 and isinstance(v.json(), dict) and "bit_transparent" in v.json():
                transparent, gaps = bool(v.json()["bit_transparent"]), list(v.json().get("transparency_gaps") or [])
        except (httpx2.TransportError, ValueError):
            pass
        plain = self._post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        if plain.status_code in (401, 403):
            raise CannotTest(f"{self.root} answered {plain.status_code} (unauthorized): pass the server's key "
                             "with --api-key")
        if plain.status_code == 400 and "temperature" in plain.text:
            raise CannotTest(f"no greedy decoding: temperature 0 is refused ({_error_text(plain)})")
        if plain.status_code != 200:
            raise CannotTest(f"a plain greedy completion failed: {_error_text(plain)}")
        accepted, refused = {}, {}
        tries = {"logprobs": 2, "cache_salt": "kvshare-doctor-probe-" + secrets.token_hex(4), "seed": 1,
                 "ignore_eos": True, "n": 2}
        logprobs = top = False
        for name, value in tries.items():
            r = self._post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0, name: value})
            accepted[name] = r.status_code == 200
            if r.status_code != 200:
                refused[name] = _error_text(r)
            elif name == "logprobs":
                lp = (r.json()["choices"][0].get("logprobs") or {})
                logprobs = bool(lp.get("token_logprobs"))
                top = bool(lp.get("top_logprobs"))
                if not logprobs:
                    accepted[name], refused[name] = False, "accepted, but answers carry no logprobs"
            elif name == "n" and len(r.json().get("choices", [])) != 2:
                accepted[name], refused[name] = False, "accepted, but the answer has one choice"
        cached_reported = ((plain.json().get("usage") or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") is not None
        streams = self._streams()
        if not streams:
            raise CannotTest(f"{self.root} never streams: a \"stream\": true completion came back as one JSON body "
                             "(the abort stages cut streams)")
        chat = self._post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                    "temperature": 0}).status_code == 200
        return Capabilities(self.model, transparent, gaps, logprobs, top, streams, chat, accepted, refused,
                            max_model_len, cached_reported, adapters)

    def _post(self, path: str, body: dict):
        try:
            return self.client.post(path, json={"model": self.model, **body})
        except httpx2.TransportError as e:
            raise CannotTest(f"{self.root}{path}: {type(e).__name__}: {e}") from None

    def _streams(self) -> bool:
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200 or "text/event-stream" not in r.headers.get("content-type", ""):
                    r.read()
                    return False
                return any(line.startswith("data:") for line in r.iter_lines())
        except httpx2.TransportError:
            return False

    # -- requests --------------------------------------------------------------------------------
    def send(self, endpoint: str, body: dict, cut_after: int | None = None, timeout: float | None = None,
             on_first_chunk=None) -> Output:
        """One request; `cut_after`: a stream closed after that many chunks (nothing compared);
        `timeout`: the client gives up after that many seconds (the error says so);
        `on_first_chunk`: called when a stream's first chunk has arrived (a request timed on it)."""
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        body = {"model": self.model, **body}
        try:
            if body.get("stream"):
                return self._stream(path, body, endpoint, cut_after, timeout, on_first_chunk)
            try:
                resp = self.client.post(path, json=body, timeout=timeout or self.timeout)
            except (httpx2.RemoteProtocolError, httpx2.ConnectError):
                # A keep-alive connection the server closed between requests (llama-server does):
                # nothing was answered, so sending once more is the same request.
                resp = self.client.post(path, json=body, timeout=timeout or self.timeout)
        except httpx2.TimeoutException:
            return Output(error="client timeout")
        except httpx2.TransportError as e:
            return Output(error=f"{type(e).__name__}: {e}")
        if resp.status_code != 200:
            return Output(error=_error_text(resp))
        return parse_answer(resp.json(), endpoint)

    def _stream(self, path: str, body: dict, endpoint: str, cut_after: int | None, timeout: float | None,
                on_first_chunk=None) -> Output:
        chunks = []
        with self.client.stream("POST", path, json=body, timeout=timeout or self.timeout) as r:
            if r.status_code != 200:
                r.read()
                return Output(error=_error_text(r))
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunks.append(json.loads(line[5:]))
                if len(chunks) == 1 and on_first_chunk is not None:
                    on_first_chunk()
                if cut_after is not None and len(chunks) >= cut_after:
                    return Output(error="cut by the doctor")  # closing the stream aborts the request
        return merge_chunks(chunks, endpoint)


def _choice_output(choice: dict, endpoint: str) -> Output:
    out = Output(finish_reason=choice.get("finish_reason"))
    lp = choice.get("logprobs") or {}
    if endpoint == "chat":
        out.text = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
        for entry in lp.get("content") or []:
            out.tokens.append(entry["token"])
            out.logprobs.append(entry["logprob"])
            out.top.append({t["token"]: t["logprob"] for t in entry.get("top_logprobs") or []})
    else:
        out.text = choice.get("text") or ""
        out.tokens = list(lp.get("tokens") or [])
        out.logprobs = [x if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
        out.top = [dict(t or {}) for t in lp.get("top_logprobs") or []]
    return out


def parse_answer(body: dict, endpoint: str) -> Output:
    choices = sorted(body.get("choices") or [], key=lambda c: c.get("index", 0))
    outs = [_choice_output(c, endpoint) for c in choices] or [Output(error="no choices in the answer")]
    first = outs[0]
    usage = body.get("usage") or {}
    first.prompt_tokens = usage.get("prompt_tokens")
    first.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    first.choices = outs
    return first


def merge_chunks(chunks: list[dict], endpoint: str) -> Output:
    """A stream's chunks as one answer (per choice index, in order)."""
    by_index: dict[int, Output] = {}
    usage = {}
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or []:
            part = _choice_output(c, endpoint)
            out = by_index.setdefault(c.get("index", 0), Output())
            out.text += part.text
            out.tokens += part.tokens
            out.logprobs += part.logprobs
            out.top += part.top
            out.finish_reason = part.finish_reason or out.finish_reason
    outs = [by_index[i] for i in sorted(by_index)] or [Output(error="the stream carried no choices")]
    outs[0].prompt_tokens = usage.get("prompt_tokens")
    outs[0].choices = outs
    return outs[0]


@dataclass
class Diff:
    first_token: int | None  # the first position whose token differs (None: same tokens)
    drift: list[float]  # |logprob difference| at each position both have (up to the first difference)
    beyond_noise: bool
    why: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def compare(got: Output, ref: Output, tol: float, noisy_tokens: bool = False) -> Diff | None:
    """None when `got` matches `ref` (tokens equal, logprobs within `tol`; tol 0: exact). A token
    that differs where the reference's top two were within the tolerance is a tie broken the other
    way: noise, not contamination; so is any token difference on a server whose tokens were seen to
    change when a request was repeated alone (`noisy_tokens`)."""
    if got.error:
        return Diff(None, [], True, f"request failed: {got.error}")
    a, b = (got.tokens, ref.tokens) if got.tokens and ref.tokens else (list(got.text), list(ref.text))
    unit = "token" if got.tokens and ref.tokens else "character"
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = n
    upto = n if first is None else first
    drift = [abs(x - y) for x, y in zip(got.logprobs[:upto], ref.logprobs[:upto])]
    worst = max(drift, default=0.0)
    if first is None:
        if worst <= tol:
            return None
        rule = f"noise tolerance {tol:.2g}" if tol else "exact equality required"
        return Diff(None, drift, True, f"same tokens, logprobs differ by up to {worst:.3g} ({rule})")
    what = f"{unit} {first} differs: {''.join(a[first:first + 1])!r} instead of {''.join(b[first:first + 1])!r}"
    if tol == 0:
        return Diff(first, drift, True, what + " (exact equality required)")
    if unit == "character":
        return Diff(first, drift, False, what + ": without logprobs a near tie cannot be told from contamination "
                                                "(canaries still can)")
    if worst > tol:
        return Diff(first, drift, True, what + f", after logprobs drifted {worst:.3g} (noise tolerance {tol:.2g})")
    alts = sorted(ref.top[first].values(), reverse=True) if first < len(ref.top) else []
    if len(alts) >= 2 and alts[0] - alts[1] <= 2 * tol:
        return Diff(first, drift, False, what + f": a near tie (top two {alts[0] - alts[1]:.3g} apart), noise")
    if noisy_tokens:
        return Diff(first, drift, False, what + ": this server's tokens change when a request is repeated alone")
    return Diff(first, drift, True, what)
