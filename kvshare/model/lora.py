"""LoRA adapters over a loaded base model: loading (PEFT and llama.cpp GGUF forms), validation
against the base, and the per-row delta y += scale * (x A^T) B^T.

An adapter's identity (`LoRAAdapter.key`: name, a hash of its weights, its scale) is what the
prefix cache keys its blocks by (CacheNamespace.adapter): K/V computed under one adapter are other
bits than the base model's or another adapter's.

The delta is computed per row, in a fixed order of sums (never a GEMM, whose blocking follows the
row count): a row's delta depends on the row and its adapter alone, so a step mixing adapters
gives each row the bits it gets alone (the default mode's bit-transparency). It runs on top of
whatever kernel the base linear takes (the packed kept-quantized weights included). Where the
model runs on the fused C++ step (kvshare.model.fused_decode), the delta is C++'s
(csrc/decode_step.cpp, `lora_row`): inside the fused step for its rows, through `kvs_lora_apply`
for rows the step-by-step path takes, the same function either way. Elsewhere (the exact mode,
the PyTorch paths) it is PyTorch's elementwise products and sums (`LoRABatch.apply`).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch

from kvshare.model.config import ModelArchConfig

# HF module name -> the GGUF tensor name llama.cpp gives it (blk.N.<name>.weight.lora_a / _b).
GGUF_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
TARGET_MODULES = tuple(GGUF_MODULES)
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# The model's linears (LlamaModel's layer sites) and the modules each one's columns hold, in order.
SITES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
# The C++ side's module order per layer (csrc/decode_step.cpp kLoraModules), and each site's first.
_C_MODULES = tuple(m for modules in SITES.values() for m in modules)
_C_SITE_FIRST = {site: _C_MODULES.index(modules[0]) for site, modules in SITES.items()}


class _CModule(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p)]


class _CAdapter(ctypes.Structure):
    _fields_ = [("modules", ctypes.POINTER(_CModule)), ("num_layers", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("scale", ctypes.c_double)]


class _CRows(ctypes.Structure):
    _fields_ = [("adapters", ctypes.POINTER(_CAdapter)), ("num_adapters", ctypes.c_int64),
                ("row_adapter", ctypes.c_void_p)]


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this base model; `field` names what was wrong."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def module_shapes(config: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module of the base model."""
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass
class LoRAAdapter:
    name: str
    path: str
    scale: float
    rank: int
    # (layer, module) -> (A [r, in], B [out, r]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # sha256 over the weights and the scale

    def __post_init__(self) -> None:
        # B transposed, [r, out]: the delta adds one row of it per rank column (LoRABatch.apply).
        self.b_t = {k: b.t().contiguous() for k, (_, b) in self.weights.items()}

    @property
    def key(self) -> str:
        """The adapter's part of the cache namespace: another name, other weights or another
        scale is another key, so none of them shares a block."""
        return f"{self.name}#{self.digest[:24]}@{self.scale!r}"

    def site(self, layer: int, site: str) -> list[tuple[int, torch.Tensor, torch.Tensor] | None]:
        return [self.weights.get((layer, m)) for m in SITES[site]]

    def c_view(self, num_layers: int) -> _CAdapter:
        """The adapter as csrc/decode_step.cpp reads it (built once; its pointers are into
        `weights` and `b_t`, which live as long as the adapter)."""
        view = getattr(self, "_c_view", None)
        if view is None:
            modules = (_CModule * (num_layers * len(_C_MODULES)))()
            for (layer, m), (a, _) in self.weights.items():
                modules[layer * len(_C_MODULES) + _C_MODULES.index(m)] = _CModule(a.data_ptr(),
                                                                                  self.b_t[(layer, m)].data_ptr())
            view = self._c_view = _CAdapter(modules, num_layers, self.rank, self.scale)
            view._keep = modules
        return view


def load_adapter(name: str, path: str, config: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """An adapter from `path`: a PEFT directory (adapter_config.json + adapter_model.safetensors)
    or a llama.cpp GGUF LoRA file, checked against the base model `config`."""
    from kvshare.model.families import REGISTRY

    family = REGISTRY.get(config.architecture)
    if family is None or not family.model.lora_sites:
        served = [a for a in REGISTRY.architectures() if REGISTRY.get(a).model.lora_sites]
        raise LoRAAdapterError(f"LoRA adapters are served on {', '.join(served)} models; "
                               f"this base model is {config.architecture!r}", "model")
    if os.path.isdir(path):
        alpha, rank, rslora, raw = _read_peft(path)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        alpha, rank, rslora, raw = _read_gguf(path, config)
    else:
        raise LoRAAdapterError(f"lora_path {path!r} is neither a PEFT adapter directory (adapter_config.json + "
                               f"adapter_model.safetensors) nor a GGUF LoRA file (.gguf)", "lora_path")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter {name!r} has rank r={rank}, above max_lora_rank={max_rank}", "r")
    shapes = module_shapes(config)
    weights = {}
    for (layer, module), (a, b) in sorted(raw.items()):
        if not 0 <= layer < config.num_layers:
            raise LoRAAdapterError(f"adapter {name!r} has weights for layer {layer}; the base model has "
                                   f"layers 0..{config.num_layers - 1}", "layers")
        out_f, in_f = shapes[module]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise LoRAAdapterError(
                f"adapter {name!r} layer {layer} {module}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; "
                f"the base model needs lora_A [{rank}, {in_f}] and lora_B [{out_f}, {rank}]", module)
        weights[(layer, module)] = (a.float().contiguous(), b.float().contiguous())
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} at {path!r} holds no LoRA weights", "lora_path")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    h = hashlib.sha256()
    for (layer, module), (a, b) in sorted(weights.items()):
        h.update(f"{layer}.{module}".encode())
        h.update(a.numpy().tobytes())
        h.update(b.numpy().tobytes())
    h.update(repr(scale).encode())
    return LoRAAdapter(name, path, scale, rank, weights, h.hexdigest())


