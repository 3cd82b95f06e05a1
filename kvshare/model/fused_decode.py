"""A decode-only step's whole decoder stack in one C++ call (csrc/decode_step.cpp).

At batch 1 the step-by-step forward issues ~15 small PyTorch ops and 5 kernel calls per layer;
their dispatch costs about as much as the matmuls themselves. `FusedDecode` hands the same
work to `kvs_decode_layers`, which runs it on the same int8/int4-group matmul and paged
attention kernels without returning to Python between ops.

It applies when every piece has a C++ counterpart, and says why not otherwise (`reason`):
float32 or bfloat16 activations (with bfloat16 the C++ step rounds each intermediate to bfloat16
where the step-by-step path rounds it, so both give a row nearly the same numbers), every layer's
linears on kvshare's group kernels (int8 or int4 codes, or row blocks of several such: a Q4_K_M
file's q/k/v), a float32 or bfloat16 KV cache, the C++ attention kernel in use (not Gemma 2's
soft-capping), a family whose layers a `Stack` describes (Model.fused_layers: the Llama layer
with Qwen3's per-head q/k norm, or Gemma 3's layer; RoPE over whole heads or, partial, their
first dims), and a step of decode rows only. Each layer attends with its own view of the rows:
with KV cache groups its group's slots and block tables, with sliding windows or attention sinks
each row's visible range in that layer. It runs a step's decode rows whatever other rows share
the step (kvshare.model.ops.Model.forward sends prompt rows layer by layer), each row under its
own LoRA adapter or none (the delta is C++'s, the same function the step-by-step path calls on
such a model: kvshare.model.lora). Anything else takes
the step-by-step path, which stays the reference: tests/test_fused_decode.py checks the two agree.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch

from kvshare.model.attention import AttentionMetadata, PagedKVStorage, TorchPagedAttention
from kvshare.model.kernels import decode_step, qmatmul
from kvshare.model.qlinear import (GroupInt4Linear, GroupInt8Linear, GroupIQ4NLLinear, GroupQ5PlanesLinear,
                                    GroupQ6PlanesLinear, StackedLinear)
from kvshare.model.tp_transport import ShmComm, ShmTransport

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_ACTIVATIONS = (torch.float32, torch.bfloat16)


@dataclasses.dataclass
class StackLayer:
    """One decoder layer as decode_step.cpp runs it: in_norm, qkv (+ qkv_b), each q and k head
    normalized by its row of qk_norm [heads + kv_heads, head_dim] (if any), RoPE from the call's
    table `rope_table`, attention, o (normalized by attn_out_norm, if any), the residual, post_norm
    (the norm before the MLP), gate_up, the gate's activation times up, down (normalized by
    mlp_out_norm, if any), the residual. Norm weights as the family's norm multiplies by them."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    qkv_b: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None
    rope_table: int = 0
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


@dataclasses.dataclass
class Stack:
    """A family's decoder stack as the fused step reads it (kvshare.model.ops.Model.fused_layers)."""

    layers: list[StackLayer]
    # Gemma: each RMSNorm computed in float32 and rounded to the activation dtype once (ops.norm_f32);
    # else Llama's (the normalized row rounded, then its product with the weight: layers.rms_norm).
    norm_once: bool = False
    gelu_tanh: bool = False  # Gemma: the MLP's gate is GELU (tanh approximation), not SiLU


class _Linear(ctypes.Structure):
    pass


_Linear._fields_ = [("kind", _i64), ("q", _ptr), ("scales", _ptr), ("zeros", _ptr), ("bias", _ptr),
                    ("N", _i64), ("K", _i64), ("group", _i64), ("parts", ctypes.POINTER(_Linear)),
                    ("num_parts", _i64), ("zero_mul", ctypes.c_double)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", _ptr), ("v_cache", _ptr), ("qk_norm", _ptr),
                ("rope_table", _i64), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr)]


