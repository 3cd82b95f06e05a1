"""The fused decode step (kvshare/model/fused_decode.py, csrc/decode_step.cpp) against the
step-by-step forward it replaces.

Both paths run the same matmul and attention kernels; only the element-wise ops (RMSNorm,
RoPE, SiLU, residual adds) are computed by other code, so their float32 results differ by
rounding alone (measured: chosen-token logprobs within 6e-6 on the bundled model). Hence
LOGPROB_TOL = 1e-4, and tokens identical on all prompts but at most one over 32 greedy steps (a
near-tie closer than the rounding could flip one prompt; none does today). With bfloat16
activations the C++ step rounds every intermediate where the PyTorch ops round it; what still
differs is float32's last bit of the norm's sum and of SiLU's exp, which flips a bfloat16
rounding now and then, and one flip moves a chosen-token logprob by ~1e-2 (measured on 4 prompts
x 32 steps: 0, 0.014, 0.019 and 0.059, one prompt's tokens differing after that): BF16_LOGPROB_TOL.
Weights in VNNI blocks (AVX-512 VNNI CPUs) round each decode row's x to int16 steps per group
before the matmul, so a last-bit difference now and then moves one x by a whole step (2^-15 of
its group's largest value): measured worst gap 9.9e-4 on the 8 batched prompts, 6.6e-4 alone,
tokens identical; VNNI_LOGPROB_TOL leaves 10x. The float32 bound is checked on weights in rows.
"""
from __future__ import annotations

import pytest
import torch

from helpers import english_token_prompts, greedy_agreement
from kvshare import LLM, SamplingParams
from kvshare.model.attention import AttentionMetadata
from kvshare.model.kernels import decode_step, qmatmul

LOGPROB_TOL = 1e-4
BF16_LOGPROB_TOL = 0.15
BF16_KV_LOGPROB_TOL = 0.05  # a bfloat16 cache under float32 activations: flips of K/V roundings only
VNNI_LOGPROB_TOL = 1e-2
# The tiny Gemma 3 below (six layers of four (1 + w) norms and q/k norms each, widened weights):
# float32 measured 1.7e-4 (tokens identical); bfloat16 measured 0 on its prompts, where Llama's
# two roundings in place of Gemma's one would move it by 0.047 (BF16_LOGPROB_TOL would let that
# through). A missing norm, RoPE table or GELU moves it by 0.3-1.
GEMMA3_LOGPROB_TOL = 1e-3
GEMMA3_BF16_LOGPROB_TOL = 0.02
# Gemma 3 270M, float32, weights in rows (tests/test_gemma3_real.py): measured 5.2e-6.
FUSED_GEMMA3_LOGPROB_TOL = 1e-4
STEPS = 32


@pytest.fixture(scope="module", autouse=True)
def built():
    assert decode_step.DECODE.wait_until_built(), decode_step.DECODE.unavailable_reason()
    qmatmul.QMATMUL.wait_until_built()


@pytest.fixture(scope="module")
def bundled():
    # A float32 cache: the default mode's bfloat16 cache (on CPUs with avx512_bf16) would round
    # the last-bit differences of K/V away or flip them (test_default_kv_cache_... below). Weights
    # in rows: VNNI blocks' int16 rounding of x would do the same (tested on its own below).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qmatmul, "vnni_blocks_fit", lambda *a: False)
        return LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, kv_cache_dtype="float32")


def _uses_vnni_blocks(llm) -> bool:
    return llm.engine.model.layers[0].qkv.blocks is not None


@pytest.fixture(scope="module")
def bundled_other_dtype(bundled):
    """The bundled model in the activation dtype the default (this CPU's) does not pick."""
    other = "float32" if bundled.config.dtype == "bfloat16" else "bfloat16"
    return LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, dtype=other)