def _read_peft(path: str) -> tuple[float, int, bool, dict]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "adapter_config.json")
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(cfg_path) or not os.path.isfile(st_path):
        raise LoRAAdapterError(f"{path!r} must hold adapter_config.json and adapter_model.safetensors "
                               f"(PEFT's form; adapter_model.bin is not read)", "lora_path")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type is {cfg.get('peft_type')!r}; only 'LORA' adapters are served",
                               "peft_type")
    if cfg.get("use_dora"):
        raise LoRAAdapterError("use_dora=true (DoRA) is not supported; allowed: plain LoRA", "use_dora")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"modules_to_save={cfg['modules_to_save']!r} is not supported (it replaces base "
                               f"weights); allowed: none", "modules_to_save")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias={cfg['bias']!r} is not supported; allowed: 'none'", "bias")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAAdapterError(f"{key} is not supported (one r and lora_alpha for every module)", key)
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAAdapterError(f"target_modules {unknown} are not supported; allowed: {', '.join(TARGET_MODULES)}",
                               "target_modules")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"r={rank!r} and lora_alpha={alpha!r} must be a positive integer and a number",
                               "r")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(st_path).items():
        parts = key.split(".")
        try:
            i = parts.index("layers")
            layer, module, kind = int(parts[i + 1]), parts[i + 3], parts[i + 4]
        except (ValueError, IndexError):
            raise LoRAAdapterError(f"tensor {key!r} is not a LoRA weight of a layer's linear", "tensors") from None
        if module not in TARGET_MODULES or kind not in ("lora_A", "lora_B") or parts[-1] != "weight":
            raise LoRAAdapterError(f"tensor {key!r} is not supported; allowed: lora_A / lora_B weights of "
                                   f"{', '.join(TARGET_MODULES)}", "tensors")
        pairs.setdefault((layer, module), {})[kind] = t
    raw = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"layer {layer} {module} has {sorted(ab)} only; both lora_A and lora_B are needed",
                                   "tensors")
        raw[(layer, module)] = (ab["lora_A"], ab["lora_B"])
    return float(alpha), rank, bool(cfg.get("use_rslora")), raw


def _read_gguf(path: str, config: ModelArchConfig) -> tuple[float, int, bool, dict]:
    from kvshare.model.families import REGISTRY
    from kvshare.model.gguf_header import open_gguf_file
    from kvshare.model.gguf_loader import _unpermute_rows, dequantize_tensor

    reader = open_gguf_file(path)
    meta = reader.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoRAAdapterError(f"{path!r} is not a GGUF LoRA adapter (general.type={meta.get('general.type')!r}, "
                               f"adapter.type={meta.get('adapter.type')!r}; needed: 'adapter' and 'lora')",
                               "general.type")
    alpha = meta.get("adapter.lora.alpha")
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{path!r} has no adapter.lora.alpha", "adapter.lora.alpha")
    by_gguf = {v: k for k, v in GGUF_MODULES.items()}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 5 or parts[0] != "blk" or parts[3] != "weight" or parts[4] not in ("lora_a", "lora_b") \
                or parts[2] not in by_gguf:
            raise LoRAAdapterError(f"tensor {t.name!r} is not supported; allowed: blk.N.<{'|'.join(by_gguf)}>"
                                   f".weight.lora_a / .lora_b", "tensors")
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            raise LoRAAdapterError(f"tensor {t.name!r} is {t.tensor_type.name}; allowed: F32, F16, BF16", "tensors")
        data = dequantize_tensor(t).float()
        pairs.setdefault((int(parts[1]), by_gguf[parts[2]]), {})[parts[4]] = data
    permuted = REGISTRY.get(config.architecture).gguf_permuted_qk
    raw, ranks = {}, set()
    for (layer, module), ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoRAAdapterError(f"layer {layer} {module} has {sorted(ab)} only; both lora_a and lora_b are needed",
                                   "tensors")
        a, b = ab["lora_a"], ab["lora_b"]
        # llama.cpp's converter interleaves q/k output rows as it does the base weights: undone here.
        if permuted and module in ("q_proj", "k_proj"):
            b = _unpermute_rows(b, config.num_heads if module == "q_proj" else config.num_kv_heads)
        raw[(layer, module)] = (a, b)
        ranks.add(a.shape[0])
    if len(ranks) > 1:
        raise LoRAAdapterError(f"{path!r} mixes ranks {sorted(ranks)}; one rank per adapter is served", "r")
    return float(alpha), (ranks.pop() if ranks else 0), False, raw


