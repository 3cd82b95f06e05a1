"""What the engine reports about itself at start-up: the KV pool's layout and the start-up block
(what was loaded, how it is stored and run, how long it took)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Iterable, Protocol

from kvshare.config import EngineConfig
from kvshare.model.numerics import NumericsPolicy


@dataclass
class KVLayout:
    """The KV pool as sized at start-up: bytes per token, blocks, and the length limit."""

    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    dtype: str
    # KV cache groups (hybrid models): how many, and how many blocks one sequence of
    # max_model_len holds across them (0: one group, max_model_len / block_size blocks).
    num_kv_groups: int = 1
    max_len_seq_blocks: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @property
    def max_len_seqs(self) -> float:
        if self.max_len_seq_blocks:
            return self.num_blocks / self.max_len_seq_blocks
        return self.num_slots / self.max_model_len

    def describe(self) -> str:
        # With groups, bytes/token is per block slot: one group's layers, not the whole model's.
        groups = "" if self.num_kv_groups == 1 else f", {self.num_kv_groups} KV cache groups sharing the blocks"
        return (
            f"KV cache: {self.bytes_per_token} bytes/token ({self.dtype}{groups}), {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.num_slots} token slots ({self.pool_bytes / 2**20:.1f} MiB); "
            f"{self.max_len_seqs:.2f} sequences of max_model_len={self.max_model_len} fit"
        )


class ReportedLinear(Protocol):
    """What the start-up block reads of one weight matrix, whatever its storage."""

    @property
    def kind(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


class ReportedModel(Protocol):
    """What the start-up block reads of a model, whatever its family."""

    @property
    def backend(self) -> object: ...

    @property
    def weight_bytes(self) -> int: ...

    def linears(self) -> Iterable[ReportedLinear]: ...


@dataclass
class StartupReport:
    """The start-up block: what was loaded, how it is stored and run, and how long it took."""

    source: str
    tensor_types: dict[str, str]
    model: ReportedModel
    config: EngineConfig
    layout: KVLayout
    load_seconds: float
    ready_seconds: float
    tp_transport: str = ""  # how tensor-parallel ranks exchange data ("" without tensor parallelism)
    numerics: NumericsPolicy | None = None  # the kernel each kind of row takes, fixed at build
    transparency: tuple[str, ...] | None = None  # why sharing may show in a request's bits (empty: it cannot)
    build_seconds: float | None = None  # of ready_seconds: the layers built (weights into the kernels' layouts)
    build_threads: int = 0

    def format_mix(self) -> dict[str, int]:
        mix: dict[str, int] = {}
        for t in self.tensor_types.values():
            mix[t] = mix.get(t, 0) + 1
        return dict(sorted(mix.items(), key=lambda kv: -kv[1]))

    def weight_bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lin in self.model.linears():
            out[lin.kind] = out.get(lin.kind, 0) + lin.nbytes
        return out

    def kernels(self) -> list[str]:
        names = {"int8-group": "int8 per-group (kvshare C++ qmatmul)",
                 "int4-group": "int4 per-group (kvshare C++ qmatmul)", "dense": "dense (F.linear)",
                 "int8-group+vnni": "int8 per-group in VNNI blocks (kvshare C++ qmatmul, avx512-vnni: decode rows' "
                                    "x rounded to int16 per group)",
                 "int4-group+vnni": "int4 per-group in VNNI blocks (kvshare C++ qmatmul, avx512-vnni: decode rows' "
                                    "x rounded to int16 per group)",
                 "iq4nl-group+vnni": "IQ4_XS 4-bit table indices in VNNI blocks (kvshare C++ qmatmul, avx512-vnni)",
                 "q6planes-group+vnni": "Q6_K 4-bit + 2-bit planes in VNNI blocks (kvshare C++ qmatmul, avx512-vnni)",
                 "q5planes-group+vnni": "Q5_0 / Q5_1 / Q5_K 4-bit + 1-bit planes in VNNI blocks (kvshare C++ qmatmul, "
                                        "avx512-vnni)"}
        counts: dict[str, int] = {}
        for lin in self.model.linears():
            key = lin.kind + ("+vnni" if getattr(lin, "blocks", None) is not None else "")
            counts[key] = counts.get(key, 0) + 1
        out = [f"{names.get(k, k)} x{n}" for k, n in counts.items()]
        backend = self.model.backend
        out.append("decode attention: " + ("kvshare C++ paged kernel" if getattr(backend, "use_cpp_kernel", False)
                                           else "PyTorch (C++ kernel unavailable or not wanted)"))
        fused = getattr(self.model, "fused_decode", None)
        if fused is not None:
            why = fused.model_reason or fused.library_reason or fused.cache_reason(self.config.kv_format.storage)
            out.append("decode steps: " + ("one C++ call per step (kvshare fused decode)" if why is None
                                           else f"layer by layer ({why})"))
        return out

    def lines(self) -> list[str]:
        c = self.config
        mode = ("exact (dequantized float32)" if c.exact else
                f"{'kept quantized' if c.quantization == 'auto' else 'dequantized'} weights, {c.dtype} activations"
                + (f", {c.prefill_dtype} prefill GEMMs" if c.quantization == "auto" and c.prefill_dtype != c.dtype
                   and not (self.numerics is not None and self.numerics.token_rows) else ""))
        mix = ", ".join(f"{t} x{n}" for t, n in self.format_mix().items()) or "dense checkpoint"
        by_kind = ", ".join(f"{k} {b / 2**20:.1f} MiB" for k, b in self.weight_bytes_by_kind().items())
        tp = getattr(self.model, "tp", None)
        return [
            f"model: {self.source}",
            *([self._tensor_parallel_line(tp.shard)] if tp is not None else []),
            f"  mode: {mode}",
            f"  tensor formats: {mix}",
            f"  resident weights: {self.model.weight_bytes / 2**20:.1f} MiB ({by_kind})",
            f"  kernels: {'; '.join(self.kernels())}",
            *([f"  numerics: {self.numerics.describe()}"] if self.numerics is not None else []),
            *([self._transparency_line()] if self.transparency is not None else []),
            f"  {self.layout.describe()}",
            self._timing_line(),
        ]

    def _timing_line(self) -> str:
        if self.build_seconds is None:
            return f"  weights loaded in {self.load_seconds:.2f} s; engine ready in {self.ready_seconds:.2f} s"
        # Where the start-up time went: the file mapped and its header and tokenizer read (the load),
        # then every layer built from the weights (kept-quantized ones repacked from the file's
        # blocks into the kernels' layouts), then the rest (KV cache, checks).
        return (f"  weights loaded in {self.load_seconds:.2f} s (file mapped, header and tokenizer read), layers "
                f"built in {self.build_seconds:.2f} s on {self.build_threads} threads (weights repacked into the "
                f"kernels' layouts); engine ready in {self.ready_seconds:.2f} s")

    def _transparency_line(self) -> str:
        if not self.transparency:
            return ("  sharing: bit-transparent (a request's tokens and logprobs do not depend on its batch, the prefix "
                    "cache or chunking)")
        return "  sharing: not bit-transparent: " + "; ".join(self.transparency) + " (docs/transparency.md)"

    def _tensor_parallel_line(self, shard) -> str:
        (q0, q1), (k0, k1), (m0, m1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.mlp, shard.vocab
        return (f"  tensor parallel: {shard.size} ranks over {self.tp_transport}; this process is rank 0 with query "
                f"heads {q0}-{q1 - 1}, KV heads {k0}-{k1 - 1}, MLP columns {m0}-{m1 - 1}, vocabulary rows {v0}-{v1 - 1} "
                f"(the resident weights below are rank 0's)")


def release_freed_heap() -> None:
    """glibc keeps freed heap pages (here: the GGUF conversion's temporaries, tens of MB) as
    RSS until asked to return them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do
