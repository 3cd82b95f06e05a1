"""The live KV view's page (/dashboard) in a real browser: Debian's headless Chromium driven by
Playwright, against a real `kvshare serve` on loopback. What the page says (its kvDashboard
object, its text) is checked against the server's /kv/snapshot and /metrics, and what it drew is
checked too: the colour of a block's cell in a screenshot, the hover tooltip, the whole grid."""
from __future__ import annotations

import base64
import io
import json
import math
import re
import time

import openai
import pytest

from kvshare.kvcache.pool_view import block_state
from kvshare.testing.browser import CHROMIUM, CHROMIUM_ARGS, can_install_chromium, chromium_missing
from server_proc import MODEL, ServerProcess

try:
    from playwright import sync_api as playwright_api
except ImportError:  # reported by the browser fixture, so every browser test says why it cannot run
    playwright_api = None
from PIL import Image  # matplotlib's dependency: reads the screenshots' pixels

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STATES = ("free", "cached", "in_use", "shared")
VIEWPORT = {"width": 1280, "height": 900}
# Long enough for several full blocks: the second request hits the first's cached prefix.
PREFIX = ("The history of the lighthouse keepers of the northern coast is a long one. Each keeper kept a log "
          "of ships, storms, tides and lamps, and every log was read by the next keeper before the season "
          "began. ") * 2
# 20 token ids: one full block of 16 and 4 tokens into the next, so n=2's forks share a partial
# block that the first decoded token writes into.
MID_BLOCK_PROMPT = list(range(300, 320))



@pytest.fixture(scope="module")
def browser():
    # `make setup` installs both; a missing one is a broken setup, not a reason to skip, except
    # for chromium on a machine without apt-get (not Debian), where setup could only warn.
    assert playwright_api is not None, "playwright is missing: `make setup` installs the test extra"
    missing = chromium_missing()
    if missing is not None:
        if not can_install_chromium():
            pytest.skip(f"{missing} (no apt-get on this machine)")
        pytest.fail(missing)
    with playwright_api.sync_playwright() as pw:
        # launch() gives the browser a fresh temporary profile of its own.
        b = pw.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    # Room for two long requests (they must outlast every check made while they run, on a fast
    # machine too) without preemption: 182 blocks of 16 tokens with a float32 cache, 364 with the
    # default mode's bfloat16 one on avx512_bf16 CPUs.
    srv = ServerProcess("--api-key", KEY, engine_args=["--kv-cache-memory", "128MiB", "--max-model-len", "1536"])
    srv.wait_ready()
    yield srv
    srv.close()


def open_dashboard(browser, srv: ServerProcess, key: str | None, viewport: dict = VIEWPORT,
                   until: str = "kvDashboard.ready"):
    """A fresh browser context (own credentials, own cache) with the page loaded and `until`
    (a JS expression) true: by default, live."""
    creds = {"http_credentials": {"username": "dash", "password": key}} if key is not None else {}
    ctx = browser.new_context(viewport=viewport, **creds)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    resp = page.goto(srv.url + "/dashboard")
    assert resp.status == 200, resp.status
    page.wait_for_function(f"() => window.kvDashboard && ({until})", timeout=30_000)
    page.dash_errors = errors
    return ctx, page


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def pixel_at_block(page, block: int) -> tuple[int, int, int]:
    """The colour actually on screen in the middle of a block's cell, once the grid has been painted
    after the caller's look at the model (a live page paints up to RENDER_INTERVAL_MS = 100 ms
    later; a CI run read a copied block's cell before its paint)."""
    if not page.evaluate("() => kvDashboard.paused"):
        seen = page.evaluate("() => kvDashboard.paints")
        page.wait_for_function("(n) => kvDashboard.paints > n", arg=seen)
    c = centre_in_grid(page, block)
    return grid_image(page).getpixel((int(c["x"]), int(c["y"])))


def centre_in_grid(page, block: int) -> dict:
    """A block's cell centre relative to the grid canvas (not the page: the status line's text can
    change while the test looks, moving the grid; a CI run's read of page coordinates missed it)."""
    return page.evaluate("(b) => { const c = kvDashboard.cellCentre(b), r = document.querySelector('#grid')"
                         ".getBoundingClientRect(); return {x: c.x - r.left, y: c.y - r.top}; }", block)


def grid_image(page) -> Image.Image:
    """The grid canvas as drawn on screen (wherever the canvas is at that moment)."""
    return Image.open(io.BytesIO(page.locator("#grid").screenshot())).convert("RGB")


