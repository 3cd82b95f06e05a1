"""`kvshare doctor --url`'s report for a person: the text printed, and a self-contained HTML page
(no CDN, no script: inline CSS and an inline SVG drift plot per difference): the verdict first,
then per stage the sharing path, what was sent, what differed (side by side, the first differing
token, logprob drift against the noise tolerance) and the repro."""
from __future__ import annotations

import html
import json


def format_text(report: dict) -> str:
    c = report["comparison"]
    rule = "exact equality" if c["exact"] else f"logprobs within {c['tolerance']:.3g}"
    caps = report["capabilities"]
    lines = [f"kvshare doctor --url {report['url']} (model {report['model']}): compared by {rule}: {c['why']}"]
    refused = caps.get("refused") or {}
    if refused:
        lines.append("  not accepted: " + "; ".join(f"{k} ({v})" for k, v in refused.items()))
    lines.append("  LoRA adapters listed: " + (", ".join(caps.get("adapters") or []) or
                                               "none (the adapters stage does not run)"))
    for st in report["stages"]:
        lines.append(f"  {st['name']:<12} {st['verdict']:<14} {len(st['requests'])} requests, {st['seconds']:.1f} s")
        for f in st["findings"][:3]:
            lines.append(f"      {f['detail']}")
        for n in st["notes"]:
            lines.append(f"      note: {n}")
    r = report.get("repro")
    if r:
        lines.append(f"repro ({r['requests']} request{'s' if r['requests'] != 1 else ''}"
                     f"{'' if r['minimal'] else ', not shrunk further'}): {r['path']} (curl: {r['curl']})")
        lines.append("  " + describe_case(r["case"]))
    lines.append(report["summary"])
    return "\n".join(lines)


def describe_case(case: list[list[dict]]) -> str:
    """A repro's requests in order, as a person would say it: "victim (streamed, 48 tokens), then
    cut0 after victim's first chunk, cut after 1 chunk"."""
    steps = []
    for step in case:
        said = []
        for r in step:
            how = [f"{r['body'].get('max_tokens')} tokens", "streamed" if r["body"].get("stream") else "not streamed"]
            if r.get("after_first_chunk_of"):
                how.insert(0, f"sent after {r['after_first_chunk_of']}'s first chunk")
            if r.get("cut_after_chunks"):
                how.append(f"cut after {r['cut_after_chunks']} chunk(s)")
            if r.get("timeout_s"):
                how.append(f"client timeout {r['timeout_s']:g} s")
            said.append(f"{r['name']} ({', '.join(how)})")
        steps.append(" beside ".join(said))
    return "; then ".join(steps)


def drift_svg(drift: list[float], tol: float, width: int = 360, height: int = 90) -> str:
    """|logprob difference| per token position on a log scale, with the tolerance as a line."""
    if not drift:
        return "<p class=muted>no logprobs to plot</p>"
    floor = 1e-9
    lo, hi = -9.0, 1.0  # log10 range shown

    def y(v: float) -> float:
        import math

        lv = min(max(math.log10(max(v, floor)), lo), hi)
        return height - 12 - (lv - lo) / (hi - lo) * (height - 20)

    step = (width - 40) / max(1, len(drift) - 1)
    pts = " ".join(f"{30 + i * step:.1f},{y(v):.1f}" for i, v in enumerate(drift))
    tol_y = y(tol) if tol > 0 else height - 12
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="logprob drift per token">'
            f'<line x1="30" y1="{tol_y:.1f}" x2="{width - 10}" y2="{tol_y:.1f}" stroke="#c33" stroke-dasharray="4 3"/>'
            f'<text x="{width - 10}" y="{tol_y - 3:.1f}" text-anchor="end" font-size="10" fill="#c33">'
            f'tolerance {tol:.2g}</text>'
            f'<polyline fill="none" stroke="#246" stroke-width="1.5" points="{pts}"/>'
            f'<text x="2" y="12" font-size="10">1e1</text><text x="2" y="{height - 10}" font-size="10">1e-9</text>'
            f'<text x="30" y="{height}" font-size="10">token 0</text></svg>')