def _compare(llm, prompts, params, together: bool):
    """(prompts decoded identically, worst logprob gap up to the first differing token), decode
    steps fused against step-by-step. In the default mode prompt rows are token rows and take
    the fused path too (issue 28): both runs prefill on it, in one step, and differ from the
    first decode step on, so what is compared is the decode rows' path, as before token rows."""
    fused = llm.engine.model.fused_decode

    def generate(batch: list, decode_fused: bool) -> list:
        engine, done = llm.engine, {}
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, params)
        first = engine.step()  # every prompt prefilled, its first token sampled
        assert sorted(o.request_id for o in first) == [str(i) for i in range(len(batch))], "prefill took >1 step"
        fused.enabled = decode_fused
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        fused.enabled = True
        return [done[str(i)] for i in range(len(batch))]

    def run(decode_fused: bool):
        if together:
            return generate(prompts, decode_fused)
        return [generate([p], decode_fused)[0] for p in prompts]

    calls = _count_fused_calls(fused)
    try:
        got = run(True)
        n_prefill = 1 if together else len(prompts)
        assert calls[0] > n_prefill, "the fused path never ran a decode step"
        n_before = calls[0]
        ref = run(False)
        assert calls[0] == n_before + n_prefill, "the reference run took the fused path for a decode step"
    finally:
        fused.enabled = True
        del fused.run  # back to the class's method
    for g, r in zip(got, ref):
        assert len(g.outputs[0].token_ids) == len(r.outputs[0].token_ids) == params.max_tokens
    return greedy_agreement(got, ref)


def _count_fused_calls(fused) -> list[int]:
    calls = [0]
    run = fused.run

    def counting(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    fused.run = counting
    return calls


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_bundled_model_fused_equals_step_by_step(bundled, together):
    assert bundled.engine.model.fused_decode.reason(
        AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), num_decode=1,
                          decode_block_tables=torch.zeros(1, 1, dtype=torch.long),
                          decode_context_lens=torch.ones(1, dtype=torch.long)),
        1, bundled.engine.kv_cache) is None
    tok = bundled.get_tokenizer()
    # Alone: a few lengths (each prompt is its own run); batched: 8 rows of mixed lengths, 5 to 480.
    lengths = [5, 100, 260, 480] if not together else [5, 20, 47, 80, 128, 200, 300, 400]
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, lengths)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    identical, worst = _compare(bundled, prompts, params, together)
    assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} prompts decode identically"
    assert worst < LOGPROB_TOL, worst


def test_bundled_model_fused_equals_step_by_step_on_vnni_blocks():
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, kv_cache_dtype="float32")
    if not _uses_vnni_blocks(llm):
        pytest.skip("weights are kept in rows on this CPU (no AVX-512 VNNI)")
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(llm.get_tokenizer().encode,
                                                                       [5, 20, 47, 80, 128, 200, 300, 400])]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    identical, worst = _compare(llm, prompts, params, together=True)
    assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} prompts decode identically"
    assert worst < VNNI_LOGPROB_TOL, worst


def test_weights_go_back_to_rows_when_the_library_cannot_run_vnni_blocks(monkeypatch):
    """Blocks chosen before the kernel library could say (from /proc/cpuinfo) move back to rows
    if it cannot run them, before the first fused step, and the fused step then reads the rows:
    the same tokens and logprobs, bit for bit, as a model built on rows."""
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, kv_cache_dtype="float32")
    if not _uses_vnni_blocks(llm):
        pytest.skip("weights are kept in rows on this CPU (no AVX-512 VNNI)")
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(llm.get_tokenizer().encode, [5, 47])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with monkeypatch.context() as mp:
        mp.setattr(qmatmul, "vnni_blocks_fit", lambda *a: False)
        rows = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, kv_cache_dtype="float32")
    want = rows.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(qmatmul.QMATMUL.lib(), "kvs_qmm_vnni_blocks_fit", lambda *a: 0)
    calls = _count_fused_calls(llm.engine.model.fused_decode)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.model.fused_decode.run
    assert calls[0] > 0 and not _uses_vnni_blocks(llm)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)] == \
               [lp[t].logprob for lp, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]


def test_fused_equals_step_by_step_in_the_other_dtype(bundled_other_dtype):
    llm = bundled_other_dtype
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, [5, 47, 200, 400])]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    identical, worst = _compare(llm, prompts, params, together=True)
    assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} prompts decode identically"
    assert worst < (LOGPROB_TOL if llm.config.dtype == "float32" else BF16_LOGPROB_TOL), worst


def test_default_kv_cache_fused_equals_step_by_step():
    """The default mode's own cache (bfloat16 on CPUs with avx512_bf16, kvshare.config
    resolve_kv_cache_dtype): both paths write K/V rounded to it and attend over the rounded values,
    so what differs is a float32 last bit that now and then flips one element's bfloat16 rounding
    (measured on these 4 prompts x 32 steps: worst gap 0.008, tokens identical)."""
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False)
    expected = torch.bfloat16 if llm.config.prefill_dtype == "bfloat16" else torch.float32
    assert llm.engine.kv_cache.data.dtype == expected
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in english_token_prompts(tok.encode, [5, 100, 260, 480])]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    identical, worst = _compare(llm, prompts, params, together=True)
    assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} prompts decode identically"
    tol = LOGPROB_TOL if llm.engine.kv_cache.data.dtype == torch.float32 else BF16_KV_LOGPROB_TOL
    assert worst < tol, worst


