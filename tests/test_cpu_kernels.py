"""The C++ paged decode-attention kernel against a float64 dense reference, its isolation (a row
reads only its own blocks), and the engine with the kernel on vs off."""
from __future__ import annotations

import math

import pytest
import torch

from kvshare.model.kernels import build, paged_attention
from helpers import EXACT

# available() never blocks (it starts a background build); these tests need the kernel itself.
paged_attention.wait_until_built()
if not paged_attention.available():
    pytest.skip(f"C++ CPU kernels unavailable: {paged_attention.unavailable_reason()}", allow_module_level=True)

PATHS = paged_attention.cpu_paths()  # every code path this CPU can run, the portable scalar one included
HEADS = [(9, 3), (4, 1), (4, 4), (14, 2)]  # GQA (SmolLM2), MQA, MHA, GQA groups of 7 (Qwen2)
HEAD_IDS = ["gqa9-3", "mqa4-1", "mha4-4", "gqa14-2"]
BF16_RTOL = 2.0 ** -8  # output rounded to bfloat16 (half an ulp is 2^-9 relative), fp32 math inside
F32_TOL = 1e-5


def make_problem(seed: int, n: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, max_ctx: int = 300, spare_blocks: int = 7):
    """Random caches; each row owns distinct, shuffled (non-contiguous) blocks; random lengths."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (n,), generator=g)
    ctx[0] = 1
    if n > 1:
        ctx[1] = max_ctx
    need = [-(-int(c) // block_size) for c in ctx]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + 2  # wider than any row needs
    tables = torch.zeros(n, width, dtype=torch.long)
    used = 0
    for r, k in enumerate(need):
        tables[r, :k] = perm[used:used + k]
        used += k
    kc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, ctx


def reference(q, kc, vc, tables, ctx, block_size, scale):
    """Dense gather of each row's own positions, softmax and weighted sum, all in float64."""
    n, heads, d = q.shape
    group = heads // kc.shape[0]
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    for r in range(n):
        pos = torch.arange(int(ctx[r]))
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        k = kc[:, slots].double().repeat_interleave(group, dim=0)  # [H, L, D]
        v = vc[:, slots].double().repeat_interleave(group, dim=0)
        s = torch.einsum("hd,hld->hl", q[r].double(), k) * scale
        out[r] = torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), v)
    return out


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    if dtype == torch.float32:
        bound = F32_TOL + F32_TOL * ref.abs()
    else:
        bound = 1e-5 + BF16_RTOL * ref.abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max abs error {err.max().item():.3g} exceeds tolerance"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_float64_reference(dtype, block_size, heads, path):
    h, kvh = heads
    q, kc, vc, tables, ctx = make_problem(block_size * 31 + h, 12, h, kvh, 64, block_size, dtype)
    scale = 64 ** -0.5
    out = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, block_size, scale, impl=path)
    assert out.shape == q.shape
    assert_close(out, reference(q, kc, vc, tables, ctx, block_size, scale), dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [3, 8, 20, 48, 100, 128, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_any_head_dim(dtype, head_dim, path):
    """Masked tails, every vector width, and head dims past a vector path (AVX-512: > 128 falls
    back to AVX2 where the CPU has it, else to the scalar path; AVX2 takes any head_dim, a
    partial last chunk of 8 included)."""
    q, kc, vc, tables, ctx = make_problem(head_dim, 6, 6, 2, head_dim, 16, dtype, max_ctx=150)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, scale, impl=path)
    assert_close(out, reference(q, kc, vc, tables, ctx, 16, scale), dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_peaked_scores(dtype, path):
    """Loud queries: scores spread over tens of units, so most probabilities underflow (the vector
    exp must go cleanly to 0) and the running max moves between tiles."""
    q, kc, vc, tables, ctx = make_problem(77, 8, 9, 3, 64, 16, dtype, max_ctx=400)
    q = (q.float() * 6).to(dtype)
    scale = 64 ** -0.5
    out = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, scale, impl=path)
    assert_close(out, reference(q, kc, vc, tables, ctx, 16, scale), dtype)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_paths_listed_and_auto_is_the_best():
    """"avx2" is offered wherever the CPU has AVX2 + FMA + F16C, paths come slowest first, "auto"
    runs the last one (bit for bit), and a path the CPU lacks is refused."""
    flags = _cpu_flags()
    assert PATHS[0] == "scalar"
    assert PATHS == [p for p in ("scalar", "avx2", "avx512", "avx512bf16") if p in PATHS]
    if {"avx2", "fma", "f16c"} <= flags:
        assert "avx2" in PATHS
    elif flags:
        assert "avx2" not in PATHS
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, ctx = make_problem(9, 6, 9, 3, 64, 16, dtype)
        auto = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, 0.125)
        best = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, 0.125, impl=PATHS[-1])
        assert torch.equal(auto, best)
    q, kc, vc, tables, ctx = make_problem(9, 2, 4, 2, 64, 16, torch.float32)
    for name in paged_attention._IMPLS:
        if name != "auto" and name not in PATHS:
            with pytest.raises(ValueError, match="not supported"):
                paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, 0.125, impl=name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_read_only_their_own_blocks(dtype, block_size, head_dim, path):
    """Poison every slot no row may read (other blocks, the unused tail of each row's last block)
    and fill table entries past each row's last needed block with garbage ids: the output must
    not change by a single bit. head_dim 20: vector tails must not read past a slot's row."""
    q, kc, vc, tables, ctx = make_problem(block_size + 5, 10, 9, 3, head_dim, block_size, dtype)
    scale = 0.125
    clean = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, block_size, scale, impl=path)
    allowed = torch.zeros(kc.shape[1], dtype=torch.bool)
    for r in range(len(ctx)):
        pos = torch.arange(int(ctx[r]))
        allowed[tables[r, pos // block_size] * block_size + pos % block_size] = True
    assert not allowed.all()
    kp, vp = kc.clone(), vc.clone()
    kp[:, ~allowed] = float("nan")
    vp[:, ~allowed] = float("nan")
    kp[0, ~allowed] = 1e30  # huge, for the first kv head
    vp[0, ~allowed] = -1e30
    tp = tables.clone()
    for r in range(len(ctx)):
        used = -(-int(ctx[r]) // block_size)
        tp[r, used:] = torch.tensor([-1, 10**9])[torch.arange(tp.shape[1] - used) % 2]
    poisoned = paged_attention.paged_decode_attention(q, kp, vp, tp, ctx, block_size, scale, impl=path)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


def _visible_ranges(ctx, kind: str, block_size: int):
    """Per-row (sink_end, window_start) as the bounded-KV policies give them."""
    n = len(ctx)
    if kind == "window":  # sliding window of 37 positions
        return torch.zeros(n, dtype=torch.long), torch.clamp(ctx - 37, min=0)
    sinks = torch.full((n,), 4)  # 4 sinks, then whole recent blocks reaching 40 positions back
    return sinks, torch.clamp((ctx - 40) // block_size, min=0) * block_size


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["window", "sinks"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_visible_ranges_match_the_reference_and_read_nothing_else(dtype, block_size, kind, path):
    """A row given (sink_end, window_start) attends to [0, sink_end) and [window_start, ctx)
    exactly (float64 reference over those positions), never reads a slot outside them (they are
    poisoned), and never reads the table entries of blocks wholly between them (garbage ids)."""
    q, kc, vc, tables, ctx = make_problem(block_size + 11, 9, 9, 3, 64, block_size, dtype)
    sink_end, win_start = _visible_ranges(ctx, kind, block_size)
    scale = 0.125
    allowed = torch.zeros(kc.shape[1], dtype=torch.bool)
    ref = torch.zeros(q.shape, dtype=torch.float64)
    tp = tables.clone()
    for r in range(len(ctx)):
        c, s, w = int(ctx[r]), min(int(sink_end[r]), int(ctx[r])), int(win_start[r])
        pos = torch.arange(c)
        pos = pos[(pos < s) | (pos >= w)] if w > s else pos
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        allowed[slots] = True
        one = reference(q[r:r + 1], kc[:, slots], vc[:, slots], torch.arange(len(pos)).unsqueeze(0),
                        torch.tensor([len(pos)]), 1, scale)
        ref[r] = one[0]
        if w > s:
            tp[r, -(-s // block_size):w // block_size] = -1  # blocks no visible position lives in
    kp, vp = kc.clone(), vc.clone()
    kp[:, ~allowed] = float("nan")
    vp[:, ~allowed] = float("nan")
    out = paged_attention.paged_decode_attention(q, kp, vp, tp, ctx, block_size, scale, impl=path,
                                             sink_end=sink_end, window_start=win_start)
    assert_close(out, ref, dtype)
    assert (win_start > sink_end).any() and (ctx > win_start).all()  # the ranges really cut something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int32_tables_out_param_strided_q_and_threads(dtype):
    q, kc, vc, tables, ctx = make_problem(3, 16, 9, 3, 64, 16, dtype)
    ref = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, 0.125)
    assert torch.equal(paged_attention.paged_decode_attention(q, kc, vc, tables.int(), ctx.int(), 16, 0.125), ref)
    # q as the model produces it: a view into a packed qkv tensor (row stride > H * D).
    packed = torch.randn(16, 9 * 64 + 2 * 3 * 64).to(dtype)
    packed[:, :9 * 64] = q.reshape(16, -1)
    qv = packed[:, :9 * 64].view(16, 9, 64)
    assert not qv.is_contiguous()
    out = torch.full_like(q, float("nan"))
    res = paged_attention.paged_decode_attention(qv, kc, vc, tables, ctx, 16, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, ref)
    # Each (row, kv head) is computed whole by one thread: results do not depend on threading.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = paged_attention.paged_decode_attention(q, kc, vc, tables, ctx, 16, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, ref)


def test_mixed_dtypes_and_edge_sizes():
    q, kc, vc, tables, ctx = make_problem(11, 5, 4, 2, 64, 16, torch.bfloat16)
    ref = reference(q.float(), kc, vc, tables, ctx, 16, 0.125)
    out = paged_attention.paged_decode_attention(q.float(), kc, vc, tables, ctx, 16, 0.125)  # fp32 q, bf16 cache
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5
    out = paged_attention.paged_decode_attention(q, kc.float(), vc.float(), tables, ctx, 16, 0.125)  # bf16 q
    assert out.dtype == torch.bfloat16
    assert_close(out, reference(q, kc.float(), vc.float(), tables, ctx, 16, 0.125), torch.bfloat16)
    empty = paged_attention.paged_decode_attention(q[:0], kc, vc, tables[:0], ctx[:0], 16, 0.125)
    assert empty.shape == (0, 4, 64)
    zero_ctx = ctx.clone()
    zero_ctx[2] = 0
    out = paged_attention.paged_decode_attention(q, kc, vc, tables, zero_ctx, 16, 0.125)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_rejects_bad_tables():
    q, kc, vc, tables, ctx = make_problem(5, 4, 9, 3, 64, 16, torch.float32)
    bad = tables.clone()
    bad[1, 0] = kc.shape[1] // 16  # one past the last block
    with pytest.raises(ValueError, match="out of range"):
        paged_attention.paged_decode_attention(q, kc, vc, bad, ctx, 16, 0.125)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="out of range"):
        paged_attention.paged_decode_attention(q, kc, vc, bad, ctx, 16, 0.125)
    long_ctx = ctx.clone()
    long_ctx[0] = tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="context length"):
        paged_attention.paged_decode_attention(q, kc, vc, tables, long_ctx, 16, 0.125)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention.paged_decode_attention(q[:, :8], kc, vc, tables, ctx, 16, 0.125)


def test_backend_matches_pure_pytorch_path():
    """TorchPagedAttention with the kernel vs without, on a packed batch of decode rows (as the
    runner builds it) plus one prefill chunk."""
    from kvshare.engine.model_runner import _NEG_INF, group_by_length
    from kvshare.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, TorchPagedAttention

    bs, h, kvh, d = 16, 9, 3, 64
    q_dec, kc, vc, tables, ctx = make_problem(21, 9, h, kvh, d, bs, torch.float32)
    order = torch.argsort(ctx)
    tables, ctx, q_dec = tables[order], ctx[order], q_dec[order]
    g = torch.Generator().manual_seed(1)
    pre_len = 5
    q = torch.cat([q_dec, torch.randn(pre_len, h, d, generator=g)])
    k_new = torch.randn(len(q), kvh, d, generator=g)
    v_new = torch.randn(len(q), kvh, d, generator=g)
    # Decode row r writes its new token at position ctx - 1; the prefill chunk gets a fresh block.
    kc = torch.cat([kc, torch.zeros(kvh, bs, d)], dim=1)
    vc = torch.cat([vc, torch.zeros(kvh, bs, d)], dim=1)
    pre_block = kc.shape[1] // bs - 1
    dec_slots = [int(tables[r, (int(ctx[r]) - 1) // bs]) * bs + (int(ctx[r]) - 1) % bs for r in range(len(ctx))]
    slots = torch.tensor(dec_slots + [pre_block * bs + i for i in range(pre_len)])

    def meta(backend):
        m = AttentionMetadata(slot_mapping=slots, num_decode=len(ctx))
        m.decode_block_tables, m.decode_context_lens = tables, ctx
        if backend.wants_decode_groups:
            for r0, r1 in group_by_length(ctx.tolist(), bs):
                w = -(-int(ctx[r1 - 1]) // bs)
                bias = torch.zeros(r1 - r0, w * bs)
                bias.masked_fill_(torch.arange(w * bs).unsqueeze(0) >= ctx[r0:r1].unsqueeze(1), _NEG_INF)
                m.decode_groups.append(DecodeGroup(r0, r1 - r0, tables[r0:r1, :w].clone(), bias.view(1, r1 - r0, 1, w * bs)))
        mask = torch.arange(bs).unsqueeze(0) <= torch.arange(pre_len).unsqueeze(1)
        m.prefills.append(PrefillChunk(len(ctx), pre_len, torch.tensor([pre_block]), mask))
        return m

    fast = TorchPagedAttention(bs)
    slow = TorchPagedAttention(bs, use_cpp_kernel=False)
    assert fast.use_cpp_kernel and not fast.wants_decode_groups
    assert not slow.use_cpp_kernel and slow.wants_decode_groups
    kc2, vc2 = kc.clone(), vc.clone()
    with torch.inference_mode():
        a = fast.forward(q, k_new, v_new, kc, vc, meta(fast), 0.125)
        b = slow.forward(q, k_new, v_new, kc2, vc2, meta(slow), 0.125)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert (a - b).abs().max().item() < 1e-5


def _causal_problem(seed, t, h, kvh, d):
    """q, k, v as views of one fused projection (position stride (h + 2 kvh) d, as the model's)."""
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=torch.Generator().manual_seed(seed))
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    return q, k, v


def _causal_reference(q, k, v, scale):
    import torch.nn.functional as F

    o = F.scaled_dot_product_attention(*(x.double().transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


needs_avx512 = pytest.mark.skipif("avx512" not in PATHS, reason="the causal prefill kernel needs AVX-512")


@needs_avx512
@pytest.mark.parametrize("t", [1, 5, 16, 17, 63, 64, 65, 100, 257])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 128), (8, 8, 64), (2, 1, 256)])
def test_causal_prefill_matches_float64_reference(t, heads, kv_heads, head_dim):
    """Every position attends to itself and the keys before it, for any chunk length (partial
    query blocks of 16, key tiles of 64), GQA / MQA / MHA, head_dim 64-256. float32 math: torch's
    own float32 SDPA is within ~1e-6 of float64 here (values ~N(0, 1)); F32_TOL leaves 10x."""
    q, k, v = _causal_problem(t + heads + head_dim, t, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    y = paged_attention.causal_prefill_attention(q, k, v, scale)
    assert (y.double() - _causal_reference(q, k, v, scale)).abs().max().item() < F32_TOL


@needs_avx512
def test_causal_prefill_is_causal_out_param_and_thread_invariant():
    q, k, v = _causal_problem(4, 150, 9, 3, 64)
    full = paged_attention.causal_prefill_attention(q, k, v, 0.125)
    # Later keys and values never reach earlier positions (bit for bit).
    k2, v2 = k.clone(), v.clone()
    k2[100:] = 1e3
    v2[100:] = -1e3
    assert torch.equal(paged_attention.causal_prefill_attention(q, k2, v2, 0.125)[:100], full[:100])
    # Into a strided view of a wider buffer; each output computed by one task: no thread dependence.
    buf = torch.full((150, 9 * 64 + 32), float("nan"))
    out = buf[:, :9 * 64].view(150, 9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        paged_attention.causal_prefill_attention(q, k, v, 0.125, out=out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, full) and torch.isnan(buf[:, 9 * 64:]).all()


@needs_avx512
def test_causal_prefill_rejects_what_it_cannot_run():
    q, k, v = _causal_problem(1, 8, 9, 3, 64)
    with pytest.raises(ValueError, match="float32"):
        paged_attention.causal_prefill_attention(q.bfloat16(), k, v, 0.125)
    with pytest.raises(ValueError, match="D % 64"):
        paged_attention.causal_prefill_attention(*(x[..., :32].contiguous() for x in (q, k, v)), 0.125)
    with pytest.raises(ValueError, match="must be \\[T, KVH, D\\]"):
        paged_attention.causal_prefill_attention(q, k[:4], v[:4], 0.125)
    with pytest.raises(ValueError, match="contiguous heads"):
        paged_attention.causal_prefill_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 0.125)
    assert not paged_attention.causal_prefill_fits(q.bfloat16(), k.bfloat16())
    assert paged_attention.causal_prefill_fits(q, k)


def test_env_var_disables(monkeypatch):
    from kvshare.model.attention import TorchPagedAttention

    monkeypatch.setenv(build.DISABLE_ENV, "1")
    assert not paged_attention.available()
    assert "KVSHARE_DISABLE_CPP_KERNELS" in paged_attention.unavailable_reason()
    assert not TorchPagedAttention(16).use_cpp_kernel
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    assert paged_attention.available()


PROMPTS = [
    "The quick brown fox",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little.",
    "1, 2, 3, 4,",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of "
    "worms and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat: "
    "it was a hobbit-hole, and that means comfort.",
]


def _generate(block_size: int):
    from kvshare import LLM, SamplingParams

    llm = LLM(**EXACT, kv_cache_memory="64MiB", block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return llm.engine.model.backend.use_cpp_kernel, res


@pytest.mark.parametrize("block_size", [16, 1])
def test_engine_kernel_on_equals_off(monkeypatch, block_size):
    causal_calls = []
    real = paged_attention.causal_prefill_attention
    monkeypatch.setattr(paged_attention, "causal_prefill_attention",
                        lambda *a, **k: causal_calls.append(1) or real(*a, **k))
    used_on, on = _generate(block_size)
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    used_off, off = _generate(block_size)
    assert used_on and not used_off
    assert bool(causal_calls) == ("avx512" in PATHS)  # the prompts' first chunks, on the kernel
    for (ta, la), (tb, lb) in zip(on, off):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-4


def test_build_lives_outside_the_source_tree():
    import os

    import kvshare

    lib_path = os.path.realpath(paged_attention._lib()._name)
    repo = os.path.realpath(os.path.dirname(os.path.dirname(kvshare.__file__)))
    assert os.path.isfile(lib_path)
    assert not lib_path.startswith(repo + os.sep)
    assert os.path.dirname(lib_path) == os.path.realpath(build.cache_dir())


def _run_python(code: str, **env_overrides):
    import os
    import subprocess
    import sys

    env = dict(os.environ, **env_overrides)
    env.pop(build.DISABLE_ENV, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


_FALLBACK_CHECK = (
    "import logging\n"
    "records = []\n"
    "h = logging.Handler(); h.emit = records.append\n"
    "logging.getLogger('kvshare').addHandler(h); logging.getLogger('kvshare').setLevel(logging.DEBUG)\n"
    "from kvshare.model.kernels import paged_attention\n"
    "from kvshare.model.attention import TorchPagedAttention\n"
    "assert paged_attention.available() is False and paged_attention.available() is False\n"
    "assert not TorchPagedAttention(16).use_cpp_kernel\n"
    "assert paged_attention.wait_until_built() is False and paged_attention.available() is False\n"
    "mine = [r for r in records if 'unavailable' in r.getMessage()]\n"
    "assert len(mine) == 1 and mine[0].levelno == logging.INFO, [r.getMessage() for r in records]\n"
    "print('REASON', paged_attention.unavailable_reason().splitlines()[0])\n"
)


def test_failed_build_falls_back_quietly(tmp_path):
    """No working compiler: available() is False (logged once at INFO), nothing raises, and the
    attention backend takes the pure-PyTorch path."""
    res = _run_python(_FALLBACK_CHECK, CXX=str(tmp_path / "no-such-compiler"),
                      KVSHARE_CACHE_DIR=str(tmp_path / "kernels"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REASON RuntimeError: no C++ compiler found" in res.stdout


def test_failed_compile_in_background_falls_back_quietly(tmp_path):
    """A compiler that runs but fails to compile: the failure happens in the background build,
    available() stays False, logged once at INFO, and the reason names the source."""
    fake = tmp_path / "bad-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'bad-cxx 1.0'; exit 0; fi\n"
                    "echo 'paged_attention.cpp:1:1: error: this compiler is broken' >&2; exit 1\n")
    fake.chmod(0o755)
    res = _run_python(_FALLBACK_CHECK, CXX=str(fake), KVSHARE_CACHE_DIR=str(tmp_path / "kernels"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REASON RuntimeError: compiling paged_attention.cpp failed (exit 1)" in res.stdout
    assert list((tmp_path / "kernels").iterdir()) == []  # the temp build dir is gone, no partial .so


def test_cached_build_loads_without_waiting():
    """A process that finds the build in the cache (this one's, same environment) has the kernel
    on its first available() call, without compiling, in well under a second."""
    code = (
        "import time\n"
        "from kvshare.model.kernels import paged_attention\n"
        "t = time.perf_counter(); ok = paged_attention.available(); dt = time.perf_counter() - t\n"
        "assert ok, paged_attention.unavailable_reason()\n"
        "assert paged_attention.ATTENTION.from_cache() is True\n"
        "print('SECONDS', dt)\n"
    )
    res = _run_python(code)
    assert res.returncode == 0, res.stderr[-2000:]
    seconds = float(res.stdout.split("SECONDS")[1])
    assert seconds < 1.0, seconds  # typically a few ms: `c++ --version` plus dlopen