def format_html(report: dict) -> str:
    e = html.escape
    c = report["comparison"]
    verdict_class = {"contamination": "bad", "no contamination found": "good"}.get(report["verdict"], "warn")
    parts = [
        "<!doctype html><html><head><meta charset=utf-8><title>kvshare doctor report</title><style>",
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        ".good{background:#dfd}.bad{background:#fdd}.warn{background:#ffd}.verdict{padding:1em;font-size:1.3em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}"
        "pre{white-space:pre-wrap;margin:0}.muted{color:#777}.side{display:grid;grid-template-columns:1fr 1fr;gap:8px}",
        "</style></head><body>",
        f"<div class='verdict {verdict_class}'>{e(report['summary'])}</div>",
        f"<p>{e(report['url'])}, model {e(str(report['model']))}; compared by "
        f"{'exact equality' if c['exact'] else 'logprobs within %.3g' % c['tolerance']}: {e(c['why'])}. "
        f"{report['requests_sent']} requests in {report['elapsed_s']} s (budget {report['budget_s']:g} s).</p>",
    ]
    r = report.get("repro")
    if r:
        parts.append(f"<h2>Minimal repro</h2><p>{r['requests']} request(s), stage {e(r['stage'])}: {e(r['detail'])}"
                     f"{'' if r['minimal'] else ' (could not be shrunk further)'}.<br>{e(describe_case(r['case']))}"
                     f"<br>JSONL: <code>{e(r['path'])}"
                     f"</code>, curl script: <code>{e(r['curl'])}</code>. Check it: "
                     f"<code>kvshare doctor --url {e(report['url'])} --replay {e(r['path'])}</code></p>")
        try:
            with open(r["curl"], encoding="utf-8") as f:
                parts.append(f"<pre>{e(f.read())}</pre>")
        except OSError:
            pass
    caps = report["capabilities"]
    parts.append("<h2>What the server takes</h2><table>")
    for k, v in caps["accepted"].items():
        parts.append(f"<tr><td>{e(k)}</td><td>{'accepted' if v else 'not accepted: ' + e(caps['refused'].get(k, ''))}"
                     "</td></tr>")
    parts.append(f"<tr><td>streaming</td><td>{caps['streams']}</td></tr><tr><td>chat</td><td>{caps['chat']}</td></tr>"
                 f"<tr><td>bit-transparent (says)</td><td>{caps['bit_transparent']}</td></tr>"
                 f"<tr><td>LoRA adapters listed</td><td>{e(', '.join(caps.get('adapters') or []) or 'none')}</td></tr>"
                 "</table>")
    parts.append("<h2>Stages</h2><table><tr><th>stage</th><th>verdict</th><th>sharing path</th><th>requests</th></tr>")
    for st in report["stages"]:
        cls = {"contamination": "bad", "clean": "good"}.get(st["verdict"], "warn")
        parts.append(f"<tr><td><a href='#{st['name']}'>{st['name']}</a></td><td class={cls}>{e(st['verdict'])}</td>"
                     f"<td>{e(st['path'])}</td><td>{len(st['requests'])}</td></tr>")
    parts.append("</table>")
    for st in report["stages"]:
        parts.append(f"<h3 id='{st['name']}'>{st['name']}: {e(st['verdict'])}</h3><p class=muted>{e(st['path'])}</p>")
        for n in st["notes"]:
            parts.append(f"<p>note: {e(n)}</p>")
        for f in st["findings"]:
            parts.append(_finding_html(f, c["tolerance"]))
        parts.append("<details><summary>what was sent</summary><table><tr><th>name</th><th>endpoint</th>"
                     "<th>how</th><th>max_tokens</th><th>content</th></tr>")
        for q in st["requests"]:
            parts.append(f"<tr><td>{e(q['name'])}</td><td>{e(q['endpoint'])}</td><td>{e(q['how'])}</td>"
                         f"<td>{q['max_tokens']}</td><td><pre>{e(q['content'])}</pre></td></tr>")
        parts.append("</table></details>")
    parts.append(f"<details><summary>the report as JSON</summary><pre>{e(json.dumps(report, indent=1))}</pre>"
                 "</details></body></html>")
    return "".join(parts)


def _finding_html(f: dict, tol: float) -> str:
    e = html.escape
    d = f.get("diff") or {}
    first = d.get("first_token")
    exp, got = f["expected"], f["got"]
    cls = "bad" if f["beyond_noise"] else "warn"
    return (f"<div class={cls}><p><b>{e(f['kind'])}</b>: {e(f['detail'])}"
            + (f" (first differing token: {first})" if first is not None else "") + "</p>"
            f"<div class=side><div><b>alone, cold</b><pre>{e(exp.get('text', ''))}</pre></div>"
            f"<div><b>{e(f['victim'])}</b><pre>{e(got.get('text', '') or got.get('error') or '')}</pre></div></div>"
            + (drift_svg(d.get("drift") or [], tol) if d else "") + "</div>")