def _tiny_gguf(tmp_path, arch: str, types):
    from test_loader import tiny_llama, tiny_qwen2, write_tiny_gguf

    if arch == "qwen3":  # per-head q/k RMSNorm (randomized weights), head_dim 24 != hidden / heads
        from test_families import QWEN3, tiny, write_gguf

        path = tmp_path / "qwen3.gguf"
        write_gguf(path, tiny("qwen3", tmp_path / "hf", **QWEN3), "qwen3", types[""])
        return str(path)
    if arch == "qwen2":
        model = tiny_qwen2(randomize="vectors")
    else:
        model = tiny_llama(num_key_value_heads=1)  # MQA: every q head reads the one kv head
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, model, arch, types)
    return str(path)


@pytest.mark.parametrize("arch,kv_dtype,types", [
    ("qwen2", "float32", {"": "Q8_0"}),  # q/k/v bias, int8-group codes everywhere
    ("qwen2", "bfloat16", {"": "Q4_1"}),  # int4-group codes with zeros, a bfloat16 cache
    ("llama", "float32", {"self_attn": "Q4_0", "mlp": "Q8_0", "embed": "Q8_0"}),
    # Q4_K_M's mix: Q5_0 q/k with a Q8_0 v fuse into one int8-group qkv.
    ("llama", "float32", {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q8_0", "mlp": "Q8_0"}),
    ("qwen3", "float32", {"": "Q8_0"}),  # per-head q/k RMSNorm before RoPE
])
def test_tiny_gguf_models_fused_equals_step_by_step(tmp_path, arch, kv_dtype, types):
    from gguf import GGMLQuantizationType as QT

    path = _tiny_gguf(tmp_path, arch, {k: QT[v] for k, v in types.items()})
    llm = LLM(path, kv_cache_memory="4MiB", block_size=4, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    assert llm.engine.model.fused_decode.model_reason is None
    assert all(layer.qkv.kind != "dense" for layer in llm.engine.model.layers)  # fused packed
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for together in (False, True):
        identical, worst = _compare(llm, prompts, params, together)
        assert identical == len(prompts) and worst < LOGPROB_TOL, (together, identical, worst)


def test_tiny_qwen3_bfloat16_activations_fused_equals_step_by_step(tmp_path):
    """Qwen3's per-head q/k norm with bfloat16 activations: the C++ step rounds the normalized head
    and its product with the weight to bfloat16 as layers.head_rms_norm does (BF16_LOGPROB_TOL:
    a flipped rounding moves a logprob by ~1e-2)."""
    from gguf import GGMLQuantizationType as QT

    llm = LLM(_tiny_gguf(tmp_path, "qwen3", {"": QT.Q8_0}), kv_cache_memory="4MiB", block_size=4, dtype="bfloat16",
              kv_cache_dtype="float32", enable_prefix_caching=False)
    assert llm.engine.model.fused_decode.model_reason is None and llm.engine.model.layers[0].qk_norm is not None
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    identical, worst = _compare(llm, prompts, params, together=True)
    assert identical >= len(prompts) - 1 and worst < BF16_LOGPROB_TOL, (identical, worst)


def _hides_keys(meta) -> bool:
    """Whether some row of this step's metadata has a window that hides an earlier key in some layer."""
    for m in meta.layer_metadata or [meta]:
        if m.decode_window_start is not None:
            sink_end = m.decode_sink_end if m.decode_sink_end is not None else torch.zeros_like(m.decode_window_start)
            if bool((m.decode_window_start > sink_end).any()):
                return True
    return False


def _count_windowed_fused_calls(fused) -> list[int]:
    """Counts the fused calls in which some row's window hides keys (wraps `run`, as
    _count_fused_calls does)."""
    calls = [0]
    run = fused.run

    def counting(h, tables, meta, kv_cache, lora=None):
        calls[0] += _hides_keys(meta)
        return run(h, tables, meta, kv_cache, lora)

    fused.run = counting
    return calls


@pytest.mark.parametrize("kind", ["phi3-window", "llama-sinks"])
def test_windowed_models_fused_equals_step_by_step(tmp_path, kind):
    """Decoding past the window: every layer of a tiny Phi-3 windowed at 12 tokens (the model's own
    sliding window), and a tiny Llama under attention sinks (2 sinks + an 8-token window). Rows
    whose window hides keys run in the fused step, each layer over each row's visible range, and
    agree with the step-by-step path; blocks of 4 tokens, so whole blocks fall between sinks and
    window (their table entries are never read)."""
    import gguf

    if kind == "phi3-window":
        from test_families import tiny, write_gguf

        path = tmp_path / "phi3.gguf"
        write_gguf(path, tiny("phi3", tmp_path / "hf", sliding_window=12), "phi3", gguf.GGMLQuantizationType.Q8_0)
        extra = {}
    else:
        from test_loader import tiny_llama, write_tiny_gguf

        path = tmp_path / "llama.gguf"
        write_tiny_gguf(path, tiny_llama(num_key_value_heads=1), "llama", {"": gguf.GGMLQuantizationType.Q8_0})
        extra = dict(kv_policy="sink", sink_tokens=2, window_tokens=8)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="float32",
              enable_prefix_caching=False, **extra)
    assert llm.engine.model.fused_decode.model_reason is None
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    for together in (False, True):
        # (_compare wraps this wrapper, and puts the class's `run` back when it is done)
        windowed = _count_windowed_fused_calls(llm.engine.model.fused_decode)
        identical, worst = _compare(llm, prompts, params, together)
        assert identical == len(prompts) and worst < LOGPROB_TOL, (together, identical, worst)
        assert windowed[0] > 0, f"no fused step had a row whose window hides keys (together={together})"


def _tiny_gemma3_gguf(tmp_path) -> str:
    """A tiny Gemma 3 as llama.cpp writes it, Q8_0 matrices: six layers, five local (window 12) and
    one global (linear RoPE scaling: its own table), randomized (1 + w) norms and q/k norms."""
    import gguf
    from helpers import tiny_model
    from test_gemma import gemma_overrides, write_gguf_like_llama_cpp

    over = gemma_overrides("gemma3")
    over.update(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=16)  # as GGUF has them
    path = tmp_path / "gemma3.gguf"
    write_gguf_like_llama_cpp(path, tiny_model("gemma3", tmp_path / "hf", **over), "gemma3",
                              gguf.GGMLQuantizationType.Q8_0)
    return str(path)


def _count_grouped_fused_calls(fused) -> list[int]:
    """Counts the fused calls whose layers read different block tables (KV cache groups)."""
    calls = [0]
    run = fused.run

    def counting(h, tables, meta, kv_cache, lora=None):
        layers = meta.layer_metadata or [meta]
        calls[0] += any(not torch.equal(m.decode_block_tables, layers[0].decode_block_tables) for m in layers)
        return run(h, tables, meta, kv_cache, lora)

    fused.run = counting
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_gemma3_fused_equals_step_by_step(tmp_path, dtype):
    """Gemma 3 in the fused step: (1 + w) norms in float32 rounded once, the post-attention and
    post-feed-forward norms, per-head q/k norms, GELU-tanh, the embedding scale, local and global
    RoPE tables, the query scale; its local layers in a KV cache group of their own (their own
    block tables, blocks released behind the window) while decoding runs past the window."""
    llm = LLM(_tiny_gemma3_gguf(tmp_path), kv_cache_memory="4MiB", block_size=4, dtype=dtype,
              kv_cache_dtype="float32", enable_prefix_caching=False)
    model = llm.engine.model
    assert model.fused_decode.model_reason is None
    assert len(model.rotaries) == 2 and len({layer.rotary for layer in model.layers}) == 2
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    for together in (False, True):
        grouped = _count_grouped_fused_calls(model.fused_decode)
        windowed = _count_windowed_fused_calls(model.fused_decode)
        identical, worst = _compare(llm, prompts, params, together)
        assert grouped[0] > 0 and windowed[0] > 0, (grouped, windowed)
        tol = GEMMA3_LOGPROB_TOL if dtype == "float32" else GEMMA3_BF16_LOGPROB_TOL
        assert identical == len(prompts) and worst < tol, (together, identical, worst)


def test_gemma2_says_why_it_stays_layer_by_layer(tmp_path):
    """Gemma 2 soft-caps attention scores, which the C++ attention kernel cannot: named as the reason."""
    import gguf
    from helpers import tiny_model
    from test_gemma import gemma_overrides, write_gguf_like_llama_cpp

    path = tmp_path / "gemma2.gguf"
    over = dict(gemma_overrides("gemma2"), query_pre_attn_scalar=16)
    write_gguf_like_llama_cpp(path, tiny_model("gemma2", tmp_path / "hf", **over), "gemma2",
                              gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4)
    assert "soft-capping" in llm.engine.model.fused_decode.model_reason


def test_mixed_format_qkv_stays_packed_and_fused(tmp_path):
    """Q4_K_M's other mix: Q4_K q/k with a Q6_K v (group 32 4-bit codes and group 16 6-bit codes
    cannot share one packed weight). The fused q/k/v stays packed as row blocks at their own
    formats (qlinear.StackedLinear), the fused decode step runs it (decode_step.cpp kind 5), and it
    agrees with the step-by-step path as the single-format models above do."""
    from gguf import GGMLQuantizationType as QT
    from test_loader import tiny_llama, write_tiny_gguf

    from kvshare.model.qlinear import StackedLinear

    model = tiny_llama(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, model, "llama", {"q_proj": QT.Q4_K, "k_proj": QT.Q4_K, "v_proj": QT.Q6_K,
                                           "o_proj": QT.Q8_0, "gate_proj": QT.Q4_K, "up_proj": QT.Q6_K,
                                           "down_proj": QT.Q8_0, "embed": QT.Q8_0})
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="float32", enable_prefix_caching=False)
    m = llm.engine.model
    assert m.fused_decode.model_reason is None
    for layer in m.layers:
        assert isinstance(layer.qkv, StackedLinear) and isinstance(layer.gate_up, StackedLinear)
        # (v: Q6_K's two planes on AVX-512 VNNI CPUs, else its int8 codes)
        assert [p.kind for p in layer.qkv.parts][:2] == ["int4-group", "int4-group"]
        assert layer.qkv.parts[2].kind in ("int8-group", "q6planes-group")
    assert "dense" not in {lin.kind for lin in m.linears()}
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for together in (False, True):
        identical, worst = _compare(llm, prompts, params, together)
        assert identical == len(prompts) and worst < LOGPROB_TOL, (together, identical, worst)


def test_fused_path_says_why_it_does_not_apply(bundled):
    from helpers import EXACT

    exact = LLM(**EXACT, kv_cache_memory="16MiB")
    assert "int8/int4-group" in exact.engine.model.fused_decode.reason(AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.long), num_decode=1), 1, exact.engine.kv_cache)
    fused = bundled.engine.model.fused_decode
    prefill = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), num_decode=1,
                                decode_block_tables=torch.zeros(1, 1, dtype=torch.long),
                                decode_context_lens=torch.ones(1, dtype=torch.long))
    assert fused.reason(prefill, 3, bundled.engine.kv_cache) == "not a plain decode-only step"
    windowed = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), num_decode=1)
    assert fused.reason(windowed, 1, bundled.engine.kv_cache) == "not a plain decode-only step"
    int8 = LLM(kv_cache_memory="16MiB", kv_cache_dtype="int8")
    plain = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), num_decode=1,
                              decode_block_tables=torch.zeros(1, 1, dtype=torch.long),
                              decode_context_lens=torch.ones(1, dtype=torch.long))
    assert "KV cache dtype" in int8.engine.model.fused_decode.reason(plain, 1, int8.engine.kv_cache)
    # Known when the engine is built: the start-up block names it, not only each step.
    assert any("decode steps: layer by layer (KV cache dtype" in line for line in int8.engine.startup.lines())
    assert any("decode steps: one C++ call" in line for line in bundled.engine.startup.lines())


