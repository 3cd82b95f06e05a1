"""Prometheus metrics with vLLM's names, written in the text exposition format (version 0.0.4).

Counters and histograms are fed by the engine thread as outputs come out of each step; gauges and
the engine's own cumulative counters are read from the snapshot the engine thread publishes, so a
scrape never touches the engine itself.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

# vLLM's bucket edges, so dashboards built for vLLM read these histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
ABORT_REASONS = ("client_disconnect", "timeout", "shutdown")
REJECT_REASONS = ("queue_full", "unauthorized", "body_too_large", "shutting_down", "invalid_request", "not_found",
                  "engine_dead")


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread last saw, published whole after every loop iteration."""

    running: int = 0
    waiting: int = 0
    blocks_in_use: int = 0
    blocks_total: int = 1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    step: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks_in_use / self.blocks_total if self.blocks_total else 0.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    return repr(float(v))


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self._lock = threading.Lock()
        self._label = f'model_name="{_escape(model_name)}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.aborted = dict.fromkeys(ABORT_REASONS, 0)
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # Engine steps between an abort being asked for and the engine applying it.
        self.abort_delay_steps_max = 0

    # ---- feeding (engine thread and handlers) -------------------------------------------
    def on_tokens(self, prompt_tokens: int, generation_tokens: int, ttft: float | None, itl: float | None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def on_finished(self, finish_reason: str, e2e: float | None) -> None:
        with self._lock:
            self.success[finish_reason] = self.success.get(finish_reason, 0) + 1
            if e2e is not None:
                self.e2e.observe(e2e)

    def on_abort(self, reason: str, delay_steps: int) -> None:
        with self._lock:
            self.aborted[reason] = self.aborted.get(reason, 0) + 1
            self.abort_delay_steps_max = max(self.abort_delay_steps_max, delay_steps)

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ---- exposition ---------------------------------------------------------------------
    def render(self, snap: EngineSnapshot) -> str:
        lines: list[str] = []
        lab = self._label

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{{{labels}}} {_fmt(value)}")

        def by(label: str, values: dict[str, int]) -> list[tuple[str, float]]:
            return [(f'{lab},{label}="{_escape(k)}"', v) for k, v in values.items()]

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            running = 0
            for edge, c in zip(list(h.buckets) + ["+Inf"], h.counts):
                running += c
                le = edge if isinstance(edge, str) else _fmt(edge)
                lines.append(f'{name}_bucket{{{lab},le="{le}"}} {_fmt(running)}')
            lines.append(f"{name}_count{{{lab}}} {_fmt(h.count)}")
            lines.append(f"{name}_sum{{{lab}}} {_fmt(h.sum)}")

        with self._lock:
            metric("vllm:num_requests_running", "gauge", "Requests with a sequence in the running batch.",
                   [(lab, snap.running)])
            metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", [(lab, snap.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage: fraction of blocks referenced (0 to 1).",
                   [(lab, snap.kv_cache_usage)])
            metric("kvshare:kv_cache_blocks_in_use", "gauge", "KV blocks referenced by a sequence.",
                   [(lab, snap.blocks_in_use)])
            metric("kvshare:kv_cache_blocks_total", "gauge", "KV blocks in the pool.", [(lab, snap.blocks_total)])
            metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   [(lab, snap.prefix_cache_queries)])
            metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
                   [(lab, snap.prefix_cache_hits)])
            metric("vllm:num_preemptions_total", "counter", "Sequences preempted (recomputed later).",
                   [(lab, snap.preemptions)])
            metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of requests that reached prefill.",
                   [(lab, self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Tokens generated.", [(lab, self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Finished requests by finish reason.",
                   by("finished_reason", self.success))
            metric("kvshare:aborted_requests_total", "counter", "Requests aborted by the server, by cause.",
                   by("reason", self.aborted))
            metric("kvshare:rejected_requests_total", "counter", "HTTP requests refused before reaching the engine.",
                   by("reason", self.rejected))
            metric("kvshare:abort_delay_steps_max", "gauge",
                   "Most engine steps between an abort being requested and applied.",
                   [(lab, self.abort_delay_steps_max)])
            metric("kvshare:engine_steps_total", "counter", "Engine steps run.", [(lab, snap.step)])
            histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                      self.ttft)
            histogram("vllm:inter_token_latency_seconds", "Time between successive outputs of a request.", self.itl)
            histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the request finishing.", self.e2e)
        return "\n".join(lines) + "\n"
