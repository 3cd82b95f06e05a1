"""KV cache quantization (kv_cache_dtype int8 / fp8_e4m3, one float32 scale per token per head):
round-trip error bounds, the C++ kernel on quantized caches, greedy agreement of the bundled model
with the unquantized cache, prefix caching and copy-on-write, and the bytes `kvshare info` reports.

Agreement (kvshare.bench.agreement: free-running and teacher-forced token agreement, mean
|logprob delta|) on 16 prompts of real English text, 20-80 tokens, 32 greedy tokens each, the
model in float32 so the reference cache is exact. The figures are printed (-s shows them).
"""
from __future__ import annotations

import gc
import json

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.bench import agreement as agreement_metrics
from kvshare.bench.workloads import token_prompts
from kvshare.config import EngineConfig
from kvshare.memory_plan import kv_pool_blocks
from kvshare.model import kv_quant
from kvshare.model.kernels import paged_attention
from kvshare.model.kv_quant import QuantizedKV
from helpers import EXACT

QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
NUM_TOKENS = 32


# ---- quantize / dequantize --------------------------------------------------------------------
def _activations(seed: int) -> torch.Tensor:
    """K-like vectors: a few loud channels over many quiet ones, some all-zero rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=g)
    x[..., :4] *= 20
    x[5] = 0
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_dequantize_error_is_bounded(name):
    dtype = QUANTIZED[name]
    x = _activations(1)
    q, scale = kv_quant.quantize(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape and scale.shape == x.shape[:-1]
    assert scale.dtype == torch.float32
    back = kv_quant.dequantize(q, scale, torch.float32)
    err = (back - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        # Uniform steps of amax / 127: at most half a step (float32 rounding of the division aside).
        bound = amax / 127 * (0.5 + 1e-5)
    else:
        # e4m3 has 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 (subnormal) the step is
        # 2^-9 of the scale, and amax maps to 448.
        bound = torch.maximum(x.abs() * 2.0 ** -4, amax / 448 * 2.0 ** -10) * (1 + 1e-5)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert (back[5] == 0).all() and (scale[5] == 1).all()  # zero vectors stay exact
    # The loudest element sits on the grid's end: exact but for float32 rounding of x / s * s.
    torch.testing.assert_close(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6, atol=0)


def test_cache_write_and_gather_dequantize():
    x = _activations(2)[:48]  # 48 tokens, 3 heads, 64 dims
    bs = 16
    cache = QuantizedKV(torch.zeros(3, 8 * bs, 64, dtype=torch.int8), torch.zeros(3, 8 * bs))
    table = torch.tensor([5, 1, 6])  # non-contiguous blocks
    slots = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in table.tolist()])
    kv_quant.write(cache, slots, x)
    got = kv_quant.gather_blocks(cache, table, bs, torch.float32)  # [3, 48, 64]
    q, s = kv_quant.quantize(x, torch.int8)
    assert torch.equal(got, kv_quant.dequantize(q, s, torch.float32).transpose(0, 1))
    untouched = torch.ones(8 * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (cache.data[:, untouched] == 0).all() and (cache.scale[:, untouched] == 0).all()


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is invalid"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(dtype="bfloat16").kv_format.name == "bfloat16"  # auto = the model dtype
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_format.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * (64 + 4)


def test_auto_kv_cache_is_bfloat16_where_prefill_gemms_are():
    """The default mode on avx512_bf16 CPUs (float32 activations, bfloat16 prefill GEMMs) stores K/V
    in bfloat16; the exact mode and every explicit choice keep theirs."""
    assert EngineConfig(prefill_dtype="bfloat16").kv_format.name == "bfloat16"
    assert EngineConfig(prefill_dtype="float32").kv_format.name == "float32"
    assert EngineConfig(dtype="float32", quantization=None).kv_format.name == "float32"  # the exact mode
    assert EngineConfig(prefill_dtype="bfloat16", kv_cache_dtype="float32").kv_format.name == "float32"
    default = EngineConfig()
    assert default.kv_format.name == ("bfloat16" if default.prefill_dtype == "bfloat16" else "float32")
    # Sinks re-rotate kept keys in place at every eviction: rounding them each time would add up.
    sinks = EngineConfig(prefill_dtype="bfloat16", kv_policy="sink", window_tokens=64)
    assert sinks.kv_format.name == "float32"
    # Nothing kept quantized (an HF checkpoint, an F32 GGUF): no bfloat16 GEMM anywhere, a float32 cache.
    dense = EngineConfig(prefill_dtype="bfloat16")
    dense.settle_for_weights(kept_quantized=False)
    assert dense.prefill_dtype == "float32" and dense.kv_format.name == "float32"


def test_a_model_with_nothing_kept_quantized_keeps_a_float32_cache(tmp_path):
    from test_loader import tiny_llama, write_tiny_gguf

    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, tiny_llama(), "llama")  # every tensor F32
    llm = LLM(str(path), kv_cache_memory="4MiB", prefill_dtype="bfloat16")
    assert all(lin.kind == "dense" for lin in llm.engine.model.linears())
    assert llm.engine.kv_cache.data.dtype == torch.float32 and llm.config.prefill_dtype == "float32"


# ---- the C++ decode kernel on quantized and float16 caches --------------------------------------
@pytest.mark.skipif(not paged_attention.wait_until_built(), reason="C++ CPU kernels unavailable")
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float16],
                         ids=["int8", "fp8", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 160])
def test_kernel_on_quantized_caches(cache_dtype, head_dim):
    from test_cpu_kernels import make_problem, reference

    for path in paged_attention.cpu_paths():
        q, kc, vc, tables, ctx = make_problem(7 + head_dim, 10, 9, 3, head_dim, 16, torch.float32)
        kc[..., :3] *= 10  # loud channels, as real keys have
        if kv_quant.is_quantized_dtype(cache_dtype):
            kq, ks = kv_quant.quantize(kc, cache_dtype)
            vq, vs = kv_quant.quantize(vc, cache_dtype)
            kd, vd = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
            extra = {"k_scale": ks, "v_scale": vs}
        else:
            kq, vq = kc.to(cache_dtype), vc.to(cache_dtype)
            kd, vd, extra = kq.double(), vq.double(), {}
        scale = head_dim ** -0.5
        ref = reference(q.double(), kd, vd, tables, ctx, 16, scale)  # exact math on the stored values
        out = paged_attention.paged_decode_attention(q, kq, vq, tables, ctx, 16, scale, impl=path, **extra)
        err = (out.double() - ref).abs()
        assert (err <= 1e-5 + 1e-5 * ref.abs()).all(), f"{path}: max error {err.max().item():.3g}"
        for qb in (torch.bfloat16,):  # bf16 queries: output rounded to bf16
            out = paged_attention.paged_decode_attention(q.to(qb), kq, vq, tables, ctx, 16, scale, impl=path, **extra)
            ref_b = reference(q.to(qb).double(), kd, vd, tables, ctx, 16, scale)
            assert ((out.double() - ref_b).abs() <= 1e-5 + 2.0 ** -8 * ref_b.abs()).all()
    if extra:
        with pytest.raises(ValueError, match="k_scale"):
            paged_attention.paged_decode_attention(q, kq, vq, tables, ctx, 16, scale)


@pytest.mark.skipif(not paged_attention.wait_until_built(), reason="C++ CPU kernels unavailable")
@pytest.mark.parametrize("name", QUANTIZED)
def test_backend_kernel_and_pure_pytorch_paths_agree(name):
    """Decode rows (kernel vs padded torch groups) and a prefill chunk over one quantized cache:
    both paths write the same bytes and scales and read them back alike."""
    from test_cpu_kernels import make_problem

    from kvshare.engine.model_runner import _NEG_INF, group_by_length
    from kvshare.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, TorchPagedAttention

    dtype, bs, h, kvh, d = QUANTIZED[name], 16, 9, 3, 64
    q_dec, kc, vc, tables, ctx = make_problem(5, 7, h, kvh, d, bs, torch.float32)
    order = torch.argsort(ctx)
    tables, ctx, q_dec = tables[order], ctx[order], q_dec[order]
    g = torch.Generator().manual_seed(2)
    pre_len = 6
    q = torch.cat([q_dec, torch.randn(pre_len, h, d, generator=g)])
    k_new, v_new = torch.randn(len(q), kvh, d, generator=g), torch.randn(len(q), kvh, d, generator=g)
    pre_block = kc.shape[1] // bs
    kq, ks = kv_quant.quantize(torch.cat([kc, torch.zeros(kvh, bs, d)], dim=1), dtype)
    vq, vs = kv_quant.quantize(torch.cat([vc, torch.zeros(kvh, bs, d)], dim=1), dtype)
    dec_slots = [int(tables[r, (int(c) - 1) // bs]) * bs + (int(c) - 1) % bs for r, c in enumerate(ctx)]
    slots = torch.tensor(dec_slots + [pre_block * bs + i for i in range(pre_len)])

    def meta(backend):
        m = AttentionMetadata(slot_mapping=slots, num_decode=len(ctx))
        m.decode_block_tables, m.decode_context_lens = tables, ctx
        if backend.wants_decode_groups:
            for r0, r1 in group_by_length(ctx.tolist(), bs):
                w = -(-int(ctx[r1 - 1]) // bs)
                bias = torch.zeros(r1 - r0, w * bs)
                bias.masked_fill_(torch.arange(w * bs).unsqueeze(0) >= ctx[r0:r1].unsqueeze(1), _NEG_INF)
                m.decode_groups.append(DecodeGroup(r0, r1 - r0, tables[r0:r1, :w], bias.view(1, r1 - r0, 1, w * bs)))
        mask = torch.arange(bs).unsqueeze(0) <= torch.arange(pre_len).unsqueeze(1)
        m.prefills.append(PrefillChunk(len(ctx), pre_len, torch.tensor([pre_block]), mask))
        return m

    outs, caches = [], []
    for backend in (TorchPagedAttention(bs), TorchPagedAttention(bs, use_cpp_kernel=False)):
        k_cache, v_cache = QuantizedKV(kq.clone(), ks.clone()), QuantizedKV(vq.clone(), vs.clone())
        with torch.inference_mode():
            outs.append(backend.forward(q, k_new, v_new, k_cache, v_cache, meta(backend), d ** -0.5))
        caches.append((k_cache, v_cache))
    (k1, v1), (k2, v2) = caches
    for a, b in ((k1, k2), (v1, v2)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_fresh_chunk_attends_over_its_keys_as_a_bfloat16_cache_holds_them():
    """A prompt chunk from position 0 attends over its own fresh K/V instead of gathering them back;
    under float32 activations with a bfloat16 cache (the default mode on avx512_bf16 CPUs) it must
    use them rounded as the cache holds them, so the chunk sees the same numbers as when a later
    chunk gathers them (otherwise its output depends on how the prompt was chunked)."""
    from kvshare.model.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention

    bs, h, kvh, d, n = 16, 9, 3, 64, 40
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, heads, d, generator=g) for heads in (h, kvh, kvh))
    table = torch.tensor([2, 0, 3])
    slots = torch.tensor([int(table[i // bs]) * bs + i % bs for i in range(n)])
    causal = torch.arange(len(table) * bs).unsqueeze(0) <= torch.arange(n).unsqueeze(1)
    outs = []
    for fresh in (True, False):  # the chunk's own K/V, or its block table gathered back
        cache = torch.zeros(2, kvh, 4 * bs, d, dtype=torch.bfloat16)
        meta = AttentionMetadata(slot_mapping=slots)
        meta.prefills.append(PrefillChunk(0, n, table, causal, causal=fresh))
        with torch.inference_mode():
            outs.append(TorchPagedAttention(bs, use_cpp_kernel=False).forward(q, k, v, cache[0], cache[1], meta,
                                                                              d ** -0.5))
    # Summation order alone (float32 SDPA, causal vs masked); unrounded K/V would differ by ~1e-3.
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


# ---- the bundled model: agreement with the unquantized cache --------------------------------------
def _prompts(tokenizer) -> list[list[int]]:
    return token_prompts(tokenizer.encode, [20 + 4 * i for i in range(16)], 41)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**EXACT, kv_cache_memory="128MiB")  # float32 model, float32 cache
    ref = agreement_metrics.reference(llm, _prompts(llm.engine.tokenizer), NUM_TOKENS)
    del llm
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(**EXACT, kv_cache_memory="128MiB", kv_cache_dtype="int8")


def _agreement(llm, ref, name):
    a = agreement_metrics.agreement(llm, ref)
    print(f"\n{name} vs float32 cache: free-running agreement {a.free_running:.3f}, teacher-forced top-1 "
          f"agreement {a.teacher_forced:.3f}, mean |logprob delta| {a.mean_abs_logprob_delta:.4f}, "
          f"max {a.max_abs_logprob_delta:.4f}")
    return a


def test_int8_and_fp8_agree_with_the_unquantized_cache(reference, int8_llm):
    # The reference's own tokens are its argmax when teacher-forced: the forced path is sound.
    assert all(rank == 1 for row in reference.forced for rank, _ in row)
    int8 = _agreement(int8_llm, reference, "int8")
    fp8_llm = LLM(**EXACT, kv_cache_memory="128MiB", kv_cache_dtype="fp8_e4m3")
    fp8 = _agreement(fp8_llm, reference, "fp8_e4m3")
    del fp8_llm
    gc.collect()
    # The bar, per decision: >= 90% of tokens for both formats.
    assert int8.teacher_forced >= 0.90 and fp8.teacher_forced >= 0.90
    # Free-running, int8 meets it on these prompts too. fp8_e4m3 does not (0.83 here): with 3
    # mantissa bits its logit noise flips this small model's near-ties, and each flip changes the
    # rest of that output (docs/benchmarks.md, Issue 6, has both formats on more prompt sets).
    assert int8.free_running >= 0.90
    # int8 steps are amax/127 of each vector; e4m3 keeps 3 mantissa bits: int8 is the finer grid.
    assert int8.mean_abs_logprob_delta < fp8.mean_abs_logprob_delta


def test_prefix_cache_and_copy_on_write_with_int8(int8_llm):
    llm = int8_llm
    ids = token_prompts(llm.engine.tokenizer.encode, [700])[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

    def run(prompts, p=params):
        outs = llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        return [[(c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]) for c in o.outputs]
                for o in outs]

    def same(a, b):
        # Tokens must match. Logprobs within 1e-2, not the 1e-4 of the float32 cache tests: runs with
        # different batch shapes differ in the last float bits, and a value on a rounding boundary then
        # lands one int8 step (amax / 127) away, moving logprobs by ~1e-3. A lost or wrong scale zeroes
        # or rescales whole K/V vectors and moves them by far more.
        assert a[0] == b[0]
        assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-2

    base, other = ids[:48], ids[:37] + ids[400:411]
    llm.engine.manager.pool.reset_prefix_cache()
    alone = run([other])[0][0]
    llm.engine.manager.pool.reset_prefix_cache()
    run([base])  # publishes base's two full blocks
    hit = llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32
    c = hit.outputs[0]
    same((c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]), alone)

    # n = 3 forks share a 37-token prompt: its partial third block is copied on write, scales
    # included; each fork must equal the same seed run on its own.
    prompt = ids[100:137]
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True, logprobs=1)
    forks = run([prompt], sampled)[0]
    assert len({tuple(f[0]) for f in forks}) > 1  # the branches really differ
    for i, fork in enumerate(forks):
        llm.engine.manager.pool.reset_prefix_cache()
        single = SamplingParams(n=1, temperature=0.8, seed=11 + i, max_tokens=8, ignore_eos=True, logprobs=1)
        same(fork, run([prompt], single)[0][0])
    llm.engine.manager.assert_idle_whole()


def test_pool_is_sized_with_the_quantized_bytes(int8_llm):
    eng = int8_llm.engine
    assert eng.layout.bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12_240
    assert eng.layout.num_blocks == kv_pool_blocks(128 * 2**20, 12_240, 16)
    # Data and scales together are exactly what the pool was budgeted for.
    assert eng.kv_cache.nbytes == eng.layout.pool_bytes
    assert eng.kv_cache.data.dtype == torch.int8 and eng.kv_cache.scales.dtype == torch.float32


def test_info_reports_kv_cache_dtype_and_bytes(capsys):
    from kvshare.cli import main

    assert main(["info", "--json", "--dtype", "bfloat16", "--kv-cache-dtype", "int8", "--kv-cache-memory",
                 "64MiB"]) == 0
    info = json.loads(capsys.readouterr().out)
    bf16_bytes = 2 * 30 * 3 * 64 * 2  # what `info --dtype bfloat16` reports (tests/test_cli.py)
    assert info["kv_cache_dtype"] == "int8" and info["dtype"] == "bfloat16"
    assert info["kv_bytes_per_token"] == 12_240 and 12_240 / bf16_bytes < 0.54
    assert "(64 head_dim x 1 byte + 4 bytes float32 scale)" in info["kv_bytes_formula"]
    assert info["num_blocks"] == kv_pool_blocks(64 * 2**20, 12_240, 16)
    assert main(["info", "--kv-cache-dtype", "fp8"]) == 2
    assert "kv_cache_dtype='fp8' is invalid" in capsys.readouterr().err