@pytest.mark.parametrize("bad", ["slot", "block", "context"])
def test_bad_indices_are_refused_before_anything_is_written(bundled, bad):
    model, cache = bundled.engine.model, bundled.engine.kv_cache
    slots_total = cache.num_blocks * cache.block_size
    meta = AttentionMetadata(slot_mapping=torch.tensor([5]), num_decode=1,
                             decode_block_tables=torch.tensor([[0, 1]]), decode_context_lens=torch.tensor([6]))
    if bad == "slot":
        meta.slot_mapping = torch.tensor([slots_total])
    elif bad == "block":
        meta.decode_block_tables = torch.tensor([[0, cache.num_blocks]])
        meta.decode_context_lens = torch.tensor([cache.block_size + 1])
    else:
        meta.decode_context_lens = torch.tensor([2 * cache.block_size + 1])
    before = cache.data.clone()
    h = model.embed.rows(torch.tensor([42]))
    cos, sin = model.rotary.tables(torch.tensor([5]))
    with pytest.raises(ValueError, match="out of range"):
        model.fused_decode.run(h, [(cos, sin)], meta, cache)
    assert torch.equal(cache.data, before)


# ---------------------------------------------------------------------------------------------
# A row's bits do not depend on M, on its neighbours, on the thread count or on the code path
# ---------------------------------------------------------------------------------------------