def hover_text(page, block: int) -> str:
    c = page.evaluate("(b) => kvDashboard.cellCentre(b)", block)
    page.mouse.move(c["x"], c["y"])
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible")
    page.wait_for_function("(b) => document.querySelector('#tooltip').dataset.block === String(b)", arg=block)
    return tip.inner_text()


def grid_colours(page) -> set[tuple[int, int, int]]:
    img = Image.open(io.BytesIO(page.locator("#grid").screenshot())).convert("RGB")
    return {rgb for _, rgb in img.getcolors(maxcolors=1 << 16)}


def shown_counts(page) -> dict[str, int]:
    """The counts as the page prints them (its text, not its state object)."""
    return {s: int(page.locator(f'[data-count="{s}"]').inner_text()) for s in STATES}


def snapshot(srv: ServerProcess, blocks: str = "all") -> dict:
    status, _, body = srv.request("GET", f"/kv/snapshot?blocks={blocks}", headers=AUTH)
    assert status == 200, body
    snap = json.loads(body)
    assert snap["counts"] == snap["engine_counts"]
    return snap


def new_request_id(srv: ServerProcess, start) -> str:
    """The engine's id of the one request start() sets running, as /kv/snapshot lists it (the
    page shows the same ids); no guess at how the server derives it from the response id."""
    before = {r["request_id"] for r in snapshot(srv, "none")["requests"]}
    start()
    new = {r["request_id"] for r in snapshot(srv, "none")["requests"]} - before
    assert len(new) == 1, new
    return new.pop()


def advance(page, step: int) -> dict:
    """A paused page advanced to exactly engine step `step` (its batches for it may still be on
    their way): its counts there."""
    wait_until(lambda: page.evaluate("(s) => kvDashboard.advanceTo(s)", step) == step,
               f"the paused page to reach step {step}")
    return page.evaluate("() => kvDashboard.counts")


def wait_until(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_page_and_its_data_refuse_a_request_without_the_key(server):
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
    wrong = base64.b64encode(b"anyone:not-the-key").decode()
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/kv/snapshot", "/kv/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {wrong}"},
                        {"Authorization": "Basic !!not-base64"}):
            status, hdrs, body = server.request("GET", path, headers=headers)
            assert status == 401, (path, headers)
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            assert hdrs["www-authenticate"].startswith("Basic realm=")  # a browser asks for the key
        # The right key (or a wrong one), but another site made the browser send it: a refusal of
        # its own, saying why, and no challenge (the browser would only ask for the key again).
        for site in ("cross-site", "same-site"):
            for creds in (basic, wrong):
                status, hdrs, body = server.request("GET", path, headers={"Authorization": f"Basic {creds}",
                                                                          "Sec-Fetch-Site": site})
                err = json.loads(body)["error"]
                assert status == 403 and "www-authenticate" not in hdrs, (path, site)
                assert err["code"] == "cross_site_request" and f"Sec-Fetch-Site: {site}" in err["message"]
        # Other methods are behind the key too (the gate runs before any route).
        for method in ("HEAD", "OPTIONS"):
            status, _, _ = server.request(method, path)
            assert status == 401, (method, path)
    for headers in (AUTH, {"Authorization": f"Basic {basic}", "Sec-Fetch-Site": "same-origin"},
                    {"Authorization": f"Basic {basic}", "Sec-Fetch-Site": "none"}):
        status, hdrs, body = server.request("GET", "/dashboard", headers=headers)
        assert status == 200 and b"<canvas" in body
        csp = {d.strip() for d in hdrs["content-security-policy"].split(";")}
        assert {"default-src 'self'", "frame-ancestors 'none'", "base-uri 'none'", "form-action 'none'"} <= csp
    status, _, body = server.request("GET", "/dashboard/nope.js", headers=AUTH)
    assert status == 404 and "nope.js" in json.loads(body)["error"]["message"]
    # Basic opens the read-only view only, never the API (a browser sends it by itself).
    status, _, _ = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                                  headers={"Authorization": f"Basic {basic}"})
    assert status == 401


def test_a_browser_without_the_key_gets_no_page(server, browser):
    """Without the key, or offering a wrong one, the browser is refused and never gets the page."""
    for creds in ({}, {"http_credentials": {"username": "x", "password": "wrong"}}):
        ctx = browser.new_context(viewport=VIEWPORT, **creds)
        try:
            page = ctx.new_page()
            assert refused_navigation(page, server.url + "/dashboard")
        finally:
            ctx.close()


