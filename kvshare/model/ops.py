"""The ops a family's layer math is written over, and the model every family builds.

A family (kvshare.model.families) says what its layer computes; `Ops` decides how: which kernel a
row takes by its kind (decode rows on the packed kernels, prompt rows on the dequantized GEMM,
kvshare.model.qlinear), how weights are stored, what tensor parallelism adds (a vocabulary-split
embedding, an all-reduce after each row-parallel linear, gathered logits), which attention backend
serves the capabilities the family asks for (soft-capping: the PyTorch attention, the C++ kernel
has none), and whether a step's decode rows go through the fused C++ decode stack.

`Model.forward` dispatches by row kind (in the default mode every row is a decode row: token
rows, kvshare.model.numerics): decode rows through the fused stack when the model allows it
(each layer with its own view of the rows: KV cache groups' tables, windows' visible ranges),
every other row layer by layer, whatever else shares the step (rows never see each other: each
attends over its own sequence's blocks only).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvshare.model.attention import AttentionBackend, AttentionMetadata, PagedKVStorage, TorchPagedAttention
from kvshare.model.config import ModelArchConfig
# Stack / StackLayer: how a family describes its layers to the fused decode step (families
# import this module, never fused_decode itself).
from kvshare.model.fused_decode import FusedDecode, Stack, StackLayer  # noqa: F401
from kvshare.model.gguf_quants import GroupAffine
from kvshare.model.layers import RotaryEmbedding, head_rms_norm, rms_norm
from kvshare.model.qlinear import DequantScratch, RowBlocks, make_linear
from kvshare.model.tensor_parallel import TPCollectives

# Norms and RoPE are plain functions of their inputs: the same op for every row kind.
norm = rms_norm
head_norm = head_rms_norm
rope = RotaryEmbedding.rotate


def norm_f32(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale computed in float32, cast back to x's dtype (Gemma's
    RMSNorm, `scale` being float32 1 + weight: HF casts only at the end)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class Ops:
    """Built once per model: its activation dtype, weight storage, attention backend and TP."""

    def __init__(self, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 prefill_dtype: torch.dtype | None = None, tp: TPCollectives | None = None,
                 attention_softcap: bool = False) -> None:
        if attention_softcap and isinstance(backend, TorchPagedAttention) and backend.use_cpp_kernel:
            # The C++ attention kernel cannot cap scores: this model's every step takes PyTorch's.
            backend = TorchPagedAttention(backend.block_size, use_cpp_kernel=False)
        self.dtype = dtype
        self.backend = backend
        self.max_positions = max_positions
        self.tp = tp
        self.scratch = DequantScratch(prefill_dtype or dtype)

    # ---- at build: weights onto their storage ----
    def linear(self, w):
        """A weight matrix on the kernel that suits its storage (qlinear.make_linear)."""
        return make_linear(w, self.dtype, self.scratch)

    def dense(self, w) -> torch.Tensor:
        return (w.dequantize() if isinstance(w, GroupAffine) else w).to(self.dtype).contiguous()

    @staticmethod
    def float32(w) -> torch.Tensor:
        return (w.dequantize() if isinstance(w, GroupAffine) else w).float()

    @staticmethod
    def fuse(parts: list) -> torch.Tensor | GroupAffine | RowBlocks:
        """Row-wise concatenation of weights (q/k/v, gate/up: fewer, larger GEMMs): packed parts
        of one format as one packed weight, packed parts of several formats (a Q4_K_M file's Q4_K
        q/k and Q6_K v) as row blocks each kept in its own (qlinear.StackedLinear)."""
        if all(isinstance(p, GroupAffine) for p in parts):
            try:
                return GroupAffine.cat(parts)
            except ValueError:
                return RowBlocks(parts)
        return torch.cat([p.dequantize() if isinstance(p, GroupAffine) else p.float() for p in parts])

    def rotary(self, config: ModelArchConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config, self.max_positions, self.dtype)

    # ---- in a forward ----
    def embed(self, table, ids: torch.Tensor) -> torch.Tensor:
        return table.rows(ids) if self.tp is None else self.tp.embed(table, ids)

    def logits(self, lm_head, x: torch.Tensor) -> torch.Tensor:
        logits = lm_head(x).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def step(self, meta: AttentionMetadata, kv_cache: PagedKVStorage, lora=None) -> "StepOps":
        return StepOps(self, meta, kv_cache, lora)


class StepOps:
    """The ops of one forward over one set of rows: rows [0, num_decode) are decode rows."""

    def __init__(self, ops: Ops, meta: AttentionMetadata, kv_cache: PagedKVStorage, lora=None) -> None:
        self.ops, self.meta, self.kv_cache = ops, meta, kv_cache
        self.num_decode = meta.num_decode
        self.lora = lora  # the step's adapter rows (kvshare.model.lora.LoRABatch), or None

    def linear(self, lin, x: torch.Tensor, row_parallel: bool = False, site: tuple[int, str] | None = None
               ) -> torch.Tensor:
        """x @ lin.T, each row on its kind's kernel. row_parallel: under TP the weight holds this
        rank's input columns, and the result is the sum over ranks. site: (layer, linear) where an
        adapter may add its delta to its rows (kvshare.model.lora.SITES)."""
        y = lin(x, self.num_decode)
        if self.lora is not None and site is not None:
            y = self.lora.apply(site[0], site[1], x, y)
        tp = self.ops.tp
        return y if tp is None or not row_parallel else tp.all_reduce(y)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  softcap: float | None = None) -> torch.Tensor:
        """Writes k, v to layer `layer`'s cache and attends each row over its own sequence."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        return self.ops.backend.forward(q, k, v, k_cache, v_cache, self.meta.for_layer(layer), scale,
                                        softcap=softcap)


