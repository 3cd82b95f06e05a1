"""A real `python -m kvshare.cli serve` process on a free loopback port, for the server tests."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from kvshare.testing.ports import free_port

SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
MODEL = "SmolLM2-135M-Instruct"


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


class ServerProcess:
    def __init__(self, *args: str, engine_args: list[str] = SMALL_ENGINE) -> None:
        self.port = free_port()
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="kvshare-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvshare.cli", "serve", "--port", str(self.port), *engine_args, *args]
        env = dict(os.environ, OMP_NUM_THREADS="2")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_text(self) -> str:
        with open(self.log_file.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                status, _, _ = self.request("GET", "/ready", timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_text()[-3000:]}")

    def request(self, method: str, path: str, body: bytes | dict | list | None = None, headers: dict | None = None,
                timeout: float = 120.0, chunked: bool = False) -> tuple[int, dict, bytes]:
        """One raw HTTP request: (status, headers, body bytes); bodies are sent exactly as given
        (chunked: the bytes go out with Transfer-Encoding: chunked, no Content-Length)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = dict(headers or {})
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            if body is not None:  # as API clients send it (a key-less server refuses other bodies: 415)
                hdrs.setdefault("Content-Type", "application/json")
            if chunked:
                data = body
                body = (data[i:i + 65536] for i in range(0, len(data), 65536))
            conn.request(method, path, body=body, headers=hdrs, encode_chunked=chunked)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, headers)
        return status, json.loads(data)

    def streamed_token_gaps(self, tokens: int = 60) -> list[float]:
        """Seconds between the consecutive tokens of a greedy streamed completion (past its first
        five: prefill, warm-up): a neighbour's view of what other requests cost it."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": "The history of the city", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}), {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            times = [time.monotonic() for raw in response
                     if raw.startswith(b"data: {") and json.loads(raw[6:])["choices"]]
        finally:
            conn.close()
        assert len(times) >= tokens // 2
        return [b - a for a, b in zip(times[5:], times[6:])]

    def metrics(self) -> list[tuple[str, dict, float]]:
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        return parse_metrics(data.decode())

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.metrics() if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """Poll /metrics until nothing runs, waits or holds a KV block; the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            ms = self.metrics()
            vals = {n: v for n, lab, v in ms if n in (
                "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "kvshare:kv_cache_blocks_in_use")}
            if all(v == 0 for v in vals.values()) or time.monotonic() > deadline:
                return vals
            time.sleep(0.2)

    def terminate(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)

    def close(self) -> None:
        self.terminate()
        self.log_file.close()
        os.unlink(self.log_file.name)
