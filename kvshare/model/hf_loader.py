"""Hugging Face model directories (config.json + *.safetensors) -> ModelArchConfig + weights.

safetensors is read with a few lines of our own (an 8-byte header length, a JSON header, raw
little-endian data) so the ``safetensors`` package stays a test-only dependency.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import numpy as np
import torch

from kvshare.model.config import ModelArchConfig
from kvshare.model.families import REGISTRY
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.load_error import ModelLoadError
from kvshare.model.tokenizer import Tokenizer


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_LAYER_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(input_layernorm\.weight|post_attention_layernorm\.weight"
    r"|self_attn\.[qkvo]_proj\.(weight|bias)|mlp\.(gate|up|down)_proj\.weight"
    r"|self_attn\.[qk]_norm\.weight|self_attn\.qkv_proj\.weight|mlp\.gate_up_proj\.weight)$"
)
_GLOBAL_WEIGHTS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
# Buffers some older checkpoints saved; recomputed by the model, never loaded.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def _family_weights(config: ModelArchConfig) -> set[str]:
    """The tensors the config's family adds to the Llama layout."""
    family = REGISTRY.get(config.architecture)
    return set() if family is None or family.extra_weights is None else set(family.extra_weights(config))


def read_safetensors(path: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of one .safetensors file, copied out of the file (cast to ``dtype`` if given)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is truncated or corrupt: too short for a safetensors header.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ModelLoadError(f"{path} is truncated or corrupt: header length {header_len} exceeds the file.")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path} is truncated or corrupt: bad safetensors header ({exc}).") from exc
    data_start = 8 + header_len
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        st_dtype = info.get("dtype")
        if st_dtype not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported safetensors dtype {st_dtype!r}.")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        tdtype = _SAFETENSORS_DTYPES[st_dtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=tdtype).element_size()
        if end - begin != nbytes or data_start + end > size:
            raise ModelLoadError(
                f"{path} is truncated or corrupt: tensor {name!r} ({st_dtype} {shape}) needs bytes "
                f"{data_start + begin}..{data_start + end} but the file has {size}."
            )
        # A copy gives an aligned, writable buffer and lets the memory map close.
        raw = np.array(mm[data_start + begin : data_start + end], copy=True)
        t = torch.from_numpy(raw).view(tdtype).reshape(shape)
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    del mm
    return out


def _weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [n for n in files if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise ModelLoadError(f"{directory}: shards named in model.safetensors.index.json are missing: {missing}.")
        return [os.path.join(directory, n) for n in files]
    files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        other = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {', '.join(other)}; only safetensors checkpoints are supported)" if other else ""
        raise ModelLoadError(f"{directory} has config.json but no *.safetensors weights{hint}.")
    return [os.path.join(directory, n) for n in files]


def _rope_from_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers<5 or the >=5 config layout.

    Old: ``rope_theta`` plus an optional ``rope_scaling`` dict (``type`` or ``rope_type``).
    New: one ``rope_parameters`` dict carrying ``rope_theta`` and ``rope_type`` with its parameters.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    source = scaling if (scaling.get("rope_type") or scaling.get("type")) else params
    rope_type = source.get("rope_type") or source.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        try:
            return float(theta), {
                "rope_type": "llama3",
                "factor": float(source["factor"]),
                "low_freq_factor": float(source["low_freq_factor"]),
                "high_freq_factor": float(source["high_freq_factor"]),
                "original_max_position_embeddings": int(source["original_max_position_embeddings"]),
            }
        except KeyError as exc:
            raise ModelLoadError(f"llama3 rope scaling in config.json is missing {exc}.") from None
    # Other schemes are passed through for the model code to accept or refuse.
    rest = {k: v for k, v in source.items() if k not in ("type", "rope_type", "rope_theta")}
    return float(theta), {"rope_type": rope_type, **rest}