def refused_navigation(page, url: str) -> bool:
    """Whether the server refused the browser the page: a 401 shown, or (when the browser had a
    challenge it could not answer, as headless Chromium can ask nobody) a failed navigation."""
    statuses = []
    page.on("response", lambda r: statuses.append(r.status) if r.url == url else None)
    try:
        resp = page.goto(url)
    except playwright_api.Error as e:
        assert "ERR_INVALID_AUTH_CREDENTIALS" in str(e), e
        # The failure must come from the server's refusal, seen at least once.
        return bool(statuses) and all(s == 401 for s in statuses)
    return (resp.status == 401 and set(statuses) == {401} and "missing or wrong API key" in page.content()
            and page.evaluate("() => typeof window.kvDashboard") == "undefined")


def test_shared_prefix_counts_owners_then_abort_leaves_nothing_in_use(server, browser):
    ctx, page = open_dashboard(browser, server, KEY)
    palette = page.evaluate("() => kvDashboard.palette")
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    streams, ids = [], []
    try:
        # Two long-running requests on one long prefix: the second admits on the first's blocks.
        for question in (" Question one:", " Question two:"):
            def start():
                streams.append(client.completions.create(model=MODEL, prompt=PREFIX + question, max_tokens=1200,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True}))
                next(iter(streams[-1]))  # running: its prompt is computed
            ids.append(new_request_id(server, start))

        # The counts change while both decode. So the page is paused, the server read (a /metrics
        # scrape names its step; so does a snapshot), and the paused page advanced to exactly
        # those steps: it must then hold what the server held after each.
        paused_at = page.evaluate("() => { kvDashboard.pause(); return kvDashboard.step; }")
        # One scrape reads one engine snapshot (its step with its numbers). That snapshot is
        # published just after the step's events are handed over, so a scrape can lag the page
        # by a step: the first one not behind it is used.
        def scrape_not_behind():
            m = {name: v for name, _, v in server.metrics()}
            return m if m["kvshare:engine_steps_total"] >= paused_at else None

        scrape = wait_until(scrape_not_behind, "a /metrics scrape at or after the page's step")
        at_scrape = advance(page, int(scrape["kvshare:engine_steps_total"]))
        assert at_scrape["in_use"] + at_scrape["shared"] == scrape["kvshare:kv_cache_blocks_in_use"]
        assert page.evaluate("() => kvDashboard.numBlocks") == scrape["kvshare:kv_cache_blocks_total"]
        snap = snapshot(server)
        counts = advance(page, snap["step"])
        assert counts == snap["counts"] == shown_counts(page)
        assert counts["shared"] > 0 and counts["in_use"] > 0
        # Block by block, as the page built it from events and as the server read its pool.
        shown_blocks = page.evaluate("() => Array.from({length: kvDashboard.numBlocks}, (_, i) => kvDashboard.block(i))")
        for mine, theirs in zip(shown_blocks, snap["blocks"], strict=True):
            assert ({k: mine[k] for k in ("id", "state", "ref_count", "owners", "hash")}
                    == {k: theirs[k] for k in ("id", "state", "ref_count", "owners", "hash")})
        page.evaluate("() => kvDashboard.resume()")

        snap = snapshot(server)
        shared = [b for b in snap["blocks"] if b["state"] == "shared"]
        assert shared and all(b["owners"] == sorted(ids) for b in shared)
        block = shared[0]["id"]
        shown = page.evaluate("(b) => kvDashboard.block(b)", block)
        assert shown["state"] == "shared" and shown["owners"] == sorted(ids) and shown["ref_count"] == 2
        assert shown["hash"] == shared[0]["hash"]
        tip = hover_text(page, block)
        assert f"block {block} · shared · ref count 2" in tip
        assert all(rid in tip for rid in ids), tip
        assert pixel_at_block(page, block) == hex_rgb(palette["shared"])
        groups = page.evaluate("() => kvDashboard.sharingGroups()")
        assert {"owners": sorted(ids), "blocks": sorted(b["id"] for b in shared)} in groups
        group = page.locator(f'#share-groups li[data-owners="{" ".join(sorted(ids))}"]')
        group.wait_for()  # the panels are redrawn twice a second
        assert f"share {len(shared)} block(s)" in group.inner_text()
        rows = {r: page.locator(f'#requests tr[data-request="{r}"]') for r in ids}
        wait_until(lambda: all(row.count() == 1 for row in rows.values()), "both requests in the table")
        mine = [b for b in snap["blocks"] if b["state"] == "in_use" and b["owners"] == [ids[0]]]
        assert mine and pixel_at_block(page, mine[0]["id"]) == hex_rgb(palette["in_use"])

        # Paused: neither the numbers nor the drawing move while the engine steps on (each
        # request takes a new block every 16 tokens); resumed, the page catches up.
        page.click("#pause")
        assert page.evaluate("() => kvDashboard.paused") and page.locator("#pause").inner_text() == "Resume"
        frozen_step, frozen_grid = page.evaluate("() => kvDashboard.step"), page.locator("#grid").screenshot()
        frozen_counts = shown_counts(page)
        wait_until(lambda: snapshot(server, "none")["step"] > frozen_step + 20, "the engine to step on")
        assert page.evaluate("() => kvDashboard.step") == frozen_step and shown_counts(page) == frozen_counts
        assert page.locator("#grid").screenshot() == frozen_grid
        page.click("#pause")
        wait_until(lambda: page.evaluate("() => kvDashboard.step") > frozen_step + 20, "the page to catch up")
        wait_until(lambda: shown_counts(page) != frozen_counts, "the shown counts to move again")
    finally:
        for s in streams:
            s.close()  # the server aborts both
    try:
        server.wait_idle()
        final = snapshot(server)
        assert final["counts"]["in_use"] == final["counts"]["shared"] == 0 and final["counts"]["cached"] > 0
        wait_until(lambda: page.evaluate("() => kvDashboard.counts") == final["counts"] == shown_counts(page),
                   "the page to show the aborted requests' blocks released")
        # Drawn: not one pixel of the grid in an in-use or shared colour, cached cells cached.
        colours = grid_colours(page)
        assert hex_rgb(palette["in_use"]) not in colours and hex_rgb(palette["shared"]) not in colours
        cached = next(b["id"] for b in final["blocks"] if b["state"] == "cached")
        assert pixel_at_block(page, cached) == hex_rgb(palette["cached"])
        log = page.locator('#log li[data-ev="abort"]')
        wait_until(lambda: all(any(rid in line for line in log.all_inner_texts()) for rid in ids),
                   "both aborts in the event log")
        assert page.dash_errors == []
    finally:
        ctx.close()