def _token_rows(model, cache, seed: int, M: int):
    """M rows of 4 sequences, interleaved, as token rows hand them over: sequence s has a prefix
    already cached (random K/V) and its next positions as rows of this call, each row with its
    own slot, block table and context length (position + 1), so a row reads the K/V that the
    rows before it in its sequence write in the same call."""
    g = torch.Generator().manual_seed(seed)
    bs = cache.block_size
    seqs = 4
    prefix = torch.randint(0, 3 * bs, (seqs,), generator=g).tolist()
    owner = torch.randint(0, seqs, (M,), generator=g).tolist()  # which sequence each row continues
    count = [owner.count(s) for s in range(seqs)]
    blocks_per_seq = [-(-(prefix[s] + count[s]) // bs) for s in range(seqs)]
    max_blocks = max(blocks_per_seq)
    ids = torch.randperm(cache.num_blocks, generator=g)[:sum(blocks_per_seq)].tolist()
    tables = torch.zeros(seqs, max_blocks, dtype=torch.long)
    for s in range(seqs):
        start = sum(blocks_per_seq[:s])
        tables[s, :blocks_per_seq[s]] = torch.tensor(ids[start:start + blocks_per_seq[s]])
    nxt = list(prefix)
    pos = []
    for s in owner:
        pos.append(nxt[s])
        nxt[s] += 1
    pos_t = torch.tensor(pos)
    row_tables = tables[owner]
    slots = row_tables.gather(1, (pos_t // bs).unsqueeze(1)).squeeze(1) * bs + pos_t % bs
    meta = AttentionMetadata(slot_mapping=slots, num_decode=M, decode_block_tables=row_tables,
                             decode_context_lens=pos_t + 1)
    vocab = model.config.vocab_size
    h = model.embed_rows(model.ops, torch.randint(0, vocab, (M,), generator=g))
    return h, model.rope_tables(pos_t), meta


def _row_meta(meta, r: int):
    return AttentionMetadata(slot_mapping=meta.slot_mapping[r:r + 1], num_decode=1,
                             decode_block_tables=meta.decode_block_tables[r:r + 1],
                             decode_context_lens=meta.decode_context_lens[r:r + 1])


def _fill_cache(cache, seed: int):
    g = torch.Generator().manual_seed(seed)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(cache.data.dtype))


@pytest.fixture(scope="module", params=["bundled-float32", "bundled-bfloat16", "tiny-float32", "tiny-bfloat16",
                                        "gemma3-float32", "gemma3-bfloat16"])
def rows_model(request, tmp_path_factory):
    """A model whose decode steps take the fused path: the bundled one (hidden 576, head_dim 64),
    a tiny Llama whose head_dim 24 leaves vector tails (RoPE's half of 12, K/V rows of 24), and a
    tiny Gemma 3 (GELU-tanh, norms rounded once, post-block norms, two RoPE tables), each with
    float32 and bfloat16 activations (the bundled one on a bfloat16 cache, the tiny ones on a
    float32 cache)."""
    which, dtype = request.param.split("-")
    if which == "bundled":
        llm = LLM(kv_cache_memory="16MiB", enable_prefix_caching=False, dtype=dtype, kv_cache_dtype="bfloat16")
    elif which == "gemma3":
        # One KV cache group: _token_rows hands every layer the same slots and tables, and with
        # groups layers of different groups share storage (each at its own group's block ids).
        llm = LLM(_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma3")), kv_cache_memory="4MiB", block_size=4,
                  dtype=dtype, kv_cache_dtype="float32", enable_prefix_caching=False, kv_cache_groups=False)
    else:
        from gguf import GGMLQuantizationType as QT
        from test_loader import tiny_llama, write_tiny_gguf

        path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
        write_tiny_gguf(path, tiny_llama(hidden_size=96, intermediate_size=160, num_attention_heads=4,
                                         num_key_value_heads=2), "llama", {"": QT.Q8_0})
        llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, dtype=dtype, kv_cache_dtype="float32",
                  enable_prefix_caching=False)
    model, cache = llm.engine.model, llm.engine.kv_cache
    assert model.dtype == getattr(torch, dtype)
    probe = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), num_decode=1,
                              decode_block_tables=torch.zeros(1, 1, dtype=torch.long),
                              decode_context_lens=torch.ones(1, dtype=torch.long))
    assert model.fused_decode.reason(probe, 1, cache) is None
    return llm


