"""Summaries of a serving sweep: per-level throughput and latency percentiles, the knee, the
printed table, the PNG plot."""
from __future__ import annotations

from dataclasses import dataclass

KNEE_GAIN = 1.10  # levels within 10% of the best throughput count as saturated


@dataclass
class RequestResult:
    ok: bool
    start: float
    end: float
    first_token: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(level: float, mode: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok]
    s = {
        "level": level, "mode": mode, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": prompt, "output_tokens": output,
        "total_tok_s": (prompt + output) / duration if duration > 0 else 0.0,
        "output_tok_s": output / duration if duration > 0 else 0.0,
        "req_s": len(ok) / duration if duration > 0 else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        s[f"{name}_p50_s"] = percentile(xs, 50)
        s[f"{name}_p99_s"] = percentile(xs, 99)
    return s


def find_knee(levels: list[dict]) -> dict:
    """The smallest level whose throughput is within 10% of the sweep's best: beyond it more load
    buys little throughput and, in a closed loop, only latency (Little's law). A first-flat-step
    rule would stop at the first noisy dip, which on a shared machine comes early."""
    if not levels:
        return {"level": None, "found": False, "why": "no levels"}
    best = max(levels, key=lambda s: s["total_tok_s"])
    knee = next(s for s in levels if s["total_tok_s"] >= best["total_tok_s"] / KNEE_GAIN)
    if knee is levels[-1]:
        return {"level": knee["level"], "found": False, "why": "still rising at the last level"}
    return {"level": knee["level"], "found": True,
            "why": f"within 10% of the best throughput ({best['total_tok_s']:.0f} tok/s at {best['level']:g})"}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def format_table(sweep: dict) -> str:
    unit = "conc" if sweep["mode"] == "concurrency" else "req/s"
    head = (f"{unit:>6} {'reqs':>5} {'fail':>4} {'total tok/s':>11} {'out tok/s':>9} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'E2E p50':>9} {'E2E p99':>9}  (ms)")
    rows = [f"[{sweep['label']}] workload={sweep['workload']} endpoint={sweep['endpoint']}", head]
    for s in sweep["levels"]:
        rows.append(
            f"{s['level']:>6g} {s['num_requests']:>5} {s['failed']:>4} {s['total_tok_s']:>11.1f} "
            f"{s['output_tok_s']:>9.1f} {_ms(s['ttft_p50_s']):>9} {_ms(s['ttft_p99_s']):>9} "
            f"{_ms(s['tpot_p50_s']):>9} {_ms(s['tpot_p99_s']):>9} {_ms(s['e2e_p50_s']):>9} {_ms(s['e2e_p99_s']):>9}")
    knee = sweep["knee"]
    rows.append(f"knee: {knee['level']} ({knee['why']})")
    return "\n".join(rows)


def _describe_runs(sweeps: list[dict]) -> str:
    def joined(key: str) -> str:
        return ", ".join(dict.fromkeys(str(sw.get(key)) for sw in sweeps))

    requests = sum(s["num_requests"] for sw in sweeps for s in sw["levels"])
    return f"model {joined('model')} | workload {joined('workload')} | {requests} requests"


def build_figure(sweeps: list[dict], title: str | None = None):
    """Throughput and latency against load; several sweeps (engines) share the axes. A bare
    matplotlib Figure (no pyplot state): the title names the model, workload and request count,
    the x ticks are the levels themselves, every y axis starts at 0, p99 is dashed beside p50, and
    the knee is starred where one was found ("still rising" written where none was)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8))
    axes = fig.subplots(2, 2)
    panels = [("total_tok_s", None, "total tok/s", 1), ("output_tok_s", None, "output tok/s", 1),
              ("ttft_p50_s", "ttft_p99_s", "TTFT (s)", 1), ("tpot_p50_s", "tpot_p99_s", "TPOT (ms)", 1000)]
    levels = sorted({s["level"] for sw in sweeps for s in sw["levels"]})
    rate = sweeps[0]["mode"] != "concurrency"
    for ax, (key, p99_key, label, scale) in zip(axes.flat, panels):
        notes = []
        for sw in sweeps:
            name = f"{sw['label']} ({sw['workload']})"
            pts = [(s["level"], s[key] * scale) for s in sw["levels"] if s[key] is not None]
            line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                            label=name + (" p50" if p99_key else ""))
            if p99_key:
                p99 = [(s["level"], s[p99_key] * scale) for s in sw["levels"] if s[p99_key] is not None]
                ax.plot([x for x, _ in p99], [y for _, y in p99], marker="o", linestyle="--", color=line.get_color(),
                        label=name + " p99")
            knee = sw["knee"]
            if knee.get("found"):
                for x, y in pts:
                    if x == knee["level"]:
                        ax.plot([x], [y], marker="*", markersize=16, linestyle="none", color=line.get_color())
            elif p99_key is None:
                notes.append(f"{sw['label']}: still rising (no knee)")
        if notes:
            ax.text(0.02, 0.97, "\n".join(notes), transform=ax.transAxes, va="top", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, labels=[f"{x:g}" for x in levels])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)" if rate else "concurrency")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{title or 'kvshare bench serve (star = knee)'}\n{_describe_runs(sweeps)}")
    fig.tight_layout()
    return fig


def plot(sweeps: list[dict], path: str, title: str | None = None):
    fig = build_figure(sweeps, title)
    fig.savefig(path, dpi=110)
    return fig
