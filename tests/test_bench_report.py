"""`kvshare bench serve`'s arithmetic: percentiles, the knee, workloads (no kvshare server needed)."""
from __future__ import annotations

from kvshare.bench.report import RequestResult, build_figure, find_knee, percentile, summarize
from kvshare.bench.serve import make_workload


def _level(level, tok_s):
    return {"level": level, "total_tok_s": tok_s}


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert abs(percentile(list(range(1, 101)), 99) - 99.01) < 1e-9


def test_knee_is_the_first_level_near_the_best_throughput():
    rising = [_level(1, 100), _level(2, 190), _level(4, 350)]
    assert find_knee(rising) == {"level": 4, "found": False, "why": "still rising at the last level"}
    flat = [_level(1, 100), _level(2, 180), _level(4, 300), _level(8, 310), _level(16, 305)]
    assert find_knee(flat)["level"] == 4 and find_knee(flat)["found"] is True
    noisy_dip = [_level(1, 100), _level(2, 150), _level(4, 140), _level(8, 260), _level(16, 270)]
    assert find_knee(noisy_dip)["level"] == 8  # an early dip is not the knee


def test_summary_counts_tokens_and_latencies():
    ok = RequestResult(ok=True, start=0.0, end=2.0, first_token=0.5, prompt_tokens=10, output_tokens=4)
    bad = RequestResult(ok=False, start=0.0, end=0.1, error="HTTP 500")
    s = summarize(4, "concurrency", [ok, bad], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, ["HTTP 500"])
    assert s["total_tok_s"] == 7.0 and s["output_tok_s"] == 2.0
    assert s["ttft_p50_s"] == 0.5 and s["tpot_p50_s"] == 0.5 and s["e2e_p50_s"] == 2.0


def test_workloads_share_exactly_what_they_should():
    a = make_workload("shared", 3, 16, "t1")
    b = make_workload("shared", 3, 16, "t1")
    assert [r.prompt for r in a] == [r.prompt for r in b]  # same tag, same prompts (fair A/B)
    preamble = a[0].prompt.split("\n\nQuestion")[0]
    assert all(r.prompt.startswith(preamble + "\n\nQuestion") for r in a) and len(set(r.prompt for r in a)) == 3
    mixed = make_workload("mixed", 20, 32, "t2")
    firsts = {r.prompt.split()[0] for r in mixed}
    assert len(firsts) == 20  # every prompt opens with its own tag: nothing cached across requests
    assert all(16 <= r.max_tokens <= 32 for r in mixed)
    assert make_workload("mixed", 5, 32, "t3")[0].prompt != mixed[0].prompt
    # --prompt-tokens / --output-tokens: the ranges hold, and they really move the draws.
    ranged = make_workload("mixed", 40, 32, "t2", prompt_tokens=(64, 80), output_tokens=(100, 128))
    assert all(100 <= r.max_tokens <= 128 for r in ranged)
    assert all(60 <= r.est_prompt_tokens <= 90 for r in ranged)
    assert max(r.est_prompt_tokens for r in mixed) > 200


def _sweep(label: str, tok_s: list[float], levels=(1, 2, 4, 8)) -> dict:
    rows = [{"level": float(x), "num_requests": 4, "total_tok_s": t, "output_tok_s": t / 4, "ttft_p50_s": 0.1 * x,
             "ttft_p99_s": 0.2 * x, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02} for x, t in zip(levels, tok_s)]
    return {"label": label, "model": "SmolLM2-135M-Instruct", "workload": "shared", "mode": "concurrency",
            "levels": rows, "knee": find_knee(rows)}


def _stars(ax) -> int:
    return sum(1 for line in ax.get_lines() if line.get_marker() == "*")


def test_plot_names_the_run_shows_the_levels_and_marks_only_a_found_knee():
    flat = _sweep("kv", [100, 190, 300, 310])
    fig = build_figure([flat])
    title = fig._suptitle.get_text()
    assert "SmolLM2-135M-Instruct" in title and "shared" in title and "16 requests" in title
    axes = fig.axes
    assert len(axes) == 4
    fig.canvas.draw()  # tick labels as drawn
    for ax in axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]  # plain numbers
        assert ax.get_xticklabels(minor=True) == [] or all(not t.get_text() for t in ax.get_xticklabels(minor=True))
        assert ax.get_ylim()[0] == 0
        assert _stars(ax) == 1  # the knee (at 4) on every panel
    for ax in axes[2:]:  # latency panels: p50 solid, p99 dashed in the same colour
        styles = {line.get_label(): line for line in ax.get_lines() if line.get_marker() != "*"}
        p50, p99 = styles["kv (shared) p50"], styles["kv (shared) p99"]
        assert p50.get_linestyle() == "-" and p99.get_linestyle() == "--" and p50.get_color() == p99.get_color()
        assert list(p99.get_ydata()) > list(p50.get_ydata())
    assert not any("still rising" in t.get_text() for ax in axes for t in ax.texts)

    rising = build_figure([_sweep("kv", [100, 190, 350, 700])], title="kvshare vs HF")
    assert rising._suptitle.get_text().startswith("kvshare vs HF\n")
    for ax in rising.axes:
        assert _stars(ax) == 0  # no knee found: none marked...
    notes = [t.get_text() for ax in rising.axes[:2] for t in ax.texts]
    assert notes and all("still rising" in n for n in notes)  # ...and said so


def test_bench_against_an_unreachable_server_is_one_clear_line(capsys):
    from kvshare.cli import main
    from kvshare.testing.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc = main(["bench", "serve", "--base-url", url, "--concurrency", "1", "--num-requests", "1", "--warmup", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert len(err) == 1 and "cannot reach" in err[0] and url in err[0] and "Traceback" not in err[0]


def test_dashboard_url_only_for_a_server_that_answers_with_a_kv_pool():
    """Another OpenAI-compatible server (404 on /kv/snapshot), a kvshare one refusing the key (401)
    and one answering with something else get no dashboard link; a pool gets one."""
    import asyncio
    import http.server
    import json
    import threading

    import httpx2

    from kvshare.bench.serve import kvshare_dashboard_url

    replies = {"other": (404, {"detail": "Not Found"}), "refusing": (401, {"error": {"code": "invalid_api_key"}}),
               "odd": (200, {"num_blocks": "many"}), "kvshare": (200, {"num_blocks": 91, "counts": {"free": 91}})}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            kind, _, rest = self.path.lstrip("/").partition("/")
            status, body = replies[kind] if rest == "kv/snapshot?blocks=none" else (404, {})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{httpd.server_address[1]}"

    async def probe(kind):
        async with httpx2.AsyncClient() as client:
            return await kvshare_dashboard_url(client, f"{root}/{kind}/v1", {})

    try:
        got = {kind: asyncio.run(probe(kind)) for kind in replies}
    finally:
        httpd.shutdown()
    assert got == {"other": None, "refusing": None, "odd": None, "kvshare": f"{root}/kvshare/dashboard"}