@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_each_row_equals_the_same_row_alone(rows_model, M):
    """kvs_decode_layers on M rows of several sequences: every row's output (and every K/V it
    writes) equals, bit for bit, what the same row gives alone (M = 1) over the same cache
    contents (the batched call's, which hold the K/V its earlier rows wrote); at M = 17 also with
    one thread against two. Fails if a row's arithmetic depends on M or on its neighbours."""
    model, cache = rows_model.engine.model, rows_model.engine.kv_cache
    fused = model.fused_decode
    h, tables, meta = _token_rows(model, cache, seed=M, M=M)
    _fill_cache(cache, seed=M)
    before = cache.data.clone()
    batched = fused.run(h.clone(), tables, meta, cache)
    after = cache.data.clone()
    assert not torch.equal(after, before)
    if M == 17:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            cache.data.copy_(before)
            other = fused.run(h.clone(), tables, meta, cache)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(other, batched) and torch.equal(cache.data, after)
    for r in range(M):
        cache.data.copy_(after)
        alone = fused.run(h[r:r + 1].clone(), [(c[r:r + 1], s[r:r + 1]) for c, s in tables], _row_meta(meta, r),
                          cache)
        assert torch.equal(alone[0], batched[r]), f"row {r} of {M}"
        assert torch.equal(cache.data, after), f"row {r} of {M} wrote other K/V alone"