def test_forced_copy_on_write_shows_as_it_happens(server, browser):
    ctx, page = open_dashboard(browser, server, KEY)
    palette = page.evaluate("() => kvDashboard.palette")
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    streams = []

    def start():
        streams.append(client.completions.create(model=MODEL, prompt=MID_BLOCK_PROMPT, n=2, max_tokens=1000,
                                                 temperature=0.9, seed=3, stream=True, extra_body={"ignore_eos": True}))
        next(iter(streams[-1]))

    try:
        rid = new_request_id(server, start)
        # While the request still runs: the page got the copy from the event stream.
        cows = wait_until(lambda: [c for c in page.evaluate("() => kvDashboard.cows") if c["seq"].startswith(rid)],
                          "the copy-on-write to reach the page")
        cow = cows[0]
        assert cow["seq"] in (f"{rid}#0", f"{rid}#1") and cow["src"] != cow["dst"]
        live = snapshot(server)["blocks"]
        # The copy is the writer's own block; the original stays with the other fork.
        assert live[cow["dst"]]["owners"] == [rid] and live[cow["dst"]]["position"] == 1
        assert live[cow["src"]]["owners"] == [rid] and live[cow["src"]]["ref_count"] == 1
        shown = page.evaluate("(b) => kvDashboard.block(b)", cow["dst"])
        assert shown["owners"] == [rid] and shown["sequences"] == [cow["seq"]]
        # Its last event: the copy, or what came after it (the block fills up and is cached).
        last = shown["last_event"]
        assert last == {"ev": "cow", "step": cow["step"]} or (last["ev"] == "register" and last["step"] > cow["step"])
        assert f"block {cow['dst']} · in use · ref count 1" in hover_text(page, cow["dst"])
        assert pixel_at_block(page, cow["dst"]) == hex_rgb(palette["in_use"])
        line = f"copies shared block {cow['src']} into block {cow['dst']}"
        page.wait_for_function("(t) => [...document.querySelectorAll('#log li[data-ev=\"cow\"]')]"
                               ".some((li) => li.textContent.includes(t))", arg=line)
        assert page.evaluate("() => kvDashboard.totals.cow") >= 1
        # The per-second series counts it at its next sample (about a second; the bound is for a
        # loaded machine).
        wait_until(lambda: max(page.evaluate("() => kvDashboard.series().cow"), default=0) >= 1,
                   "the copy in the copy-on-write/s series")
        assert page.dash_errors == []
    finally:
        for s in streams:
            s.close()
        ctx.close()
    server.wait_idle()


