"""The paged decode-attention kernel handed the rows of prompt chunks (token rows: a chunk of T
tokens is T rows sharing one block table, context lengths start+1 .. start+T): every row's output
must be bitwise what the same row gives alone (n = 1), whatever its neighbours. The kernel gives
runs of such rows one task that walks their keys once (csrc/paged_attention.cpp, block_avx512);
these tests fail if any row's arithmetic depends on the other rows of its block."""
from __future__ import annotations

import pytest
import torch

from kvshare.model.kernels import paged_attention

paged_attention.wait_until_built()
if not paged_attention.available():
    pytest.skip(f"C++ CPU kernels unavailable: {paged_attention.unavailable_reason()}", allow_module_level=True)

PATHS = paged_attention.cpu_paths()
BS = 16


def chunk_rows(g, kv_heads, head_dim, cache_dtype, q_dtype, heads, windowed):
    """Several sequences' chunks as token rows: (start, T) per sequence, some from 0, some after a
    cached prefix; one sequence shares the first blocks of another (a prefix-cache hit); a decode
    row of its own; on `windowed`, sliding-window and sink ranges on some sequences' rows."""
    chunks = [(0, 7), (0, 300), (45, 17), (130, 64), (0, 1), (16, 16), (3000, 1), (64, 64), (200, 7)]
    need = [-(-(s + t) // BS) for s, t in chunks]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + 1
    tables, ctx, sink, win, used = [], [], [], [], 0
    first_table = None
    for c, ((start, t), k) in enumerate(zip(chunks, need)):
        row = torch.zeros(width, dtype=torch.long)
        row[:k] = perm[used:used + k]
        used += k
        if c == 0:
            first_table = row.clone()
        if c == 7:  # shares its first (cached) blocks with chunk 0's sequence
            row[:1] = first_table[:1]
        for p in range(start, start + t):
            tables.append(row)
            ctx.append(p + 1)
            if windowed and c in (1, 3):  # a 100-token sliding window
                sink.append(0); win.append(p + 1 - 100)
            elif windowed and c == 8:  # 4 sinks, then a 64-token window
                sink.append(4); win.append(p + 1 - 64)
            elif windowed and c == 2:  # a window wider than the context: every position visible
                sink.append(0); win.append(p + 1 - 5000)
            else:
                sink.append(0); win.append(0)
    n = len(ctx)
    slots = num_blocks * BS
    if cache_dtype in (torch.int8, torch.float8_e4m3fn):
        raw = torch.randn(2, kv_heads, slots, head_dim, generator=g) * 40
        kc, vc = (raw.clamp(-127, 127).round().to(torch.int8) if cache_dtype == torch.int8 else raw.to(cache_dtype))
        scales = (torch.rand(2, kv_heads, slots, generator=g) * 0.05 + 0.001)
        ks, vs = scales[0], scales[1]
    else:
        kc = torch.randn(kv_heads, slots, head_dim, generator=g).to(cache_dtype)
        vc = torch.randn(kv_heads, slots, head_dim, generator=g).to(cache_dtype)
        ks = vs = None
    q = (torch.randn(n, heads, head_dim, generator=g) * 2).to(q_dtype)
    ranges = (torch.tensor(sink), torch.tensor(win)) if windowed else (None, None)
    return q, kc, vc, ks, vs, torch.stack(tables), torch.tensor(ctx), ranges


CASES = [  # (heads, kv_heads, head_dim, cache dtype, q dtype, windowed)
    (9, 3, 64, torch.bfloat16, torch.float32, False),
    (9, 3, 64, torch.bfloat16, torch.float32, True),
    (9, 3, 64, torch.bfloat16, torch.bfloat16, True),
    (8, 2, 128, torch.float32, torch.float32, True),
    (4, 1, 40, torch.float32, torch.bfloat16, False),
    (6, 3, 24, torch.float16, torch.float32, True),
    (4, 2, 64, torch.int8, torch.float32, True),
    (4, 2, 64, torch.float8_e4m3fn, torch.bfloat16, False),
    (4, 4, 80, torch.bfloat16, torch.bfloat16, False),
    (4, 1, 256, torch.bfloat16, torch.float32, False),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-{str(c[3])[6:]}-q{str(c[4])[6:]}"
                         + ("-win" if c[5] else ""))
def test_chunk_rows_match_rows_alone(case, path):
    heads, kv_heads, head_dim, cache_dtype, q_dtype, windowed = case
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    q, kc, vc, ks, vs, tables, ctx, (sink, win) = chunk_rows(g, kv_heads, head_dim, cache_dtype, q_dtype,
                                                            heads, windowed)
    kw = dict(impl=path, k_scale=ks, v_scale=vs)
    many = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, BS, 0.17, sink_end=sink,
                                                  window_start=win, **kw)
    assert torch.isfinite(many.float()).all()
    bad = []
    for r in range(q.shape[0]):
        rng = {} if sink is None else dict(sink_end=sink[r:r + 1], window_start=win[r:r + 1])
        alone = paged_attention.paged_decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1], ctx[r:r + 1], BS,
                                                       0.17, **rng, **kw)
        if not torch.equal(alone[0], many[r]):
            bad.append(r)
    assert not bad, f"{len(bad)} of {q.shape[0]} rows differ from the row alone, first {bad[:8]}"


@pytest.mark.parametrize("path", PATHS)
def test_rows_alone_and_chunk_order(path):
    """A chunk's rows in reverse order, or interleaved with another sequence's rows (no runs to
    share), give the same bits as in order."""
    g = torch.Generator().manual_seed(7)
    q, kc, vc, ks, vs, tables, ctx, _ = chunk_rows(g, 3, 64, torch.bfloat16, torch.float32, 9, False)
    ref = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, BS, 0.125, impl=path)
    for perm in (torch.arange(q.shape[0] - 1, -1, -1), torch.randperm(q.shape[0], generator=g)):
        out = paged_attention.paged_decode_attention(q[perm].contiguous(), kc, vc, tables[perm].contiguous(),
                                                     ctx[perm].contiguous(), BS, 0.125, impl=path)
        assert torch.equal(out, ref[perm])


def test_one_more_key_changes_the_row():
    """The comparison above is not vacuous: one more visible key changes a row's bits."""
    g = torch.Generator().manual_seed(3)
    q, kc, vc, ks, vs, tables, ctx, _ = chunk_rows(g, 3, 64, torch.bfloat16, torch.float32, 9, False)
    r = 20  # row of chunk (0, 300) at position 12
    a = paged_attention.paged_decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1], ctx[r:r + 1], BS, 0.125)
    b = paged_attention.paged_decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1], ctx[r:r + 1] + 1, BS, 0.125)
    assert not torch.equal(a, b)