def test_portable_code_gives_the_same_bits(rows_model):
    """The C++ step's scalar element-wise code (CPUs without AVX-512) and its AVX-512 code give
    the same bits: outputs and K/V, on 17 rows (and at M = 1)."""
    model, cache = rows_model.engine.model, rows_model.engine.kv_cache
    fused = model.fused_decode
    for M in (1, 17):
        h, tables, meta = _token_rows(model, cache, seed=100 + M, M=M)
        got = {}
        for portable in (False, True):
            _fill_cache(cache, seed=M)
            fused.portable = portable
            try:
                got[portable] = (fused.run(h.clone(), tables, meta, cache), cache.data.clone())
            finally:
                fused.portable = False
        assert torch.equal(got[False][0], got[True][0]), M
        assert torch.equal(got[False][1], got[True][1]), M


@pytest.mark.skipif(not qmatmul.vnni_blocks_fit(16, 256, 32), reason="no AVX-512 VNNI")
def test_iq4_xs_indices_fused_equals_step_by_step(tmp_path):
    """An IQ4_XS file's mix (IQ4_XS q/k/o/gate/up, Q5_K v and down): the IQ4_XS weights keep their
    4-bit table indices (qlinear.GroupIQ4NLLinear; decode_step.cpp kind 11), q/k/v as row blocks,
    and the fused step agrees with the step-by-step path as the models above do."""
    from gguf import GGMLQuantizationType as QT
    from test_loader import tiny_llama, write_tiny_gguf

    from kvshare.model.qlinear import GroupIQ4NLLinear, StackedLinear

    model = tiny_llama(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "iq4_xs.gguf"
    write_tiny_gguf(path, model, "llama", {"q_proj": QT.IQ4_XS, "k_proj": QT.IQ4_XS, "v_proj": QT.Q5_K,
                                           "o_proj": QT.IQ4_XS, "gate_proj": QT.IQ4_XS, "up_proj": QT.IQ4_XS,
                                           "down_proj": QT.Q5_K, "embed": QT.Q8_0})
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="float32", enable_prefix_caching=False)
    m = llm.engine.model
    assert m.fused_decode.model_reason is None
    for layer in m.layers:
        assert isinstance(layer.qkv, StackedLinear)
        assert [p.kind for p in layer.qkv.parts] == ["iq4nl-group", "iq4nl-group", "q5planes-group"]
        assert type(layer.gate_up) is GroupIQ4NLLinear and type(layer.o) is GroupIQ4NLLinear
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for together in (False, True):
        identical, worst = _compare(llm, prompts, params, together)
        assert identical == len(prompts) and worst < LOGPROB_TOL, (together, identical, worst)