def split_fused_weights(weights: dict, config: ModelArchConfig, types: dict[str, str] | None = None) -> None:
    """Phi-3's qkv_proj and gate_up_proj (dense or GroupAffine), split in place into the Llama names
    every other part of kvshare uses (the model fuses them again: one matmul each); `types`, a
    GGUF loader's name -> type map, follows the split."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    for name in [n for n in weights if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        w = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            prefix, parts = name[: -len("qkv_proj.weight")], {"q_proj": q, "k_proj": kv, "v_proj": kv}
        else:
            prefix, parts = name[: -len("gate_up_proj.weight")], {"gate_proj": inter, "up_proj": inter}
        if w.shape[0] != sum(parts.values()):
            raise ModelLoadError(f"{name}: {w.shape[0]} rows, expected {sum(parts.values())} "
                                 f"({' + '.join(f'{k} {v}' for k, v in parts.items())}).")
        start = 0
        for part, rows in parts.items():
            weights[f"{prefix}{part}.weight"] = _row_slice(w, start, start + rows)
            if types is not None and name in types:
                types[f"{prefix}{part}.weight"] = types[name]
            start += rows
        if types is not None:
            types.pop(name, None)


def _row_slice(w, start: int, end: int):
    if isinstance(w, GroupAffine):  # rows are independent in the group form: slice each part
        return w.row_slice(start, end)
    return w[start:end].contiguous()


def config_from_hf(cfg: dict[str, Any], directory: str, generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
    model_type = cfg.get("model_type")
    family = REGISTRY.by_hf_model_type(model_type)
    if family is None:
        raise ModelLoadError(f"{directory}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(REGISTRY.hf_model_types())}).")
    defaults = family.hf_defaults
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{directory}/config.json is missing {exc}.") from None
    kv = cfg.get("num_key_value_heads", defaults.get("num_key_value_heads"))
    head_dim = cfg.get("head_dim") or defaults.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope_from_config(cfg)

    eos: list[int] = []
    for source in (cfg, generation_config or {}):
        value = source.get("eos_token_id", defaults["eos_token_id"] if source is cfg else None)
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in eos:
                eos.append(int(i))
    bos = cfg.get("bos_token_id", defaults["bos_token_id"])

    fields: dict[str, Any] = dict(
        architecture=family.architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(kv) if kv is not None else num_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", defaults["max_position_embeddings"])),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Llama has q/k/v bias (and o_proj bias) only with attention_bias; a family may say otherwise.
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        name=str(cfg.get("_name_or_path") or os.path.basename(os.path.normpath(directory))),
    )
    if family.hf_config is not None:
        fields.update(family.hf_config(cfg, fields, directory))
    return ModelArchConfig(**fields)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read as JSON ({exc}).") from exc


def load_hf_dir(
    directory: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelArchConfig, dict[str, torch.Tensor], Tokenizer | None]:
    cfg = _read_json(os.path.join(directory, "config.json"))
    if cfg is None:
        raise ModelLoadError(f"{directory} has no config.json.")
    config = config_from_hf(cfg, directory, _read_json(os.path.join(directory, "generation_config.json")))

    weights: dict[str, torch.Tensor] = {}
    extra = _family_weights(config)
    for path in _weight_files(directory):
        for name, t in read_safetensors(path, dtype=dtype).items():
            if _IGNORED.search(name):
                continue
            if name not in _GLOBAL_WEIGHTS and not _LAYER_WEIGHT.match(name) and name not in extra:
                raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {config.architecture} model.")
            weights[name] = t
    split_fused_weights(weights, config)
    if config.tie_word_embeddings:
        # Tied means the output projection *is* the embedding, whatever else the file holds.
        weights.pop("lm_head.weight", None)

    tokenizer = None
    tok_json = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(tok_json):
        try:
            tokenizer = Tokenizer.from_file(tok_json)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"{tok_json} cannot be loaded ({exc}).") from exc
    return config, weights, tokenizer
