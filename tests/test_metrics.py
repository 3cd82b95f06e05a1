"""/metrics' exposition through prometheus-client: vLLM's names and labels, one registry per server."""
from __future__ import annotations

from prometheus_client import generate_latest

from kvshare.server.metrics import TTFT_BUCKETS, EngineSnapshot, ServerMetrics
from server_proc import parse_metrics


def _scrape(metrics: ServerMetrics, snap: EngineSnapshot) -> list[tuple[str, dict, float]]:
    return parse_metrics(generate_latest(metrics.registry(lambda: snap)).decode())


def test_names_labels_and_values_as_vllm_names_them():
    m = ServerMetrics("tiny")
    m.on_tokens(prompt_tokens=7, generation_tokens=1, ttft=0.03, itl=None)
    m.on_tokens(prompt_tokens=0, generation_tokens=2, ttft=None, itl=0.02)
    m.on_finished("stop", 0.4)
    m.on_abort("client_disconnect", 2)
    m.on_rejected("queue_full")
    samples = _scrape(m, EngineSnapshot(running=1, waiting=2, blocks_in_use=3, blocks_total=12, step=9))
    got = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples}

    def value(name, **labels):
        return got[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]

    assert value("vllm:num_requests_running") == 1 and value("vllm:num_requests_waiting") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25 and value("kvshare:kv_cache_blocks_total") == 12
    assert value("vllm:prompt_tokens_total") == 7 and value("vllm:generation_tokens_total") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="length") == 0
    assert value("kvshare:aborted_requests_total", reason="client_disconnect") == 1
    assert value("kvshare:rejected_requests_total", reason="queue_full") == 1
    assert value("kvshare:abort_delay_steps_max") == 2 and value("kvshare:engine_steps_total") == 9
    # Histograms: cumulative buckets at vLLM's edges, spelled as before ("0.02", "1.0", "+Inf").
    buckets = {lab["le"]: v for n, lab, v in samples if n == "vllm:time_to_first_token_seconds_bucket"}
    assert len(buckets) == len(TTFT_BUCKETS) + 1 and buckets["0.02"] == 0 and buckets["0.04"] == 1
    assert buckets["1.0"] == 1 and buckets["+Inf"] == 1
    assert value("vllm:time_to_first_token_seconds_count") == 1
    assert abs(value("vllm:time_to_first_token_seconds_sum") - 0.03) < 1e-12
    assert value("vllm:inter_token_latency_seconds_count") == 1
    names = {n for n, _, _ in samples}
    assert not any(n.endswith("_created") for n in names)  # no extra series beside the old exposition
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names


def test_requests_by_priority_and_timeouts():
    m = ServerMetrics("tiny")
    m.on_finished("timeout", 0.5)
    samples = _scrape(m, EngineSnapshot(running=3, waiting=1, running_by_priority={0: 1, 5: 2},
                                        waiting_by_priority={-1: 1}))
    got = {(n, lab.get("priority", lab.get("finished_reason"))): v for n, lab, v in samples}
    assert got[("kvshare:num_requests_running_by_priority", "0")] == 1
    assert got[("kvshare:num_requests_running_by_priority", "5")] == 2
    assert got[("kvshare:num_requests_waiting_by_priority", "-1")] == 1
    assert got[("vllm:request_success_total", "timeout")] == 1


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.on_tokens(5, 0, None, None)
    ra, rb = _scrape(a, EngineSnapshot()), _scrape(b, EngineSnapshot())
    assert [v for n, _, v in ra if n == "vllm:prompt_tokens_total"] == [5]
    assert [v for n, lab, v in rb if n == "vllm:prompt_tokens_total"] == [0]
    assert {lab.get("model_name") for n, lab, _ in rb if n.startswith("vllm:")} == {"b"}