@pytest.mark.skipif(not qmatmul.vnni_blocks_fit(16, 256, 32), reason="no AVX-512 VNNI")
def test_q5_planes_fused_equals_step_by_step(tmp_path):
    """A mix of the 5-bit formats (Q5_K q/k and down, Q6_K v, Q5_1 o, Q5_0 gate/up as Gemma's
    Q4_K_M file has them): each keeps its 4-bit and 1-bit planes (qlinear.GroupQ5PlanesLinear;
    decode_step.cpp kinds 15, 16, 19), and the fused step agrees with the step-by-step path as
    the models above do."""
    from gguf import GGMLQuantizationType as QT
    from test_loader import tiny_llama, write_tiny_gguf

    from kvshare.model.fused_decode import _linear
    from kvshare.model.qlinear import GroupQ5PlanesLinear, StackedLinear

    model = tiny_llama(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, model, "llama", {"q_proj": QT.Q5_K, "k_proj": QT.Q5_K, "v_proj": QT.Q6_K,
                                           "o_proj": QT.Q5_1, "gate_proj": QT.Q5_0, "up_proj": QT.Q5_0,
                                           "down_proj": QT.Q5_K, "embed": QT.Q5_K})
    llm = LLM(str(path), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="float32", enable_prefix_caching=False)
    m = llm.engine.model
    assert m.fused_decode.model_reason is None
    for layer in m.layers:
        assert isinstance(layer.qkv, StackedLinear)
        assert [p.kind for p in layer.qkv.parts] == ["q5planes-group", "q5planes-group", "q6planes-group"]
        assert all(type(lin) is GroupQ5PlanesLinear for lin in (layer.o, layer.gate_up, layer.down))
        assert [_linear(lin, None).kind for lin in (layer.qkv.parts[0], layer.o, layer.gate_up, layer.down)] == \
            [15, 16, 19, 15]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 3, 9, 17])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for together in (False, True):
        identical, worst = _compare(llm, prompts, params, together)
        assert identical == len(prompts) and worst < LOGPROB_TOL, (together, identical, worst)


@pytest.mark.skipif(not qmatmul.vnni_blocks_fit(16, 256, 32), reason="no AVX-512 VNNI")
def test_q5_planes_give_the_byte_per_code_models_bits(tmp_path, monkeypatch):
    """The same 5-bit file loaded with its codes kept as planes and as a byte per code (planes
    switched off: GGUFBlocks.q5_planes None): the same tokens and the same logprobs, bit for bit,
    batched and alone, on the fused step; at ~0.63x the 5-bit weights' bytes."""
    from gguf import GGMLQuantizationType as QT
    from test_loader import tiny_llama, write_tiny_gguf

    from kvshare.model.gguf_quants import GGUFBlocks

    model = tiny_llama(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, model, "llama", {"q_proj": QT.Q5_0, "k_proj": QT.Q5_0, "v_proj": QT.Q5_1,
                                           "o_proj": QT.Q5_K, "gate_proj": QT.Q5_K, "up_proj": QT.Q5_1,
                                           "down_proj": QT.Q5_0, "embed": QT.Q5_K})
    kw = dict(kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="float32", enable_prefix_caching=False)
    planes = LLM(str(path), **kw)
    with monkeypatch.context() as m:
        m.setattr(GGUFBlocks, "q5_planes", property(lambda self: None))
        bytes_ = LLM(str(path), **kw)
    # (the 268-row embedding / lm_head: no VNNI blocks for N % 16 != 0, int8 rows either way)
    kinds = [{lin.kind for lin in llm.engine.model.linears() if lin is not llm.engine.model.lm_head}
             for llm in (planes, bytes_)]
    assert kinds == [{"q5planes-group"}, {"int8-group"}]
    assert planes.engine.model.fused_decode.model_reason is None
    assert planes.engine.model.weight_bytes < 0.75 * bytes_.engine.model.weight_bytes
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate([1, 4, 11, 19])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    for batch in (prompts, prompts[:1], prompts[3:]):
        got, want = planes.generate(batch, params), bytes_.generate(batch, params)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].logprobs == w.outputs[0].logprobs  # (floats compared with ==)
