"""Qwen3 and Phi-3 against HF transformers on tiny random-weight checkpoints (float32, exact mode).

Each model is saved with save_pretrained and loaded by kvshare from the directory (and, for
Qwen3 and Phi-3, from a GGUF file written from the same weights). Runs use chunked prefill (a
small max_num_batched_tokens) and prefix caching, so shared prefixes are served from the cache.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers import EXACT
from kvshare import LLM, SamplingParams
from kvshare.model.loader import load_model

VOCAB = 320
STEPS = 32
TOL = 1e-3


def tiny(kind: str, tmp_path, **overrides):
    """A random-weight HF model of `kind` saved to tmp_path, weights widened and norms randomized
    (norms initialized to 1 would hide a skipped or swapped norm)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path)
    return model


def hf_greedy(model, prompt: list[int], steps: int, first_forward: int | None = None):
    """HF greedy decoding by hand with its KV cache: tokens, chosen-token logprobs, prompt logprobs.

    first_forward: feed the prompt as two forwards, its first `first_forward` tokens then the
    rest (None: one forward), which is what HF's longrope switch depends on."""
    cut = [first_forward] if first_forward is not None and 0 < first_forward < len(prompt) else []
    logits, past = [], None
    with torch.no_grad():
        for piece in torch.split(torch.tensor(prompt), [*cut, len(prompt) - sum(cut)] if cut else [len(prompt)]):
            out = model(piece.unsqueeze(0), past_key_values=past, use_cache=True)
            logits.append(out.logits[0])
            past = out.past_key_values
        full = torch.cat(logits).float().log_softmax(-1)
        prompt_lp = [full[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        lp, tokens, step_lp = full[-1], [], []
        for _ in range(steps):
            t = int(lp.argmax())
            tokens.append(t)
            step_lp.append(lp[t].item())
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            lp, past = out.logits[0, -1].float().log_softmax(-1), out.past_key_values
    return tokens, step_lp, prompt_lp


def kvshare_greedy(llm: LLM, prompts: list[list[int]], steps: int = STEPS, prompt_logprobs: bool = True):
    """(tokens, chosen-token logprobs, prompt logprobs or []) per prompt. Requests asking for
    prompt logprobs compute their whole prompt; without them prefix-cache hits are used."""
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0 if prompt_logprobs else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for p, out in zip(prompts, outs):
        got = out.outputs[0]
        prompt_lps = ([out.prompt_logprobs[i + 1][p[i + 1]].logprob for i in range(len(p) - 1)]
                      if prompt_logprobs else [])
        result.append((got.token_ids, [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)], prompt_lps))
    return result


def assert_matches(ours, ref) -> None:
    tokens, lps, prompt_lps = ours
    ref_tokens, ref_lps, ref_prompt_lps = ref
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < TOL
    if prompt_lps:
        assert max(abs(a - b) for a, b in zip(prompt_lps, ref_prompt_lps)) < TOL


def engine(path, **kw) -> LLM:
    return LLM(**EXACT, model=str(path), kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=32,
               enable_prefix_caching=True, **kw)


def prompts_with_shared_prefix(lengths, seed=1) -> list[list[int]]:
    """Random prompts; the later ones start with the first one's tokens (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, VOCAB, (max(lengths),), generator=g).tolist()
    out = [base[:lengths[0]]]
    for n in lengths[1:]:
        out.append(base[:lengths[0]] + torch.randint(3, VOCAB, (n - lengths[0],), generator=g).tolist())
    return out


QWEN3 = dict(head_dim=24, tie_word_embeddings=True)  # head_dim != hidden / heads (16)


def test_qwen3_matches_hf(tmp_path):
    model = tiny("qwen3", tmp_path, **QWEN3)
    llm = engine(tmp_path)
    c = llm.engine.model_config
    assert (c.architecture, c.qk_norm, c.head_dim, c.tie_word_embeddings) == ("qwen3", True, 24, True)
    # Exact mode: dense weights, so layer by layer (the fused step with q/k norms:
    # tests/test_fused_decode.py test_tiny_gguf_models_fused_equals_step_by_step).
    assert "int8/int4-group" in llm.engine.model.fused_decode.model_reason
    prompts = prompts_with_shared_prefix([40, 70])
    refs = [hf_greedy(model, p, STEPS) for p in prompts]
    for ours, ref in zip(kvshare_greedy(llm, prompts), refs):
        assert_matches(ours, ref)
    # Again without prompt logprobs: the prompts' blocks now come from the prefix cache.
    hits = llm.engine.manager.stats_dict()["prefix_cache_hits"]
    for ours, ref in zip(kvshare_greedy(llm, prompts, prompt_logprobs=False), refs):
        assert_matches(ours, ref)
    assert llm.engine.manager.stats_dict()["prefix_cache_hits"] > hits


def test_phi3_default_rope_with_sliding_window_matches_hf(tmp_path):
    """Fused qkv / gate_up, untied, every layer windowed (Phi-3-mini-4k's layout at small scale)."""
    model = tiny("phi3", tmp_path, sliding_window=24)
    llm = engine(tmp_path)
    c = llm.engine.model_config
    assert (c.architecture, c.sliding_window, c.rope_scaling, c.rotary_dim) == ("phi3", 24, None, None)
    prompts = prompts_with_shared_prefix([20, 60])
    for p, ours in zip(prompts, kvshare_greedy(llm, prompts)):
        assert_matches(ours, hf_greedy(model, p, STEPS))


ORIGINAL = 48  # original_max_position_embeddings of the longrope model: runs cross it
HEAD_DIM = 16
ROTARY = 12  # partial_rotary_factor 0.75, as Phi-4-mini


def longrope_phi3(tmp_path, partial_rotary_factor: float = 0.75):
    rotary = int(HEAD_DIM * partial_rotary_factor)
    g = torch.Generator().manual_seed(5)
    return tiny("phi3", tmp_path, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": partial_rotary_factor,
                                 "short_factor": (1.0 + torch.rand(rotary // 2, generator=g)).tolist(),
                                 "long_factor": (2.0 + 6.0 * torch.rand(rotary // 2, generator=g)).tolist()})


def test_phi3_longrope_matches_hf_across_the_switch(tmp_path):
    """Prompts shorter than original_max_position_embeddings whose decoding runs past it: HF
    switches to the long factors (for the new tokens; cached keys keep theirs) exactly where
    kvshare's per-position tables do."""
    model = longrope_phi3(tmp_path)
    llm = engine(tmp_path)
    c = llm.engine.model_config
    assert c.rotary_dim == ROTARY and c.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert c.rope_scaling["attention_factor"] == pytest.approx((1 + np.log(4) / np.log(ORIGINAL)) ** 0.5)
    # Exact mode: dense weights, so layer by layer (the fused step with a partial rotary embedding:
    # test_phi3_kept_quantized_fused_decode_across_the_switch below).
    assert "int8/int4-group" in llm.engine.model.fused_decode.model_reason
    prompts = prompts_with_shared_prefix([20, 40])  # decoding reaches positions 51 and 71
    refs = [hf_greedy(model, p, STEPS) for p in prompts]
    for ours, ref in zip(kvshare_greedy(llm, prompts), refs):
        assert_matches(ours, ref)

    # The factors must matter here, or the match above proves little: HF with the short factors
    # everywhere (its long factors overwritten) decodes or scores differently.
    rope = model.model.rotary_emb
    rope.long_inv_freq = rope.original_inv_freq.clone()
    short_only = hf_greedy(model, prompts[1], STEPS)
    assert refs[1][0] != short_only[0] or max(abs(a - b) for a, b in zip(refs[1][1], short_only[1])) > 10 * TOL


def test_phi3_longrope_prompt_past_the_switch(tmp_path):
    """A prompt longer than original_max_position_embeddings: HF's single prefill forward rotates
    all of it with the long factors, kvshare only its positions from `original` on. kvshare equals
    HF fed the prompt as two forwards split at `original`, and differs from the single forward
    (the documented difference, kvshare/model/layers.py RotaryEmbedding)."""
    model = longrope_phi3(tmp_path)
    llm = engine(tmp_path)
    prompt = prompts_with_shared_prefix([70], seed=3)[0]
    ours = kvshare_greedy(llm, [prompt], steps=8)[0]
    assert_matches(ours, hf_greedy(model, prompt, 8, first_forward=ORIGINAL))
    one_forward = hf_greedy(model, prompt, 8)
    assert max(abs(a - b) for a, b in zip(ours[2][ORIGINAL:], one_forward[2][ORIGINAL:])) > 10 * TOL


# ---------------------------------------------------------------------------------------------
# GGUF: the same weights written as llama.cpp's converter lays them out
# ---------------------------------------------------------------------------------------------

def write_gguf(path, model, arch: str, matrices: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> None:
    """`model` as a GGUF file of `arch` (vectors float32, matrices as `matrices`, no tokenizer):
    names and metadata as convert_hf_to_gguf writes them for Qwen3 and Phi-3 (no Q/K
    permutation for either)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            original = rope["original_max_position_embeddings"]
            factor = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(factor) / np.log(original))))
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in glob:
            gname = glob[name]
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{layer[rest]}"
        arr = t.float().numpy().copy()
        if arr.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_gguf_agrees_with_the_hf_directory(tmp_path):
    model = tiny("qwen3", tmp_path / "hf", **QWEN3)
    write_gguf(tmp_path / "m.gguf", model, "qwen3")
    from_gguf = load_model(str(tmp_path / "m.gguf"), dtype=torch.float32, quantization=None)
    from_hf = load_model(str(tmp_path / "hf"))
    assert from_gguf.config.qk_norm and from_gguf.config.head_dim == 24
    assert sorted(from_gguf.weights) == sorted(from_hf.weights)
    for name, w in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], w), name
    p = prompts_with_shared_prefix([30], seed=4)
    ours = kvshare_greedy(engine(tmp_path / "m.gguf"), p, steps=8)[0]
    assert_matches(ours, hf_greedy(model, p[0], 8))


def test_phi3_longrope_gguf_agrees_with_the_hf_directory(tmp_path):
    model = longrope_phi3(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", model, "phi3")
    from_gguf = load_model(str(tmp_path / "m.gguf"), dtype=torch.float32, quantization=None)
    from_hf = load_model(str(tmp_path / "hf"))
    assert from_gguf.config.rotary_dim == ROTARY
    ours, theirs = from_gguf.config.rope_scaling, from_hf.config.rope_scaling
    assert ours["attention_factor"] == pytest.approx(theirs["attention_factor"])  # a float32 in the file
    assert {k: v for k, v in ours.items() if k != "attention_factor"} == {
        k: v for k, v in theirs.items() if k != "attention_factor"}
    assert sorted(from_gguf.weights) == sorted(from_hf.weights)
    for name, w in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], w), name
    p = prompts_with_shared_prefix([30], seed=4)  # decoding crosses original_max_position_embeddings
    ours = kvshare_greedy(engine(tmp_path / "m.gguf"), p)[0]
    assert_matches(ours, hf_greedy(model, p[0], STEPS))


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
def test_phi3_kept_quantized_fused_decode_across_the_switch(tmp_path, partial_rotary_factor):
    """Q8_0 matrices kept packed: attn_qkv and ffn_up split row-wise in group form (equal to the
    dequantized split), and the fused C++ decode step -- which takes longrope's per-position tables
    as given, over whole heads or (0.75, Phi-4-mini's) their first 12 of 16 dims -- equals the
    step-by-step path while decoding crosses original_max_position_embeddings."""
    from kvshare.model.gguf_quants import GroupAffine
    from kvshare.model.kernels import decode_step, qmatmul
    from test_fused_decode import LOGPROB_TOL, _compare

    model = longrope_phi3(tmp_path / "hf", partial_rotary_factor=partial_rotary_factor)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, model, "phi3", gguf.GGMLQuantizationType.Q8_0)
    packed = load_model(path, quantization="auto").weights
    dense = load_model(path, quantization=None).weights
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        w = packed[f"model.layers.1.{name}.weight"]
        assert isinstance(w, GroupAffine) and torch.equal(w.dequantize(), dense[f"model.layers.1.{name}.weight"])

    assert decode_step.DECODE.wait_until_built(), decode_step.DECODE.unavailable_reason()
    qmatmul.QMATMUL.wait_until_built()
    llm = LLM(path, kv_cache_memory="4MiB", block_size=16, enable_prefix_caching=False, dtype="float32",
              kv_cache_dtype="float32")  # the float32 bound below is for a float32 cache
    assert llm.engine.model.fused_decode.model_reason is None
    prompts = [{"prompt_token_ids": p} for p in prompts_with_shared_prefix([30, 40], seed=6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)  # to positions 53, 63
    identical, worst = _compare(llm, prompts, params, together=True)
    assert identical == len(prompts) and worst < LOGPROB_TOL, (identical, worst)


def test_sink_rerotation_turns_only_the_rotary_dims(tmp_path):
    """A partial rotary embedding: moving a cached key by `shift` equals rotating it at the new
    position from scratch, and the dims RoPE leaves alone stay untouched."""
    from kvshare.model.attention import PagedKVStorage
    from kvshare.model.config import ModelArchConfig
    from kvshare.model.layers import RotaryEmbedding, rope_inv_freq
    from kvshare.model.rerotate import rerotate_keys

    cfg = ModelArchConfig("phi3", VOCAB, 64, 96, 1, 4, 2, HEAD_DIM, rotary_dim=ROTARY)
    rope = RotaryEmbedding(cfg, 64, torch.float32)
    cache = PagedKVStorage(1, 2, 4, 2, HEAD_DIM, torch.float32)
    raw = torch.randn(4, 2, HEAD_DIM)
    pos = torch.arange(20, 24)
    cos, sin = rope.tables(pos)
    written = RotaryEmbedding.rotate(raw, cos, sin)
    cache.data[0, 0, :, 4:8] = written.transpose(0, 1)  # block 1 = slots 4..7
    rerotate_keys(cache, [1], -9, rope_inv_freq(cfg))
    cos, sin = rope.tables(pos - 9)
    expected = RotaryEmbedding.rotate(raw, cos, sin)
    got = cache.data[0, 0, :, 4:8].transpose(0, 1)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(got[..., ROTARY:], raw[..., ROTARY:])


def test_configs_read_as_transformers_reads_them():
    """Fields a config.json may leave out or spell the old way, against transformers' own config
    classes: Qwen3's default head_dim and sliding layers, Phi-3's 'su' rope type, its top-level
    original_max_position_embeddings (default 4096, winning over the rope dict's)."""
    import transformers
    from kvshare.model.hf_loader import config_from_hf
    from kvshare.model.layers import rope_inv_freq
    from kvshare.model.load_error import ModelLoadError

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    qwen3 = dict(model_type="qwen3", use_sliding_window=True, sliding_window=32, max_window_layers=2, **shape)
    ours, hf = config_from_hf(qwen3, "q"), transformers.Qwen3Config(**qwen3)
    assert ours.head_dim == hf.head_dim == 128
    assert ours.attention_windows() == [32 if t == "sliding_attention" else None for t in hf.layer_types]
    with pytest.raises(ModelLoadError, match="attention_bias"):
        config_from_hf({**qwen3, "attention_bias": True}, "q")

    g = torch.Generator().manual_seed(0)
    phi3 = dict(model_type="phi3", max_position_embeddings=32768, **shape,
                rope_scaling={"type": "su", "short_factor": torch.rand(8, generator=g).add(1).tolist(),
                              "long_factor": torch.rand(8, generator=g).add(2).tolist(),
                              "original_max_position_embeddings": 8192})
    hf = transformers.Phi3Config.from_dict(dict(phi3))
    hf_inv_freq, hf_attention = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"](hf, None)
    config = config_from_hf(phi3, "p")
    rope = config.rope_scaling
    assert torch.equal(rope_inv_freq(config), hf_inv_freq)  # the short factors, bit for bit
    assert rope["rope_type"] == "longrope"
    assert rope["original_max_position_embeddings"] == hf.rope_parameters["original_max_position_embeddings"] == 4096
    assert rope["attention_factor"] == pytest.approx(hf_attention)
    assert rope["short_factor"] == hf.rope_parameters["short_factor"]
