"""A small HTTP proxy in front of a real server, for `kvshare doctor --url`'s tests: each mode is a
server the doctor must judge right. It never forwards kvshare's bit-transparency claim (/version):
what it serves is not kvshare's answers any more.

  swap       splices the second half of one answer into a concurrent answer (text and logprobs):
             the mix the canary stage exists to catch
  noise      adds uniform noise (+-NOISE) to every logprob, never mixes: not contamination
  no_stream  answers "stream": true requests with one JSON body: a server that never streams
  auth       401 to everything: a server that wants a key
"""
from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2

NOISE = 1e-3


class DoctorProxy:
    def __init__(self, upstream: str, mode: str) -> None:
        assert mode in ("swap", "noise", "no_stream", "auth")
        self.upstream, self.mode = upstream, mode
        self.lock = threading.Lock()
        self.finished: list[tuple[float, float, dict]] = []  # (start, end, answer) of non-streamed answers
        self.swaps = 0
        self.rng = random.Random(0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.handle(self, "GET")

            def do_POST(self):
                proxy.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if self.mode == "auth":
            return self.reply(h, 401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if method == "POST" else None
        body = json.loads(raw) if raw else None
        streamed = bool(body and body.get("stream"))
        if streamed and self.mode == "no_stream":
            body = {k: v for k, v in body.items() if k != "stream"}
            streamed = False
        start = time.monotonic()
        with httpx2.Client(timeout=120) as c:
            resp = c.request(method, self.upstream + h.path, json=body)
        if h.path == "/version":
            return self.reply(h, resp.status_code, {"version": resp.json().get("version")})
        if resp.status_code != 200 or not h.path.startswith("/v1/") or method != "POST":
            return self.reply(h, resp.status_code, resp.json())
        if streamed:
            lines = []
            for line in resp.text.splitlines():
                if line.startswith("data: {"):
                    line = "data: " + json.dumps(self.alter(json.loads(line[6:])))
                lines.append(line)
            return self.reply(h, 200, "\n".join(lines) + "\n", "text/event-stream")
        answer = self.alter(resp.json())
        if self.mode == "swap":
            answer = self.splice(start, answer)
        return self.reply(h, 200, answer)

    def alter(self, answer: dict) -> dict:
        if self.mode != "noise":
            return answer
        for c in answer.get("choices") or []:
            lp = c.get("logprobs") or {}
            if lp.get("token_logprobs"):
                lp["token_logprobs"] = [x + self.rng.uniform(-NOISE, NOISE) for x in lp["token_logprobs"]]
                lp["top_logprobs"] = [{t: v + self.rng.uniform(-NOISE, NOISE) for t, v in top.items()}
                                      for top in lp.get("top_logprobs") or []]
            for entry in lp.get("content") or []:
                entry["logprob"] += self.rng.uniform(-NOISE, NOISE)
        return answer

    def splice(self, start: float, answer: dict) -> dict:
        """The first two thirds of the latest answer that overlapped this one in time replace this
        answer's (completions only)."""
        end = time.monotonic()
        with self.lock:
            other = next((a for s, e, a in reversed(self.finished) if e > start), None)
            kept = [f for f in self.finished if f[1] > end - 60]
            self.finished = kept + [(start, end, json.loads(json.dumps(answer)))]
        if other is None or "text" not in (answer.get("choices") or [{}])[0]:
            return answer
        mine, theirs = answer["choices"][0], other["choices"][0]
        lp, olp = mine.get("logprobs") or {}, theirs.get("logprobs") or {}
        if lp.get("tokens") and olp.get("tokens"):
            k = 2 * len(olp["tokens"]) // 3
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                lp[key] = olp[key][:k] + lp[key][k:]
            mine["text"] = "".join(lp["tokens"])
        else:
            k = 2 * len(theirs["text"]) // 3
            mine["text"] = theirs["text"][:k] + mine["text"][k:]
        self.swaps += 1
        return answer

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, payload, content_type: str = "application/json") -> None:
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        try:
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the doctor cut this stream on purpose