class LoRABatch:
    """A step's adapters: which rows use which adapter (rows of no adapter get no delta)."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]], config: ModelArchConfig) -> None:
        self.groups = groups  # (adapter, row indices)
        self.num_layers = config.num_layers
        # The C++ delta (True) or PyTorch's: the model decides, once (kvshare.model.ops.Model.forward).
        self.native = False
        self._rows_view: dict[int, _CRows] = {}  # c_rows by row count, built once per step
        shapes = module_shapes(config)
        self.cols: dict[str, list[slice]] = {}
        for site, modules in SITES.items():
            bounds = [0]
            for m in modules:
                bounds.append(bounds[-1] + shapes[m][0])
            self.cols[site] = [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def rows(self, keep: torch.Tensor) -> "LoRABatch":
        """The batch over the rows `keep` (a sorted index tensor), renumbered from 0."""
        pos = {int(r): i for i, r in enumerate(keep.tolist())}
        out = LoRABatch.__new__(LoRABatch)
        out.cols, out.num_layers, out.native, out._rows_view = self.cols, self.num_layers, self.native, {}
        out.groups = [(a, torch.tensor([pos[int(r)] for r in idx.tolist() if int(r) in pos], dtype=torch.long))
                      for a, idx in self.groups]
        out.groups = [(a, idx) for a, idx in out.groups if idx.numel()]
        return out

    def c_rows(self, num_rows: int) -> _CRows:
        """The rows' adapters as csrc/decode_step.cpp reads them (-1: a row of no adapter)."""
        row_adapter = torch.full((num_rows,), -1, dtype=torch.int64)
        adapters = (_CAdapter * len(self.groups))()
        for i, (adapter, idx) in enumerate(self.groups):
            adapters[i] = adapter.c_view(self.num_layers)
            row_adapter[idx] = i
        view = _CRows(adapters, len(self.groups), row_adapter.data_ptr())
        view._keep = (adapters, row_adapter, [a for a, _ in self.groups])
        return view

    def apply(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each adapter row's delta."""
        if self.native:
            return self._apply_native(layer, site, x, y)
        for adapter, idx in self.groups:
            parts = adapter.site(layer, site)
            if all(p is None for p in parts):
                continue
            xr = x.index_select(0, idx).float()
            delta = torch.zeros(idx.numel(), y.shape[1], dtype=torch.float32)
            for m, ab, cols in zip(SITES[site], parts, self.cols[site]):
                if ab is None:
                    continue
                a, b_t = ab[0], adapter.b_t[(layer, m)]
                # Per row, a fixed-order sum over each reduced dimension: no GEMM's row blocking.
                # x A^T: a contiguous sum over in_features; then B over the r columns of t one at a
                # time (plain multiplies and adds, IEEE-rounded alike on every path).
                t = (xr.unsqueeze(1) * a.unsqueeze(0)).sum(-1)
                d = t[:, 0:1] * b_t[0]
                for j in range(1, b_t.shape[0]):
                    d = d + t[:, j:j + 1] * b_t[j]
                delta[:, cols] = d * adapter.scale
            # In place (y is the linear's fresh output): each row's y + delta, as alone.
            y.index_copy_(0, idx, y.index_select(0, idx) + delta.to(y.dtype))
        return y

    def _apply_native(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor, portable: bool = False
                      ) -> torch.Tensor:
        """apply() in C++ (portable: its scalar code where AVX-512 would run; tests: the same bits)."""
        from kvshare.model.kernels import decode_step

        xf, yf = x.float().contiguous(), y.float().contiguous()  # exact: bfloat16 values widen exactly
        widths = (ctypes.c_int64 * len(self.cols[site]))(*(c.stop - c.start for c in self.cols[site]))
        err = ctypes.create_string_buffer(256)
        rows = self._rows_view.get(x.shape[0])
        if rows is None:
            rows = self._rows_view[x.shape[0]] = self.c_rows(x.shape[0])
        rc = decode_step.DECODE.lib().kvs_lora_apply(
            ctypes.byref(rows), self.num_layers, layer, _C_SITE_FIRST[site], widths, len(widths), xf.data_ptr(),
            xf.shape[1], yf.data_ptr(), yf.shape[1], xf.shape[0], int(y.dtype == torch.bfloat16), int(portable),
            torch.get_num_threads(), err, len(err))
        if rc:
            raise ValueError(err.value.decode(errors="replace"))
        return yf if y.dtype == torch.float32 else yf.to(y.dtype)  # exact: the C++ side rounded as bfloat16