class _LayerRows(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("tables", _ptr), ("max_blocks", _i64), ("ctx", _ptr), ("sink_end", _ptr),
                ("win_start", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("slots", _i64), ("block_size", _i64),
                ("cache_kind", _i64), ("act_bf16", _i64), ("eps", ctypes.c_double), ("scale", ctypes.c_double),
                ("layers", ctypes.POINTER(_Layer)), ("comm", ctypes.POINTER(ShmComm)), ("portable", _i64),
                ("norm_once", _i64), ("gelu_tanh", _i64), ("rope_dims", _i64)]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(lin, bias: torch.Tensor | None) -> _Linear | None:
    """The C view of one linear, or None when it is not on a group kernel the C++ side runs."""
    if type(lin) is StackedLinear:  # kind 5: its row blocks, each on its own group kernel
        parts = [_linear(p, None) for p in lin.parts]
        if any(p is None for p in parts):
            return None
        array = (_Linear * len(parts))(*parts)
        view = _Linear(5, None, None, None, _ptr_of(bias), lin.out_features, lin.in_features, 0, array, len(parts))
        view._keep = array  # (the parts' structs live as long as the view)
        return view
    if type(lin) not in (GroupInt8Linear, GroupInt4Linear, GroupIQ4NLLinear, GroupQ6PlanesLinear, GroupQ5PlanesLinear):
        return None
    # 1 int8 / 2 int4 codes in rows; 3 / 4 the same in VNNI blocks (the avx512-vnni path); 6 / 7 in
    # VNNI blocks with compact scales, 8 / 9 with float16 ones; 10 / 11 IQ4_XS's table indices in
    # VNNI blocks with float32 / compact scales; 12 / 13 Q6_K's planes likewise; 14 / 15 / 16 the
    # unsigned 5-bit planes (Q5_1, Q5_K) with float32 / compact / float16 scales, 17 / 18 / 19 Q5_0's
    # signed ones
    kind = 2 if lin.packed_int4 else 1
    if lin.blocks is not None and lin.blocks.planes5:
        kind = (17 if lin.blocks.planes5_signed else 14) + {"full": 0, "compact": 1, "half": 2}[lin.blocks.scale_form]
    elif lin.blocks is not None and lin.blocks.planes6:
        kind = {"full": 12, "compact": 13}[lin.blocks.scale_form]
    elif lin.blocks is not None and lin.blocks.iq4nl:
        kind = {"full": 10, "compact": 11}[lin.blocks.scale_form]
    elif lin.blocks is not None:
        kind += {"full": 2, "compact": 5, "half": 7}[lin.blocks.scale_form]
    zero_mul = 0.0 if lin.blocks is None else lin.blocks.zero_mul
    return _Linear(kind, lin.q.data_ptr(), lin.scale.data_ptr(), _ptr_of(lin.zero), _ptr_of(bias),
                   lin.out_features, lin.in_features, lin.group, None, 0, zero_mul)


class FusedDecode:
    """Built once per model (weights' pointers), bound once per KV cache (cache pointers)."""

    def __init__(self, model, stack: Stack | str) -> None:
        """stack: the model's layers as decode_step.cpp reads them, or why its family's layers
        have no C++ counterpart (kvshare.model.ops.Model.fused_layers)."""
        self.model = model
        unsupported = stack if isinstance(stack, str) else None
        self.stack = None if unsupported else stack
        self.model_layers = [] if unsupported else stack.layers
        self.enabled = True  # tests switch it off to run the step-by-step reference
        # Tests switch it on to run the C++ step's portable scalar element-wise code where AVX-512
        # would run (the two must give the same bits).
        self.portable = False
        self._layers = None
        # Weights put in VNNI blocks before the kernel library loaded are confirmed (or moved back
        # to rows) once it has, and the views (which hold their pointers) built anew, before the
        # first fused step.
        self._blocks_settled = False
        self._bound: tuple[int, ctypes.Structure] | None = None
        # Why this model can never take the fused path (None: it can, step by step permitting).
        self.model_reason = unsupported or self._check_model(model)
        if self.model_reason is None:
            self._layers = self._layer_views(model)
            if self._layers is None:
                self.model_reason = "a layer's linear is not on an int8/int4-group kernel"
        # Whether the C++ libraries are there, decided here, once (the engine loads them before it
        # builds the model): no step asks whether a build has finished since.
        self.library_reason = None if self.model_reason is not None else self._check_libraries(model)

    @staticmethod
    def _check_model(model) -> str | None:
        if model.dtype not in _ACTIVATIONS:
            return f"activations are {model.dtype}, not float32 or bfloat16"
        if not isinstance(model.backend, TorchPagedAttention):
            return f"attention backend is {type(model.backend).__name__}"
        # The C++ step runs the layers a family's Stack describes; features beyond them take the
        # step-by-step path. (longrope and a partial rotary embedding need nothing here: they only
        # change the cos/sin tables `run` is given, and their width.)
        tp = getattr(model, "tp", None)
        if tp is not None and not isinstance(tp.transport, ShmTransport):
            return "tensor parallel over gloo (the C++ step all-reduces through shared memory only)"
        return None

    @staticmethod
    def _check_libraries(model) -> str | None:
        if not model.backend.use_cpp_kernel:
            return "C++ kernels not available (the attention backend runs on PyTorch)"
        for library in (decode_step.DECODE, qmatmul.QMATMUL):
            why = library.settle()
            if why is not None:
                return f"C++ kernels not available ({library.name}: {why.splitlines()[0]})"
        return None

    def _layer_views(self, model) -> list[_Layer] | None:
        # The C++ side reads float32 norms and biases: float32 copies where the model holds
        # bfloat16 ones (a few KB per layer), kept alive here.
        self._float_copies: list = []

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
                return t
            self._float_copies.append(t.float().contiguous())
            return self._float_copies[-1]

        views = []
        for layer in self.model_layers:
            parts = [_linear(layer.qkv, f32(layer.qkv_b)), _linear(layer.o, None),
                     _linear(layer.gate_up, None), _linear(layer.down, None)]
            if any(p is None for p in parts):
                return None
            self._float_copies.extend(parts)  # a stacked view's row-block array, alive with the views
            views.append(_Layer(f32(layer.in_norm).data_ptr(), f32(layer.post_norm).data_ptr(), *parts, None, None,
                                _ptr_of(f32(layer.qk_norm)), layer.rope_table, _ptr_of(f32(layer.attn_out_norm)),
                                _ptr_of(f32(layer.mlp_out_norm))))
        return views

    @staticmethod
    def cache_reason(dtype: torch.dtype) -> str | None:
        """Why a KV cache stored as `dtype` keeps every step off the fused path (None: it does
        not); known when the engine is built, so the start-up block names it."""
        return None if dtype in _CACHE_KINDS else f"KV cache dtype {dtype} is not float32 or bfloat16"

    def reason(self, meta: AttentionMetadata, num_rows: int, kv_cache: PagedKVStorage) -> str | None:
        """Why this step cannot take the fused path, or None when it can."""
        if not self.enabled:
            return "disabled"
        if self.model_reason is not None:
            return self.model_reason
        if num_rows == 0 or meta.num_decode != num_rows or any(
                m.prefills or m.decode_block_tables is None or m.decode_context_lens is None
                for m in (meta.layer_metadata or [meta])):
            return "not a plain decode-only step"
        why = self.cache_reason(kv_cache.data.dtype)
        if why is not None or kv_cache.scales is not None:
            return why or f"KV cache dtype {kv_cache.data.dtype} carries scales"
        if self.library_reason is not None:
            return self.library_reason
        if not self.model.backend.use_cpp_kernel:
            return "C++ kernels not available"
        if not self._blocks_settled:
            for layer in self.model_layers:
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                    lin.check_blocks()
            # Views anew: a weight may have moved here or in an earlier prompt step's call.
            self._layers, self._bound = self._layer_views(self.model), None
            self._blocks_settled = True
        return None

    def _model_view(self, kv_cache: PagedKVStorage) -> ctypes.Structure:
        if self._bound is not None and self._bound[0] == id(kv_cache):
            return self._bound[1]
        m = self.model
        c = m.config
        layers = (_Layer * len(self._layers))(*self._layers)
        for i in range(len(self._layers)):
            k, v = kv_cache.layer(i)
            layers[i].k_cache, layers[i].v_cache = k.data_ptr(), v.data_ptr()
        view = _Model(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                      self.model_layers[0].down.in_features, kv_cache.num_blocks * kv_cache.block_size,
                      kv_cache.block_size, _CACHE_KINDS[kv_cache.data.dtype], int(m.dtype == torch.bfloat16),
                      c.rms_norm_eps, m.scale, layers, norm_once=int(self.stack.norm_once),
                      gelu_tanh=int(self.stack.gelu_tanh), rope_dims=c.rope_dims())
        tp = getattr(m, "tp", None)
        if tp is not None:  # the all-reduces go through the transport's own counter and segment
            view.comm = tp.transport.comm_ptr
        view._keep = (layers, kv_cache, tp)  # the pointers above live as long as these do
        self._bound = (id(kv_cache), view)
        return view

    def _layer_rows(self, meta: AttentionMetadata) -> tuple[ctypes.Array, list[torch.Tensor]]:
        """Each layer's view of the rows (its group's slots and tables, its window's ranges), as
        C structs, and the int64 tensors they point into. Layers whose metadata shares a tensor
        share its converted copy (the C++ side then checks their indices once)."""
        converted: dict[int, torch.Tensor] = {}

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if id(t) not in converted:
                converted[id(t)] = t.to(torch.int64).contiguous()
            return converted[id(t)].data_ptr()

        metas = meta.layer_metadata or [meta] * len(self.model_layers)
        views: dict[int, _LayerRows] = {}  # one struct per distinct metadata (layers of a group share one)
        for m in metas:
            if id(m) not in views:
                views[id(m)] = _LayerRows(ptr(m.slot_mapping), ptr(m.decode_block_tables), m.decode_block_tables.shape[1],
                                          ptr(m.decode_context_lens), ptr(m.decode_sink_end),
                                          ptr(m.decode_window_start))
        rows = (_LayerRows * len(metas))(*(views[id(m)] for m in metas))
        # The metadata too: an id above stays unique only while its tensor lives.
        return rows, [metas, list(converted.values())]

    @property
    def takes_adapters(self) -> bool:
        """Whether LoRA deltas are C++'s on this model (kvshare.model.lora): in the fused step, and
        through the same function for rows the step-by-step path takes. Known when it is built."""
        return self.model_reason is None and self.library_reason is None

    def run(self, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
            kv_cache: PagedKVStorage, lora=None) -> torch.Tensor:
        """h [rows, hidden] (embedded tokens, the model's dtype) through every layer; the last
        layer's output comes back in that dtype (in place when it is float32). tables: the rows'
        (cos, signed sin) of each RoPE table the layers use (Model.rope_tables). lora: the rows'
        adapters (kvshare.model.lora.LoRABatch over these rows), or None."""
        view = self._model_view(kv_cache)
        view.portable = int(self.portable)
        dtype = h.dtype
        h = h.float().contiguous()
        num_rows = h.shape[0]
        cos = torch.stack([c.reshape(num_rows, -1) for c, _ in tables]).float().contiguous()
        signed_sin = torch.stack([s.reshape(num_rows, -1) for _, s in tables]).float().contiguous()
        rows, keep = self._layer_rows(meta)
        adapters = None if lora is None else lora.c_rows(num_rows)
        err = ctypes.create_string_buffer(256)
        rc = decode_step.DECODE.lib().kvs_decode_layers(
            ctypes.byref(view), h.data_ptr(), h.shape[0], cos.data_ptr(), signed_sin.data_ptr(), rows,
            None if adapters is None else ctypes.byref(adapters), torch.get_num_threads(), err, len(err))
        del keep  # the index tensors `rows` points into, alive until here
        if view.comm:  # tensor parallel: a rank given up on while waiting
            self.model.tp.transport.raise_late_error()
        if rc:
            raise ValueError(err.value.decode(errors="replace"))
        return h.to(dtype)
