"""/metrics of the data-parallel front end: its router's own series, and every live replica's
series scraped at the same moment and labelled with `engine="<rank>"` (vLLM's label for the
engine a series comes from, so dashboards built for vLLM data parallelism read them as they are).

Samples of one family from all replicas are merged under one HELP/TYPE, as the text format
requires; the front end's own process series keep no `engine` label.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvshare.server.metrics import REJECT_REASONS
from kvshare.server.routing import RoutingDecision

ENGINE_LABEL = "engine"
# Reasons the front end itself refuses a request (GuardMiddleware's, plus its own).
FRONTEND_REJECT_REASONS = REJECT_REASONS + ("no_live_replica",)
FAILURE_REASONS = ("replica_died", "connection_failed", "engine_dead")


class RouterMetrics:
    """Counters of the front end, touched only on its event loop (no lock needed)."""

    def __init__(self, model_name: str, num_replicas: int, policy: str) -> None:
        self.model_name = model_name
        self.policy = policy
        self.routed = [0] * num_replicas
        self.by_reason: dict[str, int] = {}
        self.matched_blocks = [0] * num_replicas
        self.prompt_blocks = [0] * num_replicas
        self.failed = [dict.fromkeys(FAILURE_REASONS, 0) for _ in range(num_replicas)]
        self.rejected = dict.fromkeys(FRONTEND_REJECT_REASONS, 0)

    def on_routed(self, decision: RoutingDecision) -> None:
        self.routed[decision.index] += 1
        self.by_reason[decision.reason] = self.by_reason.get(decision.reason, 0) + 1
        self.matched_blocks[decision.index] += decision.matched_blocks
        self.prompt_blocks[decision.index] += decision.prompt_blocks

    def on_failed(self, index: int, reason: str) -> None:
        self.failed[index][reason] += 1

    def on_rejected(self, reason: str) -> None:  # GuardMiddleware's hook
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def families(self, replicas) -> list[Metric]:
        """`replicas`: the router's ReplicaState list, for the gauges."""
        name = self.model_name

        def per_engine(kind, metric: str, help_text: str, values) -> Metric:
            fam = kind(metric, help_text, labels=["model_name", ENGINE_LABEL])
            for i, v in enumerate(values):
                fam.add_metric([name, str(i)], v)
            return fam

        routed = CounterMetricFamily("kvshare:router_routed_requests", "Requests the front end sent to each engine.",
                                     labels=["model_name", ENGINE_LABEL, "policy"])
        for i, v in enumerate(self.routed):
            routed.add_metric([name, str(i), self.policy], v)
        reasons = CounterMetricFamily("kvshare:router_decisions", "Routing decisions by what decided them: prefix "
                                      "(a cached prefix), load (no usable match: least loaded), imbalance, "
                                      "round_robin, least_loaded.", labels=["model_name", "reason"])
        for k, v in sorted(self.by_reason.items()):
            reasons.add_metric([name, k], v)
        failed = CounterMetricFamily("kvshare:router_failed_requests", "Requests that failed on an engine because "
                                     "it died, refused the connection, or its engine thread had stopped (these are "
                                     "sent on to another engine).", labels=["model_name", ENGINE_LABEL, "reason"])
        for i, by in enumerate(self.failed):
            for k, v in by.items():
                failed.add_metric([name, str(i), k], v)
        rejected = CounterMetricFamily("kvshare:rejected_requests", "HTTP requests refused before reaching an "
                                       "engine (without an engine label: by the front end itself).",
                                       labels=["model_name", "reason"])
        for k, v in self.rejected.items():
            rejected.add_metric([name, k], v)
        return [
            routed, reasons, failed, rejected,
            per_engine(CounterMetricFamily, "kvshare:router_prefix_hit_blocks",
                       "Prompt blocks already cached on the engine a request was sent to (router's view, from the "
                       "engine's KV events).", self.matched_blocks),
            per_engine(CounterMetricFamily, "kvshare:router_prompt_blocks",
                       "Full prompt blocks of the requests sent to each engine.", self.prompt_blocks),
            per_engine(GaugeMetricFamily, "kvshare:router_in_flight_requests",
                       "Requests sent to each engine and not finished.", [r.in_flight for r in replicas]),
            per_engine(GaugeMetricFamily, "kvshare:router_cached_blocks",
                       "Blocks each engine holds for prefix reuse, as its KV events tell the router.",
                       [len(r.cached) for r in replicas]),
            per_engine(GaugeMetricFamily, "kvshare:router_engine_alive",
                       "1 while the engine's process runs and takes requests, 0 once it died.",
                       [1 if r.alive else 0 for r in replicas]),
        ]


def process_families() -> list[Metric]:
    """The front end process's own process/platform/GC series (no engine label)."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return list(registry.collect())


def merge_exposition(own: list[Metric], replica_texts: dict[int, str]) -> bytes:
    """One text exposition: the front end's families, then each replica's samples with
    engine="<rank>" added, merged family by family."""
    merged: dict[str, Metric] = {}
    order: list[str] = []

    def add(fam: Metric, extra: dict[str, str]) -> None:
        key = fam.name
        into = merged.get(key)
        if into is None:
            into = merged[key] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            order.append(key)
        elif into.type != fam.type:
            return  # a name clash of different types cannot be merged; the first one stays
        for s in fam.samples:
            into.samples.append(Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar))

    for fam in own:
        add(fam, {})
    for rank, text in sorted(replica_texts.items()):
        for fam in text_string_to_metric_families(text):
            add(fam, {ENGINE_LABEL: str(rank)})

    class _Families:
        def collect(self):
            return [merged[k] for k in order]

    return generate_latest(_Families())