def test_reconnect_while_paused_does_not_replay_older_events(server, browser):
    """Paused, the page keeps a running request's events; then its stream drops and the request
    ends while it is away (those events are lost to it). The reconnect's snapshot already has the
    blocks back: resuming must not replay the kept, older events on top of it."""
    ctx, page = open_dashboard(browser, server, KEY)
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    streams = []

    def start():
        streams.append(client.completions.create(model=MODEL, prompt=PREFIX + " Question three:", max_tokens=1000,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
        next(iter(streams[-1]))

    try:
        page.evaluate("() => kvDashboard.pause()")
        rid = new_request_id(server, start)
        running = snapshot(server, "none")
        assert running["counts"]["in_use"] > 0
        wait_until(lambda: (page.evaluate("() => kvDashboard.keptStep") or -1) >= running["step"],
                   "the paused page to keep the running request's events")
        # Away: every new event stream is refused until the request has ended.
        ctx.route("**/kv/events", lambda route: route.abort())
        page.evaluate("() => kvDashboard.reconnect()")
        page.wait_for_function("() => kvDashboard.status === 'error'")
        streams.pop().close()  # the server aborts it: its blocks go back while the page is away
        server.wait_idle()
        ctx.unroute("**/kv/events")
        page.wait_for_function("() => kvDashboard.ready && kvDashboard.paused", timeout=30_000)
        page.evaluate("() => kvDashboard.resume()")
        final = snapshot(server)
        assert final["counts"]["in_use"] == final["counts"]["shared"] == 0
        wait_until(lambda: page.evaluate("() => kvDashboard.counts") == final["counts"],
                   "the page's counts to be the idle server's")
        shown = page.evaluate("() => Array.from({length: kvDashboard.numBlocks}, (_, i) => kvDashboard.block(i))")
        assert [(b["state"], b["owners"]) for b in shown] == [(b["state"], b["owners"]) for b in final["blocks"]]
        assert not any(rid in b["owners"] for b in shown)
        assert page.dash_errors == []
    finally:
        for s in streams:
            s.close()
        ctx.close()
    server.wait_idle()


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def pool_snapshot(step: int, requests: list[dict], held: dict[int, str]) -> dict:
    """A /kv/snapshot answer for an 8-block pool: `held` block id -> its one owner."""
    blocks = [{"id": i, "state": "in_use" if i in held else "free", "ref_count": int(i in held),
               "owners": [held[i]] if i in held else [], "group": 0 if i in held else None, "position": None,
               "hash": None, "parent": None, "last_event": None} for i in range(8)]
    return {"step": step, "num_blocks": 8, "block_size": 16, "blocks": blocks, "requests": requests}


def test_a_preempted_request_keeps_its_row_and_count_until_readmitted(server, browser):
    """The page fed a scripted stream (the browser's own routing stands in for the server's data
    endpoints, the page itself still comes from the server), and its clock driven by the test:
    a request preempted, then 35 s waiting (longer than a finished row stays), then re-admitted
    after a reconnect. Its row stays all along and its preemption count goes on."""
    phase = {"n": 1}  # 1: the first connection, "away": refused, 2: the reconnect
    hello = sse("hello", {"step": 0, "num_blocks": 8, "block_size": 16, "queue": 64})
    streams = {
        1: hello + sse("step", {"step": 1, "dropped": 0, "events": [
                {"ev": "admit", "seq": "req-a", "salt": None, "step": 1},
                {"ev": "alloc", "block": 0, "seq": "req-a", "step": 1}]})
           + sse("step", {"step": 2, "dropped": 0, "events": [
                {"ev": "preempt", "seq": "req-a", "step": 2},
                {"ev": "decref", "block": 0, "seq": "req-a", "ref": 0, "step": 2},
                {"ev": "free", "block": 0, "step": 2}]}),
        2: hello + sse("step", {"step": 3, "dropped": 0, "events": [
                {"ev": "admit", "seq": "req-a", "salt": None, "step": 3},
                {"ev": "alloc", "block": 1, "seq": "req-a", "step": 3}]}),
    }
    snapshots = {1: pool_snapshot(0, [], {}),
                 2: pool_snapshot(2, [{"request_id": "req-a", "status": "waiting"}], {})}

    def events(route):
        if phase["n"] == "away":
            route.abort()
            return
        route.fulfill(status=200, content_type="text/event-stream", body=streams[phase["n"]])
        if phase["n"] == 1:
            phase["n"] = "away"  # the page retries every few seconds: not the same steps again

    def snap(route):
        body = snapshots[2 if phase["n"] == 2 else 1]
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    ctx = browser.new_context(viewport=VIEWPORT, http_credentials={"username": "dash", "password": KEY})
    try:
        ctx.route("**/kv/events", events)
        ctx.route("**/kv/snapshot", snap)
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.clock.install()
        page.clock.resume()  # time flows as usual, until the test jumps it forward
        assert page.goto(server.url + "/dashboard").status == 200
        row = page.locator('#requests tr[data-request="req-a"]')

        def cells() -> list[str]:  # request, status, blocks, shared, hits, copies, preemptions
            return row.locator("td").all_inner_texts()

        # The scripted stream ends after step 2: by then the page has the preemption.
        page.wait_for_function("() => kvDashboard.status === 'error' && kvDashboard.totals.preemptions === 1")
        wait_until(lambda: row.count() == 1 and cells()[1] == "preempted", "the preempted row")
        assert cells()[6] == "1"
        page.clock.fast_forward("00:35")  # past FINISHED_REQUEST_MS: the table drops finished rows
        # Two frames later the table has been redrawn at the new time (the first one draws it).
        page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
        assert row.count() == 1 and cells()[1] == "preempted" and cells()[6] == "1"
        phase["n"] = 2
        page.wait_for_function("() => kvDashboard.step === 3")
        wait_until(lambda: row.count() == 1 and cells()[1] == "running", "the re-admitted row")
        assert cells()[2] == "1" and cells()[6] == "1"
        assert page.evaluate("(b) => kvDashboard.block(b).owners", 1) == ["req-a"]
        assert errors == []
    finally:
        ctx.close()


def test_batches_are_counted_only_after_the_snapshot_step(server, browser):
    """A paused page reconnects to a scripted stream whose first batches overlap the new
    snapshot (step 5): the batch of an earlier step is already in the snapshot and is not
    applied; the one of its own step is applied (harmless: every event sets state absolutely)
    but not counted; only later steps count toward copies and evictions, on resume too."""
    def cow(step: int, src: int, dst: int) -> dict:
        return {"ev": "cow", "seq": "req-a#1", "src": src, "dst": dst, "step": step}

    batches = [(4, [{"ev": "alloc", "block": 3, "seq": "req-b", "step": 4}]),  # freed again by step 5
               (5, [cow(5, 0, 1), {"ev": "evict", "block": 2, "step": 5}]),
               (6, [cow(6, 0, 4), {"ev": "evict", "block": 5, "step": 6}])]
    hello = sse("hello", {"step": 4, "num_blocks": 8, "block_size": 16, "queue": 64})
    bodies = [hello, hello + "".join(sse("step", {"step": step, "dropped": 0, "events": events})
                                     for step, events in batches)]
    served, paused = [], []

    def events(route):
        # The first connection ends at once; the second (made while paused) brings the batches;
        # any later one is refused, so nothing is served twice.
        if served == [hello] and not paused:
            route.abort()
            return
        if len(served) == len(bodies):
            route.abort()
            return
        served.append(bodies[len(served)])
        route.fulfill(status=200, content_type="text/event-stream", body=served[-1])

    snap = pool_snapshot(5, [{"request_id": "req-a", "status": "running"}], {0: "req-a", 1: "req-a"})
    ctx = browser.new_context(viewport=VIEWPORT, http_credentials={"username": "dash", "password": KEY})
    try:
        ctx.route("**/kv/events", events)
        ctx.route("**/kv/snapshot", lambda route: route.fulfill(status=200, content_type="application/json",
                                                                body=json.dumps(snap)))
        page = ctx.new_page()
        assert page.goto(server.url + "/dashboard").status == 200
        page.wait_for_function("() => kvDashboard.status === 'error'")  # the first stream ended
        page.evaluate("() => kvDashboard.pause()")
        paused.append(True)
        # Reconnected while paused: the snapshot loaded, the batches after it kept (the scripted
        # stream then ends again, so the page is not "ready" any more; what it kept stays).
        page.wait_for_function("() => kvDashboard.keptStep === 6", timeout=30_000)
        page.evaluate("() => kvDashboard.resume()")
        assert page.evaluate("() => kvDashboard.step") == 6
        totals = page.evaluate("() => kvDashboard.totals")
        assert (totals["cow"], totals["evictions"]) == (1, 1)
        assert page.evaluate("() => kvDashboard.cows") == [{"step": 6, "seq": "req-a#1", "src": 0, "dst": 4}]
        assert page.evaluate("(b) => kvDashboard.block(b).state", 3) == "free"  # step 4 not replayed
    finally:
        ctx.close()


def test_aggregated_cells_fill_in_proportion_to_their_blocks(server, browser):
    """A pool too big for one cell per block, from a scripted snapshot (block i: in use when
    i % 4 == 0, cached when 1, else free): each cell is split left to right in proportion to its
    blocks' states (shared, in use, cached, free), measured along a row of its pixels."""
    n = 20_000
    rows = [{"id": i, "ref_count": int(i % 4 == 0), "owners": ["req-a"] if i % 4 == 0 else [],
             "hash": f"{i:012x}" if i % 4 == 1 else None, "parent": None, "position": None, "last_event": None}
            for i in range(n)]
    for row in rows:  # as the server sends them: each row with its state (the page derives none)
        row["state"] = block_state(row["ref_count"], row["hash"] is not None)
    snap = json.dumps({"step": 0, "num_blocks": n, "block_size": 16, "blocks": rows, "requests": []})
    hello = sse("hello", {"step": 0, "num_blocks": n, "block_size": 16, "queue": 64})
    ctx = browser.new_context(viewport={"width": 400, "height": 900},
                              http_credentials={"username": "dash", "password": KEY})
    try:
        ctx.route("**/kv/events", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=hello))
        ctx.route("**/kv/snapshot", lambda route: route.fulfill(status=200, content_type="application/json", body=snap))
        page = ctx.new_page()
        assert page.goto(server.url + "/dashboard").status == 200
        page.wait_for_function("() => kvDashboard.numBlocks === 20000 && kvDashboard.counts.cached === 5000")
        # The grid is painted up to 100 ms (RENDER_INTERVAL_MS) after the model has the snapshot;
        # the shown counts are written right after the paint (a clean-clone run read the cells before it).
        page.wait_for_function("() => document.querySelector('[data-count=\"cached\"]').textContent === '5000'")
        palette = page.evaluate("() => kvDashboard.palette")
        per = page.evaluate("() => kvDashboard.blocksPerCell")
        assert per >= 2
        for cell in (0, 1, 7):
            blocks = [page.evaluate("(b) => kvDashboard.block(b).state", b) for b in range(cell * per, (cell + 1) * per)]
            inner = round(page.evaluate("() => kvDashboard.cellPixels"))  # no gap below 7 pixels
            assert inner < 7
            centre = centre_in_grid(page, cell * per)
            img, left = grid_image(page), round(centre["x"] - inner / 2)
            drawn = [img.getpixel((left + x, int(centre["y"]))) for x in range(inner)]
            expected, done, edge = [], 0, 0
            for state in ("shared", "in_use", "cached", "free"):
                done += blocks.count(state)
                right = math.floor(done / per * inner + 0.5)  # JavaScript's Math.round, not Python's
                expected += [hex_rgb(palette[state])] * (right - edge)
                edge = right
            assert drawn == expected, (cell, blocks, drawn)
    finally:
        ctx.close()


def test_injected_audit_violation_is_highlighted_on_the_named_block(browser):
    """A server with the audit on and a planted bug (a prefix hit shares cached blocks without
    counting the new holder): the audit stops the engine and names a block; the page paints that
    block red. Its pool of 1-token blocks is too big for one cell per block in a narrow window,
    so this is also the page's aggregated grid (several blocks a cell)."""
    srv = ServerProcess("--audit", "--inject-fault", "share_without_incref",
                        engine_args=["--kv-cache-memory", "96MiB", "--max-model-len", "512", "--block-size", "1",
                                     "--kv-cache-dtype", "int8"]).wait_ready()
    try:
        ctx, page = open_dashboard(browser, srv, None, viewport={"width": 400, "height": 900})  # no --api-key: open
        palette = page.evaluate("() => kvDashboard.palette")
        assert page.evaluate("() => kvDashboard.blocksPerCell") >= 2
        page_blocks = page.evaluate("() => kvDashboard.numBlocks")
        prompt = list(range(300, 340))
        status, _ = srv.post_json("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3})
        assert status == 200
        status, _ = srv.post_json("/v1/completions", {"model": MODEL, "prompt": prompt + [5, 6], "max_tokens": 3})
        assert status == 503  # its prefix hit broke an invariant: the engine stopped
        logged = wait_until(lambda: re.search(r"invariant '(\w+)' violated at step (\d+).*\n\s+block (\d+)",
                                              srv.log_text()), "the audit's report in the server log")
        invariant, step, block = logged.group(1), int(logged.group(2)), int(logged.group(3))
        assert invariant == "refcount_matches_tables"
        assert re.search(r"WARNING .*--inject-fault share_without_incref", srv.log_text())  # said at startup
        violations = wait_until(lambda: page.evaluate("() => kvDashboard.violations"), "the violation on the page")
        assert violations == [{"block": block, "invariant": invariant, "step": step}]
        banner = page.locator(f'#violations [data-block="{block}"]')
        banner.wait_for()
        assert invariant in banner.inner_text()
        # Not "the event stream ended": the page asks the server why, and says so. (Awaited
        # before reading pixels: the status line's new text can move the grid down.)
        page.wait_for_function("() => kvDashboard.status === 'stopped'")
        assert invariant in page.locator("#status").inner_text()
        assert pixel_at_block(page, block) == hex_rgb(palette["violation"])
        c = page.evaluate("(b) => kvDashboard.cellCentre(b)", block)
        page.mouse.move(c["x"], c["y"])
        tip = page.locator("#tooltip")
        tip.wait_for(state="visible")
        assert f"AUDIT VIOLATION: {invariant} on block {block} (step {step})" in tip.inner_text()
        # The rest of the grid keeps its own colours: one red cell, however many blocks it holds.
        img = Image.open(io.BytesIO(page.locator("#grid").screenshot())).convert("RGB")
        red = sum(n for n, rgb in img.getcolors(maxcolors=1 << 16) if rgb == hex_rgb(palette["violation"]))
        side = page.evaluate("() => kvDashboard.cellPixels")
        assert 0 < red <= side * side  # one cell's worth at most
        assert page.dash_errors == []
        ctx.close()

        # The stopped engine still answers for its pool: a 503 for scripts, with the verdict
        # (redacted: no owners, no detail) and the pool as it stopped.
        status, _, body = srv.request("GET", "/kv/snapshot")
        dead = json.loads(body)
        assert status == 503 and dead["error"]["code"] == "engine_dead"
        assert dead["audit_failure"] == {"block": block, "invariant": invariant, "step": step}
        assert dead["snapshot"]["num_blocks"] == page_blocks and len(dead["snapshot"]["blocks"]) == page_blocks
        assert "owners" not in dead["error"]["message"] and invariant in dead["error"]["message"]

        # A page opened after the stop (a reload) shows the violation too, on the named block.
        ctx, page = open_dashboard(browser, srv, None, viewport={"width": 400, "height": 900},
                                   until="kvDashboard.violations.length > 0")
        assert page.evaluate("() => kvDashboard.violations") == [{"block": block, "invariant": invariant, "step": step}]
        page.locator(f'#violations [data-block="{block}"]').wait_for()
        page.wait_for_function("() => kvDashboard.status === 'stopped'")
        assert "audit violation" in page.locator("#status").inner_text()
        assert page.evaluate("(b) => kvDashboard.block(b).violation", block) == {"invariant": invariant, "step": step}
        wait_until(lambda: pixel_at_block(page, block) == hex_rgb(palette["violation"]),
                   "the named block painted red on the reloaded page")
        assert page.dash_errors == []
        ctx.close()
    finally:
        srv.close()


def test_the_page_shows_kv_tier_occupancy(browser, tmp_path):
    """A server with KV tiers (docs/kv_tiers.md): the page's tier line shows each tier's blocks
    against its budget, as /metrics reports them."""
    srv = ServerProcess(engine_args=["--kv-cache-memory", "3MiB", "--max-model-len", "512", "--kv-host-memory",
                                     "16MiB", "--kv-disk-path", str(tmp_path), "--kv-disk-size", "64MiB"]).wait_ready()
    try:
        for prompt in (list(range(300, 349)), list(range(400, 513))):  # the second evicts the first: into the tiers
            status, _ = srv.post_json("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert status == 200
        ctx, page = open_dashboard(browser, srv, None)
        page.wait_for_function("() => kvDashboard.tiers && kvDashboard.tiers.kept.cpu > 0", timeout=30_000)
        tiers = page.evaluate("() => kvDashboard.tiers")
        assert tiers["kept"] == {"cpu": srv.metric("kvshare:kv_tier_blocks", tier="cpu"),
                                 "disk": srv.metric("kvshare:kv_tier_blocks", tier="disk")}
        assert tiers["budget"]["cpu"] == srv.metric("kvshare:kv_tier_capacity_blocks", tier="cpu") > 0
        assert page.is_visible("[data-tiers]")
        assert page.text_content('[data-tier="cpu"]') == f"{int(tiers['kept']['cpu'])} / {int(tiers['budget']['cpu'])}"
        ctx.close()
    finally:
        srv.close()
