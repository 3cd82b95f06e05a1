"""Prometheus metrics with vLLM's names, exposed through prometheus-client (text format 0.0.4)
from a registry of the server's own, with the process and Python collectors beside them.

Counters and histograms are fed by the engine thread as outputs come out of each step; gauges and
the engine's own cumulative counters are read from the snapshot the engine thread publishes, so a
scrape never touches the engine itself.
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# vLLM's bucket edges, so dashboards built for vLLM read these histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "timeout")
# A deadline is not a server abort: the engine ends the request (vllm:request_success_total{finished_reason="timeout"}).
ABORT_REASONS = ("client_disconnect", "shutdown")
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
    tiers: dict = field(default_factory=dict)  # EngineStatus.tiers: the KV tiers' blocks, budgets, hits
    running_by_priority: dict[int, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)

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


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self._lock = threading.Lock()
        self.model_name = model_name
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
    def registry(self, snapshot) -> CollectorRegistry:
        """A registry of this server's own (nothing global): these metrics, read from `snapshot()`
        (the engine's latest EngineSnapshot) at every scrape, plus the process and Python collectors."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, snapshot))
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        return registry

    def families(self, snap: EngineSnapshot) -> list:
        name = self.model_name

        def one(kind, metric: str, help_text: str, value: float):
            fam = kind(metric, help_text, labels=["model_name"])
            fam.add_metric([name], value)
            return fam

        def by(metric: str, help_text: str, label: str, values: dict[str, int]):
            fam = CounterMetricFamily(metric, help_text, labels=["model_name", label])
            for k, v in values.items():
                fam.add_metric([name, k], v)
            return fam

        def tier(key: str) -> int:
            return snap.tiers.get(key, 0)

        def tiers(kind, metric: str, help_text: str, ram: int, disk: int):
            fam = kind(metric, help_text, labels=["model_name", "tier"])
            fam.add_metric([name, "cpu"], ram)
            fam.add_metric([name, "disk"], disk)
            return fam

        def histogram(metric: str, help_text: str, h: Histogram):
            fam = HistogramMetricFamily(metric, help_text, labels=["model_name"])
            running, buckets = 0, []
            for edge, c in zip(list(h.buckets) + [math.inf], h.counts):
                running += c
                buckets.append((floatToGoString(edge), running))
            fam.add_metric([name], buckets, h.sum)
            return fam

        def by_priority(metric: str, help_text: str, values: dict[int, int]):
            fam = GaugeMetricFamily(metric, help_text, labels=["model_name", "priority"])
            for prio, count in sorted(values.items()):
                fam.add_metric([name, str(prio)], count)
            return fam

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        with self._lock:
            return [
                one(gauge, "vllm:num_requests_running", "Requests with a sequence in the running batch.", snap.running),
                one(gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", snap.waiting),
                by_priority("kvshare:num_requests_running_by_priority",
                            "vllm:num_requests_running by the requests' priority (--scheduling-policy priority).",
                            snap.running_by_priority),
                by_priority("kvshare:num_requests_waiting_by_priority",
                            "vllm:num_requests_waiting by the requests' priority.", snap.waiting_by_priority),
                one(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage: fraction of blocks referenced (0 to 1).",
                    snap.kv_cache_usage),
                one(gauge, "kvshare:kv_cache_blocks_in_use", "KV blocks referenced by a sequence.", snap.blocks_in_use),
                one(gauge, "kvshare:kv_cache_blocks_total", "KV blocks in the pool.", snap.blocks_total),
                one(counter, "vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                    snap.prefix_cache_queries),
                one(counter, "vllm:prefix_cache_hits_total", "Prompt tokens served by the prefix cache.",
                    snap.prefix_cache_hits),
                one(counter, "vllm:external_prefix_cache_hits_total",
                    "Prompt tokens served from the KV tiers under the pool (host RAM, disk).", tier("hit_tokens")),
                tiers(gauge, "kvshare:kv_tier_blocks", "Blocks kept in each KV tier under the pool.",
                      tier("ram_blocks"), tier("disk_blocks")),
                tiers(gauge, "kvshare:kv_tier_capacity_blocks", "Each KV tier's budget, in blocks.",
                      tier("ram_capacity_blocks"), tier("disk_capacity_blocks")),
                one(counter, "kvshare:kv_tier_rejected_total",
                    "Tier blocks refused as invalid (a damaged file, another model's, a deleted one).",
                    tier("rejected")),
                one(counter, "vllm:num_preemptions_total", "Sequences preempted (recomputed later).", snap.preemptions),
                one(counter, "vllm:prompt_tokens_total", "Prompt tokens of requests that reached prefill.",
                    self.prompt_tokens),
                one(counter, "vllm:generation_tokens_total", "Tokens generated.", self.generation_tokens),
                by("vllm:request_success_total", "Finished requests by finish reason.", "finished_reason",
                   self.success),
                by("kvshare:aborted_requests_total", "Requests aborted by the server, by cause.", "reason",
                   self.aborted),
                by("kvshare:rejected_requests_total", "HTTP requests refused before reaching the engine.", "reason",
                   self.rejected),
                one(gauge, "kvshare:abort_delay_steps_max",
                    "Most engine steps between an abort being requested and applied.", self.abort_delay_steps_max),
                one(counter, "kvshare:engine_steps_total", "Engine steps run.", snap.step),
                histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                          self.ttft),
                histogram("vllm:inter_token_latency_seconds", "Time between successive outputs of a request.",
                          self.itl),
                histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the request finishing.",
                          self.e2e),
            ]


class _Collector(Collector):
    def __init__(self, metrics: ServerMetrics, snapshot) -> None:
        self.metrics = metrics
        self.snapshot = snapshot

    def collect(self):
        return self.metrics.families(self.snapshot())
