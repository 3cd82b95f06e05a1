// The live KV view's page: one snapshot of the pool (GET kv/snapshot), then every block event as
// it happens (GET kv/events, server-sent events read with fetch), applied to a copy of the pool
// kept here. Drawn on canvases: one cell per block (or per few blocks on a large pool), the
// prefix tree of cached chains, rates over time. Paths are relative to the page, so it also works
// behind a proxy's path prefix. No credentials are handled here: under --api-key the browser asked
// for the key (HTTP Basic) when it loaded the page and sends it with these same-origin fetches.
"use strict";

(() => {
  // A block's state comes from the server (kvshare.kvcache.pool_view.block_state), in the snapshot's
  // rows and on each block event: this page shows states, it never derives them.
  const STATES = ["free", "cached", "in_use", "shared"];
  const FREE = 0, CACHED = 1, IN_USE = 2, SHARED = 3;
  const STATE_CODE = Object.fromEntries(STATES.map((s, code) => [s, code]));
  const PALETTE = { free: "#e5e7eb", cached: "#93c5fd", in_use: "#f59e0b", shared: "#7c3aed", violation: "#dc2626" };
  const STATE_COLOUR = STATES.map((s) => PALETTE[s]);
  const MIN_CELL_PX = 4;           // below this a cell stands for several blocks
  const MAX_CELL_PX = 16;
  const GRID_MAX_HEIGHT_PX = 520;  // the grid grows in cells per row before it grows taller than this
  const FLASH_MS = 1500;           // how long a copied-on-write block stays outlined
  // The grid and counts are redrawn at most this often (10 a second: live to the eye). Drawing on
  // every animation frame cost the browser ~3x the CPU under load, which on a small server that
  // also runs the browser is taken from the engine (benchmarks/dashboard_cost.py).
  const RENDER_INTERVAL_MS = 100;
  const SERIES_POINTS = 120;       // two minutes of one-second samples
  const LOG_LINES = 200;
  const PAUSED_EVENTS_MAX = 200000; // beyond this, a resume starts again from a fresh snapshot
  const RECONNECT_MS = 3000;
  const FRAME_SAMPLES = 36000;     // ten minutes at 60 frames a second, for the cost benchmark
  const REQUEST_ROWS = 100;
  const TOOLTIP_OWNERS = 8;
  const HIT_RATE_WINDOW = 10;       // seconds of prompt lookups the hit rate is taken over
  const FINISHED_REQUEST_MS = 30000; // a finished request stays in the table this long

  const $ = (sel) => document.querySelector(sel);

  // A sequence id names its request, plus "#index" when the request has several sequences.
  function requestOf(seq) {
    const m = /^(.*)#\d+$/.exec(seq);
    return m ? m[1] : seq;
  }

  // ---- the pool, as the events say it is ------------------------------------------------------
  class PoolModel {
    constructor() {
      this.reset(0, 0);
      this.violations = [];          // {block, invariant, step}; kept across resyncs
      this.violated = new Map();     // block id -> violation
      this.totals = { evictions: 0, cow: 0, preemptions: 0, events: 0 };
      this.cows = [];                // the last copies: {step, seq, src, dst}
    }

    reset(numBlocks, blockSize) {
      this.numBlocks = numBlocks;
      this.blockSize = blockSize;
      this.ref = new Int32Array(numBlocks);
      this.code = new Uint8Array(numBlocks);   // FREE..SHARED
      this.hash = new Array(numBlocks).fill(null);
      this.parent = new Array(numBlocks).fill(null);
      this.owners = new Array(numBlocks).fill(null); // Set of sequence (or request) ids while held
      this.last = new Array(numBlocks).fill(null);   // {ev, step}
      this.position = new Array(numBlocks).fill(null);
      this.counts = { free: numBlocks, cached: 0, in_use: 0, shared: 0 };
      this.held = new Set();
      this.requests = new Map();     // request id -> {status, hits, cow, preempted, seen}
      this.step = 0;
      this.dirtyBlocks = new Set();
      this.treeDirty = true;
    }

    load(snap) {
      // Hits, copies and preemptions are counted from events only (a snapshot has none of them):
      // a request the snapshot still lists keeps what this page counted for it.
      const before = this.requests ?? new Map();
      if (snap.num_blocks !== this.numBlocks || snap.block_size !== this.blockSize) {
        this.reset(snap.num_blocks, snap.block_size);
        this.layoutChanged = true;
      } else {
        const violations = this.violations;
        this.reset(snap.num_blocks, snap.block_size);
        this.violations = violations;
      }
      for (const row of snap.blocks) {
        const id = row.id;
        this.ref[id] = row.ref_count;
        this.hash[id] = row.hash;
        this.parent[id] = row.parent ?? null;
        this.owners[id] = row.owners.length ? new Set(row.owners) : null;
        this.last[id] = row.last_event;
        this.position[id] = row.position;
        this.settle(id, row.state);
      }
      this.recount();
      for (const r of snap.requests) {
        const old = before.get(r.request_id);
        if (old !== undefined) this.requests.set(r.request_id, old);
        // A preempted request waits again: still "preempted" here until it is re-admitted.
        const row = this.request(r.request_id);
        if (!(row.status === "preempted" && r.status === "waiting")) row.status = r.status;
      }
      this.step = snap.step;
      this.allDirty = true;
      this.treeDirty = true;
    }

    recount() {
      const counts = { free: 0, cached: 0, in_use: 0, shared: 0 };
      this.held.clear();
      for (let id = 0; id < this.numBlocks; id++) {
        counts[STATES[this.code[id]]] += 1;
        if (this.ref[id] > 0) this.held.add(id);
      }
      this.counts = counts;
    }

    // After a change to block `id`: its state (as received), the counts and the set of held
    // blocks follow.
    settle(id, state) {
      const before = this.code[id];
      const after = STATE_CODE[state] ?? before;
      if (before !== after) {
        this.counts[STATES[before]] -= 1;
        this.counts[STATES[after]] += 1;
        this.code[id] = after;
        if (this.hash[id] !== null) this.treeDirty = true; // the tree colours its blocks by state
      }
      if (this.ref[id] > 0) this.held.add(id); else this.held.delete(id);
      this.dirtyBlocks.add(id);
    }

    request(id) {
      let r = this.requests.get(id);
      if (r === undefined) {
        r = { status: "running", hits: 0, cow: 0, preempted: 0, seen: performance.now() };
        this.requests.set(id, r);
      }
      return r;
    }

    // Every state change an event makes is absolute (the new reference count, the hash, one owner
    // in or out), so events already reflected in a snapshot can be applied again harmlessly.
    // `live`: the event happened after the snapshot, so it counts toward rates and the log.
    apply(e, live, log) {
      const b = e.block;
      if (b !== undefined && b !== null && (b < 0 || b >= this.numBlocks)) return;
      switch (e.ev) {
        case "alloc":
          this.ref[b] = 1;
          this.owners[b] = new Set([e.seq]);
          this.hash[b] = null;
          this.parent[b] = null;
          this.position[b] = null;
          break;
        case "evict":
          this.hash[b] = null;
          this.parent[b] = null;
          this.treeDirty = true;
          if (live) this.totals.evictions += 1;
          break;
        case "incref":
          this.ref[b] = e.ref;
          (this.owners[b] ??= new Set()).add(e.seq);
          break;
        case "decref": {
          this.ref[b] = e.ref;
          const owners = this.owners[b];
          if (owners) {
            owners.delete(e.seq);
            // Owners read from a snapshot are request ids; a request's last sequence leaving
            // takes its id with it.
            if (owners.size > e.ref) owners.delete(requestOf(e.seq));
          }
          break;
        }
        case "free":
          this.ref[b] = 0;
          this.owners[b] = null;
          this.position[b] = null;
          break;
        case "register":
          this.hash[b] = e.hash;
          this.parent[b] = e.parent ?? null;
          this.treeDirty = true;
          break;
        case "cow":
          this.last[e.src] = this.last[e.dst] = { ev: "cow", step: e.step };
          if (live) {
            this.totals.cow += 1;
            this.request(requestOf(e.seq)).cow += 1;
            this.cows.push({ step: e.step, seq: e.seq, src: e.src, dst: e.dst, at: performance.now() });
            if (this.cows.length > 100) this.cows.shift();
            log(e, `copy-on-write: ${e.seq} copies shared block ${e.src} into block ${e.dst}`);
          }
          this.dirtyBlocks.add(e.src);
          this.dirtyBlocks.add(e.dst);
          return;
        case "cache_hit":
          if (live) this.request(requestOf(e.seq)).hits += 1;
          break;
        case "admit": {
          const r = this.request(requestOf(e.seq));
          if (r.status !== "aborted") r.status = "running";
          r.seen = performance.now();
          if (live) log(e, `admit ${e.seq}${e.salt ? ` (tenant ${e.salt})` : ""}`);
          return;
        }
        case "fork":
          if (live) log(e, `fork ${e.parent} → ${e.seq}`);
          return;
        case "preempt": {
          // Its row stays (holding no blocks, it would otherwise expire as finished) until it
          // is re-admitted, and its count goes on from there.
          const r = this.request(requestOf(e.seq));
          r.status = "preempted";
          r.seen = performance.now();
          if (live) {
            this.totals.preemptions += 1;
            r.preempted += 1;
            log(e, `preempt ${e.seq} (its blocks go back; recomputed later)`);
          }
          return;
        }
        case "abort": {
          const r = this.request(requestOf(e.seq));
          r.status = "aborted";
          r.seen = performance.now();
          if (live) log(e, `abort ${e.seq}`);
          return;
        }
        case "audit":
          if (e.ok === false) this.violate(e, log);
          return;
        default:
          return;
      }
      this.last[b] = { ev: e.ev, step: e.step };
      this.settle(b, e.state);
    }

    violate(e, log) {
      const v = { block: e.block ?? null, invariant: e.invariant, step: e.step };
      // The same verdict can arrive twice: from the event stream, then from the stopped
      // engine's snapshot answer on a reconnect.
      if (this.violations.some((w) => w.block === v.block && w.invariant === v.invariant && w.step === v.step)) return;
      this.violations.push(v);
      if (v.block !== null) {
        this.violated.set(v.block, v);
        this.dirtyBlocks.add(v.block);
      }
      log(e, `AUDIT VIOLATION at step ${v.step}: invariant ${v.invariant}` +
        (v.block !== null ? ` on block ${v.block}` : ""));
    }

    applyBatch(batch, live, log) {
      let evictions = 0;
      const quietLog = (e, text) => { if (e.ev !== "evict") log(e, text); };
      for (const e of batch.events) {
        if (e.ev === "evict" && live) evictions += 1;
        this.apply(e, live, quietLog);
      }
      if (evictions) log({ ev: "evict", step: batch.step }, `${evictions} cached block(s) evicted for new allocations`);
      this.totals.events += batch.events.length;
      this.step = Math.max(this.step, batch.step);
    }

    ownerRequests(id) {
      const owners = this.owners[id];
      return owners ? [...new Set([...owners].map(requestOf))].sort() : [];
    }

    block(id) {
      if (!(id >= 0 && id < this.numBlocks)) return null;
      const v = this.violated.get(id);
      return {
        id, state: STATES[this.code[id]], ref_count: this.ref[id], owners: this.ownerRequests(id),
        sequences: this.owners[id] ? [...this.owners[id]].sort() : [], hash: this.hash[id],
        parent: this.parent[id], last_event: this.last[id], position: this.position[id],
        violation: v ? { invariant: v.invariant, step: v.step } : null,
      };
    }
  }

  // ---- the block grid ------------------------------------------------------------------------
  class Grid {
    constructor(canvas, model) {
      this.canvas = canvas;
      this.ctx = canvas.getContext("2d", { alpha: false });
      this.model = model;
      this.flashes = new Map(); // block id -> until (ms)
      this.layout();
    }

    layout() {
      const n = Math.max(1, this.model.numBlocks);
      const width = Math.max(200, Math.floor(this.canvas.parentElement.clientWidth));
      let cell = MAX_CELL_PX;
      // The largest cell that fits every block in the height; a pool too big for that gets
      // several blocks per cell.
      while (cell > MIN_CELL_PX && Math.ceil(n / Math.floor(width / cell)) * cell > GRID_MAX_HEIGHT_PX) cell -= 1;
      const cols = Math.floor(width / cell);
      const maxRows = Math.floor(GRID_MAX_HEIGHT_PX / cell);
      this.perCell = Math.max(1, Math.ceil(n / (cols * maxRows)));
      this.cell = cell;
      this.cols = cols;
      this.numCells = Math.ceil(n / this.perCell);
      this.rows = Math.ceil(this.numCells / cols);
      this.gap = cell >= 7 ? 1 : 0;
      const dpr = window.devicePixelRatio || 1;
      this.dpr = dpr;
      this.canvas.width = Math.round(cols * cell * dpr);
      this.canvas.height = Math.round(this.rows * cell * dpr);
      this.canvas.style.width = `${cols * cell}px`;
      this.canvas.style.height = `${this.rows * cell}px`;
      this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      const note = this.perCell > 1 ? `one cell = ${this.perCell} blocks (filled in proportion to their states)` : "one cell per block";
      $("#grid-note").textContent = `${note}; hover for details`;
      this.drawAll();
    }

    cellOf(block) { return Math.floor(block / this.perCell); }

    // How many of a cell's blocks are in each state (by code), or null when one of them broke an
    // invariant: then the whole cell is the violation's colour, so it cannot be missed.
    statesOf(c) {
      const m = this.model;
      const first = c * this.perCell, end = Math.min(m.numBlocks, first + this.perCell);
      const counts = [0, 0, 0, 0];
      for (let id = first; id < end; id++) {
        if (m.violated.has(id)) return null;
        counts[m.code[id]] += 1;
      }
      return counts;
    }

    // A cell of several blocks is split left to right in proportion to its blocks' states (shared,
    // in use, cached, free), so a half-used cell looks half used; band edges fall on device
    // pixels, so no blended colour appears between them.
    fillCell(c, x, y, side) {
      const ctx = this.ctx, counts = this.statesOf(c);
      if (counts === null) {
        ctx.fillStyle = PALETTE.violation;
        ctx.fillRect(x, y, side, side);
        return;
      }
      const total = counts[0] + counts[1] + counts[2] + counts[3];
      let done = 0, left = 0;
      for (const code of [SHARED, IN_USE, CACHED, FREE]) {
        if (!counts[code]) continue;
        done += counts[code];
        const right = Math.round((done / total) * side * this.dpr) / this.dpr;
        if (right > left) {
          ctx.fillStyle = STATE_COLOUR[code];
          ctx.fillRect(x + left, y, right - left, side);
        }
        left = right;
      }
    }

    drawCell(c, now) {
      const ctx = this.ctx, s = this.cell, g = this.gap;
      const x = (c % this.cols) * s, y = Math.floor(c / this.cols) * s;
      ctx.fillStyle = "#ffffff";
      ctx.fillRect(x, y, s, s);
      this.fillCell(c, x, y, s - g);
      const first = c * this.perCell;
      for (let id = first; id < first + this.perCell; id++) {
        const until = this.flashes.get(id);
        if (until !== undefined && until > now && s >= 6) {
          ctx.strokeStyle = "#111827";
          ctx.lineWidth = 2;
          ctx.strokeRect(x + 1, y + 1, s - g - 2, s - g - 2);
          break;
        }
      }
    }

    drawAll() {
      const now = performance.now();
      this.ctx.fillStyle = "#ffffff";
      this.ctx.fillRect(0, 0, this.cols * this.cell, this.rows * this.cell);
      for (let c = 0; c < this.numCells; c++) this.drawCell(c, now);
    }

    flash(block, now) {
      this.flashes.set(block, now + FLASH_MS);
    }

    // Redraw what changed since the last frame (and flashes that ran out).
    draw(now) {
      const m = this.model;
      if (m.layoutChanged) {
        m.layoutChanged = false;
        m.allDirty = false;
        m.dirtyBlocks.clear();
        this.layout();
        return;
      }
      if (m.allDirty) {
        m.allDirty = false;
        m.dirtyBlocks.clear();
        this.drawAll();
        return;
      }
      const cells = new Set();
      for (const id of m.dirtyBlocks) cells.add(this.cellOf(id));
      m.dirtyBlocks.clear();
      for (const [id, until] of this.flashes) {
        if (until <= now) {
          this.flashes.delete(id);
          cells.add(this.cellOf(id));
        }
      }
      for (const c of cells) this.drawCell(c, now);
    }

    // The cell under a point of the page, or -1.
    cellAt(clientX, clientY) {
      const r = this.canvas.getBoundingClientRect();
      const col = Math.floor((clientX - r.left) / this.cell), row = Math.floor((clientY - r.top) / this.cell);
      if (col < 0 || col >= this.cols || row < 0 || row >= this.rows) return -1;
      const c = row * this.cols + col;
      return c < this.numCells ? c : -1;
    }

    // The middle of a block's cell, in the page's (client) coordinates.
    centre(block) {
      const c = this.cellOf(block), r = this.canvas.getBoundingClientRect();
      const inner = (this.cell - this.gap) / 2;
      return { x: r.left + (c % this.cols) * this.cell + inner, y: r.top + Math.floor(c / this.cols) * this.cell + inner };
    }
  }

  function describeCell(model, grid, c) {
    const first = c * grid.perCell, end = Math.min(model.numBlocks, first + grid.perCell);
    if (end - first === 1) {
      const b = model.block(first);
      const lines = [`block ${b.id} · ${b.state.replace("_", " ")} · ref count ${b.ref_count}`];
      if (b.violation) lines.unshift(`AUDIT VIOLATION: ${b.violation.invariant} (step ${b.violation.step})`);
      lines.push(`owners: ${b.owners.length ? "" : "none"}`);
      for (const o of b.owners.slice(0, TOOLTIP_OWNERS)) lines.push(`  ${o}`);
      if (b.owners.length > TOOLTIP_OWNERS) lines.push(`  and ${b.owners.length - TOOLTIP_OWNERS} more`);
      if (b.sequences.length > b.owners.length) {
        // A request with several sequences (n > 1) holds a block once per sequence.
        lines.push("sequences:");
        for (const q of b.sequences.slice(0, TOOLTIP_OWNERS)) lines.push(`  ${q}`);
      }
      lines.push(`hash: ${b.hash ?? "none (not cached)"}${b.parent ? ` · after ${b.parent}` : ""}`);
      if (b.position !== null) lines.push(`position in its table: ${b.position}`);
      lines.push(`last event: ${b.last_event ? `${b.last_event.ev} at step ${b.last_event.step}` : "none seen"}`);
      return { text: lines.join("\n"), block: b.id };
    }
    const counts = { free: 0, cached: 0, in_use: 0, shared: 0 };
    const owners = new Set();
    const violations = [];
    for (let id = first; id < end; id++) {
      counts[STATES[model.code[id]]] += 1;
      for (const o of model.ownerRequests(id)) owners.add(o);
      const v = model.violated.get(id);
      if (v) violations.push(`AUDIT VIOLATION: ${v.invariant} on block ${id} (step ${v.step})`);
    }
    const lines = [...violations, `blocks ${first}–${end - 1}`,
      STATES.map((s) => `${s.replace("_", " ")} ${counts[s]}`).join(" · ")];
    if (owners.size) lines.push(`owners: ${[...owners].sort().slice(0, 8).join(", ")}${owners.size > 8 ? " …" : ""}`);
    return { text: lines.join("\n"), block: null };
  }

  // ---- small line charts -----------------------------------------------------------------------
  function drawSeries(canvas, values, max) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const top = Math.max(max ?? 0, ...values.filter((v) => v !== null), 1e-9);
    ctx.strokeStyle = "#2563eb";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    values.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      const x = w - (values.length - 1 - i) * (w / (SERIES_POINTS - 1));
      const y = h - 2 - (v / top) * (h - 4);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  }

  // ---- the prefix tree of cached chains ------------------------------------------------------------
  function buildTree(model) {
    const byHash = new Map();
    for (let id = 0; id < model.numBlocks; id++) if (model.hash[id] !== null) byHash.set(model.hash[id], id);
    const children = new Map();
    const roots = [];
    for (const [h, id] of byHash) {
      const p = model.parent[id];
      if (p !== null && byHash.has(p)) {
        if (!children.has(p)) children.set(p, []);
        children.get(p).push(h);
      } else {
        roots.push(h);
      }
    }
    return { byHash, children, roots };
  }

  function drawTree(canvas, model) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const { byHash, children, roots } = buildTree(model);
    const leaves = new Map();
    let depth = 0;
    // Iteratively (chains can be long): leaves per subtree and the deepest level.
    const order = [];
    const stack = roots.map((r) => [r, 0]);
    while (stack.length) {
      const [hsh, d] = stack.pop();
      order.push(hsh);
      depth = Math.max(depth, d + 1);
      for (const c of children.get(hsh) ?? []) stack.push([c, d + 1]);
    }
    for (let i = order.length - 1; i >= 0; i--) {
      const kids = children.get(order[i]) ?? [];
      leaves.set(order[i], kids.length ? kids.reduce((s, k) => s + leaves.get(k), 0) : 1);
    }
    const total = roots.reduce((s, r) => s + leaves.get(r), 0);
    if (!total) {
      ctx.fillStyle = "#6b7280";
      ctx.fillText("no cached chains yet", 8, 16);
      return;
    }
    const colW = Math.max(2, w / depth);
    const place = roots.map((r) => [r, 0, 0]);
    let y0 = 0;
    for (const p of place) { p[2] = y0; y0 += (leaves.get(p[0]) / total) * h; }
    while (place.length) {
      const [hsh, d, y] = place.pop();
      const id = byHash.get(hsh);
      const height = (leaves.get(hsh) / total) * h;
      const x = d * colW;
      if (x < w) {
        ctx.fillStyle = model.violated.has(id) ? PALETTE.violation : STATE_COLOUR[model.code[id]];
        ctx.fillRect(x, y, Math.max(1, colW - (colW > 4 ? 1 : 0)), Math.max(1, height - (height > 4 ? 1 : 0)));
      }
      let yc = y;
      for (const c of children.get(hsh) ?? []) {
        place.push([c, d + 1, yc]);
        yc += (leaves.get(c) / total) * h;
      }
    }
  }

  // Which requests hold which blocks together: one line per set of two or more owners.
  function sharingGroups(model) {
    const groups = new Map();
    for (const id of model.held) {
      if (model.ref[id] < 2) continue;
      const owners = model.ownerRequests(id);
      const key = owners.join(" ");
      if (!groups.has(key)) groups.set(key, { owners, blocks: [] });
      groups.get(key).blocks.push(id);
    }
    return [...groups.values()].sort((a, b) => b.blocks.length - a.blocks.length);
  }

  function blockRanges(ids) {
    ids.sort((a, b) => a - b);
    const out = [];
    for (let i = 0; i < ids.length; i++) {
      let j = i;
      while (j + 1 < ids.length && ids[j + 1] === ids[j] + 1) j++;
      out.push(i === j ? `${ids[i]}` : `${ids[i]}–${ids[j]}`);
      i = j;
    }
    return out.length > 6 ? `${out.slice(0, 6).join(", ")} …` : out.join(", ");
  }

  // ---- metrics ----------------------------------------------------------------------------------
  // The sum of a metric's samples; `tier`: only the samples labelled tier="..." (name then ends
  // inside its labels: "metric{model_name").
  function metricValue(text, name, tier) {
    let sum = null;
    for (const line of text.split("\n")) {
      if (tier !== undefined) {
        if (line.startsWith(name) && line.includes(`tier="${tier}"`)) {
          sum = (sum ?? 0) + Number(line.slice(line.lastIndexOf(" ") + 1));
        }
        continue;
      }
      if (line.startsWith(name) && (line[name.length] === " " || line[name.length] === "{")) {
        sum = (sum ?? 0) + Number(line.slice(line.lastIndexOf(" ") + 1));
      }
    }
    return sum;
  }

  // ---- the page --------------------------------------------------------------------------------
  function httpError(path, status, body) {
    let message = body.slice(0, 200);
    try { message = JSON.parse(body).error.message ?? message; } catch (err) { /* not JSON: as sent */ }
    return new Error(`GET ${path}: HTTP ${status}: ${message}`);
  }

  class Dashboard {
    constructor() {
      this.model = new PoolModel();
      this.grid = null;
      this.paused = false;
      this.pausedBatches = [];
      this.pausedEvents = 0;
      this.resyncOnResume = false;
      this.syncing = false;
      this.held = [];           // batches that arrive while a snapshot is read
      // The step of the snapshot the model was last loaded from: a batch of an earlier step is
      // already in it, one of that same step may be (so neither counts as news).
      this.snapStep = -Infinity;
      this.deadPoolLoaded = false; // whether the stopped engine's pool has been loaded
      this.ready = false;
      this.status = "connecting";
      this.error = null;
      this.logLines = [];
      this.series = { usage: [], hit_rate: [], evictions: [], cow: [], preemptions: [] };
      this.lastTotals = { ...this.model.totals }; // rates count from the page's first event on
      this.prefixWindow = [];   // /metrics prefix cache counters, one reading a second
      this.frameTimes = [];
      this.lastFrame = null;
      this.paints = 0;
      this.tooltipCell = -1;
      this.hover = null;
      this.panelsDue = 0;
      this.treeDue = 0;
      this.renderDue = 0;
    }

    start() {
      $("#pause").addEventListener("click", () => (this.paused ? this.resume() : this.pause()));
      const canvas = $("#grid");
      canvas.addEventListener("mousemove", (ev) => { this.hover = { x: ev.clientX, y: ev.clientY }; this.showTooltip(); });
      canvas.addEventListener("mouseleave", () => { this.hover = null; this.showTooltip(); });
      window.addEventListener("resize", () => { if (this.grid) this.grid.layout(); this.treeDue = 0; });
      requestAnimationFrame((t) => this.frame(t));
      this.connect();
      setInterval(() => this.sample(), 1000);
    }

    setStatus(status, text) {
      this.status = status;
      const el = $("#status");
      el.dataset.status = status;
      el.textContent = text ?? status;
    }

    log(e, text) {
      this.logLines.unshift({ ev: e.ev, step: e.step, text });
      if (this.logLines.length > LOG_LINES) this.logLines.pop();
      this.logDirty = true;
    }

    async getJSON(path) {
      const resp = await fetch(path, { cache: "no-store" });
      const body = await resp.text();
      if (!resp.ok) throw httpError(path, resp.status, body);
      return JSON.parse(body);
    }

    // After the stream failed or ended: whether the engine stopped. A stopped engine's
    // kv/snapshot answer (503, engine_dead) still carries the pool as it stopped and the failed
    // audit's verdict, so a page opened after the stop shows it too. Returns the server's
    // reason, or null when the engine still runs (or the server cannot be asked).
    async engineStopped() {
      // Asked again at every retry: the question is small, the stopped pool is loaded once.
      const probe = await this.deadReply("kv/snapshot?blocks=none");
      if (probe === null) return null;
      if (!this.deadPoolLoaded) {
        const full = await this.deadReply("kv/snapshot");
        if (full?.snapshot) {
          this.loadSnapshot(full.snapshot);
          this.deadPoolLoaded = true;
        }
      }
      const f = probe.audit_failure;
      if (f) this.model.violate({ ev: "audit", ok: false, ...f }, (e, t) => this.log(e, t));
      return probe.error.message;
    }

    // The body of a stopped engine's answer at `path`, or null for any other answer.
    async deadReply(path) {
      try {
        const resp = await fetch(path, { cache: "no-store" });
        const body = JSON.parse(await resp.text());
        return !resp.ok && body?.error?.code === "engine_dead" ? body : null;
      } catch (err) {
        return null; // unreachable, or not JSON: not a stopped engine's answer
      }
    }

    // Stream first, snapshot second: a step between the two is in the stream (and applying it
    // again to a snapshot that already has it changes nothing).
    async connect() {
      for (;;) {
        const stop = new AbortController(); // a failed attempt must not leave its stream open
        this.stopStream = stop;
        try {
          this.syncing = true;
          this.held = [];
          const hello = new Promise((resolve, reject) => {
            this.streaming = this.stream(resolve, stop.signal).then(
              () => reject(new Error("the event stream ended")), reject);
          });
          await hello;
          await this.resync();
          this.deadPoolLoaded = false; // a (restarted) engine runs: a later stop is loaded afresh
          this.setStatus(this.paused ? "paused" : "live", this.paused ? "paused" : "live");
          this.ready = true;
          await this.streaming;
          throw new Error("the event stream ended");
        } catch (err) {
          stop.abort();
          this.ready = false;
          // The stream ends (or is refused) for one reason the page must not hide: the engine
          // stopped. Then the server's own reason is the error, not the stream's end.
          const dead = await this.engineStopped();
          this.error = dead ?? String(err.message ?? err);
          if (dead !== null) {
            const why = this.model.violations.length ? "engine stopped at an audit violation" : "engine stopped";
            this.setStatus("stopped", `${why}: ${this.error}`);
          } else {
            this.setStatus("error", `disconnected: ${this.error}; retrying`);
          }
          await new Promise((r) => setTimeout(r, RECONNECT_MS));
        }
      }
    }

    async stream(onHello, signal) {
      const resp = await fetch("kv/events", { cache: "no-store", signal });
      if (!resp.ok) throw httpError("kv/events", resp.status, await resp.text());
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true });
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          const message = buf.slice(0, end);
          buf = buf.slice(end + 2);
          let event = "message";
          const data = [];
          for (const line of message.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data.push(line.slice(6));
          }
          if (!data.length) continue; // a keepalive comment
          const payload = JSON.parse(data.join("\n"));
          if (event === "hello") onHello(payload);
          else if (event === "step") this.receive(payload);
        }
      }
    }

    loadSnapshot(snap) {
      this.model.load(snap);
      this.snapStep = snap.step;
      // What a pause kept is older than this snapshot: replayed on resume it would undo it.
      this.pausedBatches = [];
      this.pausedEvents = 0;
      this.resyncOnResume = false;
      this.renderPoolSize();
    }

    async resync() {
      // Batches held so far stay: connect() starts holding at the stream's hello, and those that
      // came between it and this call may be newer than the snapshot (older ones are dropped).
      this.syncing = true;
      try {
        this.loadSnapshot(await this.getJSON("kv/snapshot"));
        const held = this.held;
        this.held = [];
        this.syncing = false;
        for (const batch of held) this.receive(batch);
      } finally {
        this.syncing = false;
      }
    }

    receive(batch) {
      if (this.syncing) { this.held.push(batch); return; }
      // Already in the snapshot (an earlier step), or perhaps in it (its own step: applied, as
      // every event sets state absolutely, but not counted or logged again).
      if (batch.step < this.snapStep) return;
      const live = batch.step > this.snapStep;
      if (batch.dropped > 0) {
        // This client fell behind and lost batches: start again from a snapshot.
        if (this.paused) { this.resyncOnResume = true; return; }
        this.resync().catch((err) => this.setStatus("error", String(err)));
        return;
      }
      if (this.paused) {
        if (this.resyncOnResume) return;
        this.pausedBatches.push(batch);
        this.pausedEvents += batch.events.length;
        if (this.pausedEvents > PAUSED_EVENTS_MAX) {
          this.pausedBatches = [];
          this.resyncOnResume = true;
        }
        return;
      }
      this.model.applyBatch(batch, live, (e, text) => this.log(e, text));
      const now = performance.now();
      for (const e of batch.events) if (e.ev === "cow" && live && this.grid) { this.grid.flash(e.src, now); this.grid.flash(e.dst, now); }
    }

    pause() {
      this.paused = true;
      $("#pause").textContent = "Resume";
      $("#pause").setAttribute("aria-pressed", "true");
      this.setStatus("paused", "paused (events are kept, not shown)");
    }

    resume() {
      this.paused = false;
      $("#pause").textContent = "Pause";
      $("#pause").setAttribute("aria-pressed", "false");
      const batches = this.pausedBatches;
      this.pausedBatches = [];
      this.pausedEvents = 0;
      if (this.resyncOnResume) {
        this.resyncOnResume = false;
        this.resync().catch((err) => this.setStatus("error", String(err)));
      } else {
        for (const b of batches) this.receive(b);
      }
      if (this.ready) this.setStatus("live", "live");
    }

    // While paused: apply the kept batches up to engine step `step` (not beyond), and show that
    // state. The page then holds the pool exactly as it was after that step, which a test can
    // compare with a server reading taken at the same step. Returns the step the page is at.
    advanceTo(step) {
      if (!this.paused) throw new Error("advanceTo() is for a paused page");
      let n = 0;
      while (n < this.pausedBatches.length && this.pausedBatches[n].step <= step) n++;
      const batches = this.pausedBatches.splice(0, n);
      for (const b of batches) this.pausedEvents -= b.events.length;
      this.paused = false; // receive() applies instead of keeping
      try {
        for (const b of batches) this.receive(b);
      } finally {
        this.paused = true;
      }
      if (this.grid) { this.grid.draw(performance.now()); this.paints++; }
      this.renderCounts();
      this.renderPanels();
      return this.model.step;
    }

    renderPoolSize() {
      const m = this.model;
      $("#pool-size").textContent = `${m.numBlocks} blocks of ${m.blockSize} tokens`;
      if (!this.grid) this.grid = new Grid($("#grid"), m);
    }

    // One animation frame: redraw what changed. Frame times are kept for the cost benchmark.
    frame(t) {
      if (this.lastFrame !== null) {
        this.frameTimes.push(t - this.lastFrame);
        if (this.frameTimes.length > FRAME_SAMPLES) this.frameTimes.shift();
      }
      this.lastFrame = t;
      if (!this.paused && this.grid && t >= this.renderDue) {
        this.renderDue = t + RENDER_INTERVAL_MS;
        this.grid.draw(t);
        this.paints++;
        this.renderCounts();
        if (t >= this.panelsDue) { this.panelsDue = t + 500; this.renderPanels(); }
        if (t >= this.treeDue && this.model.treeDirty) {
          this.treeDue = t + 1000;
          this.model.treeDirty = false;
          drawTree($("#tree"), this.model);
        }
        if (this.hover) this.showTooltip();
      }
      requestAnimationFrame((t2) => this.frame(t2));
    }

    renderCounts() {
      for (const s of STATES) {
        const el = document.querySelector(`[data-count="${s}"]`);
        const text = String(this.model.counts[s]);
        if (el.textContent !== text) el.textContent = text;
      }
      const step = `step ${this.model.step}`;
      if ($("#step").textContent !== step) $("#step").textContent = step;
      this.renderViolations();
    }

    renderViolations() {
      const vs = this.model.violations;
      const box = $("#violations");
      if (!vs.length || box.childElementCount === vs.length) return;
      box.hidden = false;
      box.replaceChildren(...vs.map((v) => {
        const p = document.createElement("div");
        p.dataset.block = v.block ?? "";
        p.dataset.invariant = v.invariant;
        p.textContent = `Audit violation at step ${v.step}: invariant ${v.invariant}` +
          (v.block !== null ? ` on block ${v.block} (outlined in red in the grid)` : "") + "; the engine stopped.";
        return p;
      }));
    }

    renderPanels() {
      const m = this.model;
      // Requests: blocks held and shared, from the blocks' owners.
      const held = new Map();
      for (const id of m.held) {
        for (const rid of m.ownerRequests(id)) {
          const h = held.get(rid) ?? { blocks: 0, shared: 0 };
          h.blocks += 1;
          if (m.code[id] === SHARED) h.shared += 1;
          held.set(rid, h);
        }
      }
      const now = performance.now();
      for (const [rid, r] of m.requests) {
        if (!held.has(rid) && r.status === "running") { r.status = "finished"; r.seen = now; }
        // Waiting and preempted requests hold nothing yet are not done: they stay listed.
        const pending = r.status === "waiting" || r.status === "preempted";
        if (!held.has(rid) && !pending && now - r.seen > FINISHED_REQUEST_MS) m.requests.delete(rid);
      }
      for (const rid of held.keys()) {
        const r = m.request(rid);
        if (r.status !== "aborted") r.status = "running";
      }
      const rows = [...m.requests.entries()].map(([rid, r]) => ({ rid, r, h: held.get(rid) ?? { blocks: 0, shared: 0 } }))
        .sort((a, b) => b.h.blocks - a.h.blocks || a.rid.localeCompare(b.rid));
      const body = $("#requests tbody");
      body.replaceChildren(...rows.slice(0, REQUEST_ROWS).map(({ rid, r, h }) => {
        const tr = document.createElement("tr");
        tr.dataset.request = rid;
        tr.dataset.status = r.status;
        for (const v of [rid, r.status, h.blocks, h.shared, r.hits, r.cow, r.preempted]) {
          const td = document.createElement("td");
          td.textContent = String(v);
          tr.append(td);
        }
        return tr;
      }));
      $("#requests-more").textContent = rows.length > REQUEST_ROWS ? `and ${rows.length - REQUEST_ROWS} more` : "";

      const list = $("#share-groups");
      const groups = sharingGroups(m);
      list.replaceChildren(...groups.slice(0, 50).map((g) => {
        const li = document.createElement("li");
        li.dataset.owners = g.owners.join(" ");
        li.textContent = `${g.owners.join(" + ")} share ${g.blocks.length} block(s): ${blockRanges(g.blocks)}`;
        return li;
      }));
      if (!groups.length) {
        const li = document.createElement("li");
        li.textContent = "no block is held by two or more requests";
        list.append(li);
      }

      if (this.logDirty) {
        this.logDirty = false;
        $("#log").replaceChildren(...this.logLines.map((l) => {
          const li = document.createElement("li");
          li.dataset.ev = l.ev;
          li.textContent = `step ${l.step}: ${l.text}`;
          return li;
        }));
      }
    }

    showTooltip() {
      const tip = $("#tooltip");
      const c = this.hover && this.grid ? this.grid.cellAt(this.hover.x, this.hover.y) : -1;
      if (c < 0) {
        tip.hidden = true;
        delete tip.dataset.block;
        return;
      }
      const { text, block } = describeCell(this.model, this.grid, c);
      if (tip.textContent !== text) tip.textContent = text;
      if (block !== null) tip.dataset.block = block; else delete tip.dataset.block;
      tip.hidden = false;
      tip.style.left = `${Math.min(this.hover.x + 14, window.innerWidth - tip.offsetWidth - 4)}px`;
      tip.style.top = `${this.hover.y + 14}px`;
    }

    // The KV tiers under the pool (docs/kv_tiers.md): blocks kept / budget per tier, from /metrics;
    // the line stays hidden on a server without tiers (every budget 0).
    showTiers(text) {
      const kept = {}, budget = {};
      for (const tier of ["cpu", "disk"]) {
        kept[tier] = metricValue(text, `kvshare:kv_tier_blocks{model_name`, tier);
        budget[tier] = metricValue(text, `kvshare:kv_tier_capacity_blocks{model_name`, tier);
      }
      const line = document.querySelector("[data-tiers]");
      line.hidden = !(budget.cpu || budget.disk);
      for (const tier of ["cpu", "disk"]) {
        document.querySelector(`[data-tier="${tier}"]`).textContent =
          budget[tier] ? `${kept[tier]} / ${budget[tier]}` : "off";
      }
      this.tiers = { kept, budget };
    }

    // Once a second: the rates, and KV usage and the prefix hit rate (from /metrics).
    async sample() {
      if (this.paused || !this.ready) return;
      const m = this.model;
      const totals = { ...m.totals };
      let hitRate = null;
      try {
        const resp = await fetch("metrics", { cache: "no-store" });
        const text = await resp.text();
        this.showTiers(text);
        const prefix = { hits: metricValue(text, "vllm:prefix_cache_hits_total"),
          queries: metricValue(text, "vllm:prefix_cache_queries_total") };
        // Prompts arrive now and then: the rate over the last few seconds' lookups, not just this one's.
        if (prefix.queries !== null) {
          this.prefixWindow.push(prefix);
          if (this.prefixWindow.length > HIT_RATE_WINDOW + 1) this.prefixWindow.shift();
          const first = this.prefixWindow[0];
          if (prefix.queries > first.queries) hitRate = (prefix.hits - first.hits) / (prefix.queries - first.queries);
        }
      } catch (err) {
        this.prefixWindow = [];
      }
      const last = this.lastTotals;
      this.lastTotals = totals;
      const usage = m.numBlocks ? (m.counts.in_use + m.counts.shared) / m.numBlocks : 0;
      const values = {
        usage, hit_rate: hitRate, evictions: totals.evictions - last.evictions, cow: totals.cow - last.cow,
        preemptions: totals.preemptions - last.preemptions,
      };
      for (const [name, v] of Object.entries(values)) {
        const s = this.series[name];
        s.push(v);
        if (s.length > SERIES_POINTS) s.shift();
        const pct = name === "usage" || name === "hit_rate";
        document.querySelector(`[data-series-value="${name}"]`).textContent =
          v === null ? "–" : pct ? `${(100 * v).toFixed(1)}%` : String(v);
        drawSeries(document.querySelector(`[data-series="${name}"] canvas`), s, pct ? 1 : undefined);
      }
    }
  }

  const dash = new Dashboard();
  // What tests and benchmarks read: the page's own numbers (the canvas shows the same).
  window.kvDashboard = {
    palette: { ...PALETTE },
    get ready() { return dash.ready; },
    get status() { return dash.status; },
    get error() { return dash.error; },
    get paused() { return dash.paused; },
    get step() { return dash.model.step; },
    get tiers() { return dash.tiers; },
    get numBlocks() { return dash.model.numBlocks; },
    get blocksPerCell() { return dash.grid ? dash.grid.perCell : null; },
    // Grid paints so far: a test that saw the model change waits for the next one before reading pixels.
    get paints() { return dash.paints; },
    get cellPixels() { return dash.grid ? dash.grid.cell * dash.grid.dpr : null; }, // a cell's side, in canvas pixels
    get counts() { return { ...dash.model.counts }; },
    get totals() { return { ...dash.model.totals }; },
    get violations() { return dash.model.violations.map((v) => ({ ...v })); },
    get cows() { return dash.model.cows.map(({ at, ...c }) => c); },
    pause() { dash.pause(); },
    resume() { dash.resume(); },
    advanceTo(step) { return dash.advanceTo(step); },
    // Drop the event stream as a network failure would (the page reconnects and resyncs).
    reconnect() { dash.stopStream?.abort(); },
    get keptStep() { const b = dash.pausedBatches; return b.length ? b[b.length - 1].step : null; },
    block(id) { return dash.model.block(id); },
    cellCentre(id) { return dash.grid ? dash.grid.centre(id) : null; },
    sharingGroups() { return sharingGroups(dash.model).map((g) => ({ owners: g.owners, blocks: g.blocks.slice().sort((a, b) => a - b) })); },
    series() { return Object.fromEntries(Object.entries(dash.series).map(([k, v]) => [k, v.slice()])); },
    frameTimes() { return dash.frameTimes.slice(); },
  };
  dash.start();
})();