class Model:
    """What the engine runs: a family's recipe (`build`, `layers_forward`, `final_norm`) over Ops.

    A family whose layer the fused C++ decode step runs (the Llama layer: pre-norm attention with
    fused q/k/v, an optional q/k/v bias and per-head q/k norm, pre-norm SiLU-gated MLP; or Gemma's,
    with its (1 + w) norms around both blocks and a GELU-gated MLP) describes it in `fused_layers`;
    tensor parallelism comes with Ops for any family whose weights shard."""

    # Whether the family's layer names its linears' sites to StepOps.linear, so that LoRA adapters
    # (kvshare.model.lora) apply to it.
    lora_sites = False

    def __init__(self, config: ModelArchConfig, weights: dict, ops: Ops) -> None:
        self.config = config
        self.ops = ops
        self.dtype, self.backend, self.tp = ops.dtype, ops.backend, ops.tp
        self.build(weights)
        self.fused_decode = FusedDecode(self, self.fused_layers())

    # ---- a family's recipe ----
    def build(self, weights: dict) -> None:
        raise NotImplementedError

    def fused_layers(self) -> Stack | str:
        """The layers as the fused stack reads them (kvshare.model.fused_decode.Stack), or why
        this family's layers are not the fused stack's."""
        return f"{self.config.architecture} layers are not in the C++ decode step"

    def embed_rows(self, ops: Ops, ids: torch.Tensor) -> torch.Tensor:
        return ops.embed(self.embed, ids)

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per rotary embedding the layers use (a layer names its own by index)."""
        raise NotImplementedError

    def layers_forward(self, ops: StepOps, h: torch.Tensor, tables: list) -> torch.Tensor:
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- shared by every family ----
    def linears(self) -> list:
        """Every weight matrix once (the tied embedding is the lm_head)."""
        out = [self.lm_head] + ([self.embed] if self.embed is not self.lm_head else [])
        for layer in self.layers:
            out += [layer.qkv, layer.o, layer.gate_up, layer.down]
        # A stacked linear as its row blocks: each is one weight in one format on one kernel.
        return [part for lin in out for part in getattr(lin, "parts", [lin])]

    @property
    def weight_bytes(self) -> int:
        return self.small_weight_bytes() + sum(lin.nbytes for lin in self.linears())

    def small_weight_bytes(self) -> int:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVStorage, lora=None) -> torch.Tensor:
        h = self.embed_rows(self.ops, input_ids)
        tables = self.rope_tables(positions)
        if lora is not None:
            lora.native = self.fused_decode.takes_adapters
        return self._forward(h, tables, meta, kv_cache, lora)

    def _forward(self, h: torch.Tensor, tables: list, meta: AttentionMetadata, kv_cache: PagedKVStorage,
                 lora=None) -> torch.Tensor:
        """lora: the rows' adapters (LoRABatch), or None; adapter rows take the path they would
        take without one (their delta is the same function on either, lora.py)."""
        nd, n = meta.num_decode, h.shape[0]
        fused_meta = decode_rows(meta)
        if nd == 0 or self.fused_decode.reason(fused_meta, nd, kv_cache) is not None:
            return self.layers_forward(self.ops.step(meta, kv_cache, lora), h, tables)
        # The decode rows through the fused stack, the other rows (if any) layer by layer: a
        # decode row's arithmetic is the same whatever shares its step.
        out = self.fused_decode.run(h[:nd], [(c[:nd], s[:nd]) for c, s in tables], fused_meta, kv_cache,
                                    lora if lora is None or nd == n else lora.rows(torch.arange(nd)))
        if nd == n:
            return out
        rest = [(c[nd:], s[nd:]) for c, s in tables]
        rest_lora = None if lora is None else lora.rows(torch.arange(nd, n))
        return torch.cat([out, self.layers_forward(self.ops.step(prompt_rows(meta), kv_cache, rest_lora), h[nd:], rest)])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the rows that sample or report logprobs come here: the vocab matmul is the
        # single most expensive op at small batch.
        return self.ops.logits(self.lm_head, self.final_norm(hidden))


def build_model(model_class: type[Model], config: ModelArchConfig, weights: dict, dtype: torch.dtype,
                backend: AttentionBackend, max_positions: int, prefill_dtype: torch.dtype | None = None,
                tp: TPCollectives | None = None) -> Model:
    """A family's model over its ops. prefill_dtype: the dtype of many-row GEMMs on kept-quantized
    weights (None: dtype). tp: this rank's collectives under tensor parallelism; `config` and
    `weights` are then its shard (kvshare.model.tensor_parallel)."""
    ops = Ops(dtype, backend, max_positions, prefill_dtype, tp, attention_softcap=config.attn_logit_softcap is not None)
    return model_class(config, weights, ops)


def decode_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of a step's decode rows alone (its first num_decode rows)."""
    if not meta.prefills:
        return meta
    nd = meta.num_decode
    layers = None if meta.layer_metadata is None else [decode_rows(m) for m in meta.layer_metadata]
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:nd], prefills=[], layer_metadata=layers)


def prompt_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of a step's prompt rows alone (those after its decode rows)."""
    nd = meta.num_decode
    layers = None if meta.layer_metadata is None else [prompt_rows(m) for m in meta.layer_metadata]
    chunks = [dataclasses.replace(c, query_start=c.query_start - nd) for c in meta.prefills]
    return AttentionMetadata(slot_mapping=meta.slot_mapping[nd:], prefills=chunks, layer_metadata=layers)
