"""A stand-in for a data-parallel replica in the front end's tests: a tiny HTTP server (no model)
that answers /health, /metrics and /v1/completions the way `kvshare serve` does, fast to start,
so a test can stop (SIGSTOP) or kill it like a real replica process. Prints "listening PORT" once bound.
Flags: --engine-dead (its engine thread stopped: /health and requests answer 503 engine_dead, as
kvshare serve does then), --ignore-sigterm (a process that does not exit when asked)."""
from __future__ import annotations

import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health" and ENGINE_DEAD:
            self._send(503, b'{"status":"engine_dead","detail":"RuntimeError: boom"}', "application/json")
        elif self.path == "/health":
            self._send(200, b'{"status":"ok"}', "application/json")
        elif self.path == "/metrics":
            self._send(200, b"vllm:kv_cache_usage_perc 0.25\n", "text/plain")
        else:
            self._send(404, b'{"error":{"code":"not_found"}}', "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(200, json.dumps({"object": "text_completion", "choices": []}).encode(), "application/json")

    def log_message(self, *args) -> None:
        pass


ENGINE_DEAD = "--engine-dead" in sys.argv

if __name__ == "__main__":
    if "--ignore-sigterm" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print("listening", server.server_address[1], flush=True)
    server.serve_forever()
