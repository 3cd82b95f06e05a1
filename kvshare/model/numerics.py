"""The engine's numerics policy: which kernel each kind of row takes, decided once, when the engine
is built.

A row's arithmetic may depend on the mode, the row's kind and its own shape, never on the clock:
so every C++ library the mode needs is loaded (or compiled) before the first step, and what was
decided then holds for the engine's life (nothing on a step's path asks whether a background
build has finished). A library the mode needs that cannot be loaded stops the start with
`MissingKernelError`, naming the library and why; one the mode can do without is replaced by
its PyTorch path, and the choice recorded (`NumericsPolicy`, in the start-up log).

Modes:
- "exact" (EngineConfig.exact: dequantized float32, the HF-parity reference) needs no C++
  library: decode rows' attention takes the C++ paged kernel where it loads (float32 math, within
  1e-5 of the PyTorch path), else the PyTorch path.
- "default" (everything else) needs the paged attention kernel and, for kept-quantized weights,
  the group matmuls and the fused decode step. Its rows are token rows (`token_rows`): every row
  of a step, prompt rows included, takes the decode rows' arithmetic (its own block table and
  context length through the paged attention kernel, the packed group matmuls, the fused stack
  where the family has one), so a token's hidden states, K/V and logits depend only on its token,
  its position and the K/V it attends to: never on its batch, its chunk, or whether the keys it
  reads were just computed or came from the prefix cache (issue 28, docs/transparency.md).
KVSHARE_DISABLE_CPP_KERNELS=1 chooses the PyTorch paths in either mode, and so needs nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshare.model.kernels import build, decode_step, paged_attention, qmatmul

EXACT, DEFAULT = "exact", "default"
MODES = (EXACT, DEFAULT)

# Library name -> what it computes (for the record and the refusal).
LIBRARY_ROLES = {
    "paged_attention": "decode rows' attention over the paged KV cache",
    "qmatmul": "the int8 / int4 group matmuls of kept-quantized weights",
    "decode_step": "the fused decode step over kept-quantized weights",
}


class MissingKernelError(RuntimeError):
    """The mode needs a C++ kernel library that cannot be loaded here."""


@dataclass(frozen=True)
class NumericsPolicy:
    mode: str
    kernels: tuple[tuple[str, str], ...]  # (row kind, the kernel its rows take), in a fixed order
    libraries: tuple[tuple[str, str | None], ...]  # (library, why it is not used; None: used)
    # Every row of a step as a row of its own, on the decode rows' kernels (the default mode with
    # the C++ attention kernel): one arithmetic per token row.
    token_rows: bool = False

    def uses(self, library: str) -> bool:
        """Whether rows run on this C++ library (False for one the mode does not ask for)."""
        return dict(self.libraries).get(library, "not needed") is None

    def kernel(self, row_kind: str) -> str:
        return dict(self.kernels)[row_kind]

    def describe(self) -> str:
        rows = "; ".join(f"{kind}: {kernel}" for kind, kernel in self.kernels)
        missing = [f"{name} ({why.splitlines()[0]})" for name, why in self.libraries if why is not None]
        return f"{self.mode} mode; {rows}" + (f"; PyTorch in place of {', '.join(missing)}" if missing else "")


def needed_libraries(mode: str, kept_quantized: bool) -> tuple[list[str], list[str]]:
    """(the libraries the mode needs, those it uses where they load)."""
    if mode not in MODES:
        raise ValueError(f"numerics mode {mode!r} is not one of {MODES}")
    if mode == EXACT:
        return [], ["paged_attention"]
    return ["paged_attention"] + (["qmatmul", "decode_step"] if kept_quantized else []), []


def resolve_numerics(mode: str, kept_quantized: bool, unavailable: Mapping[str, str | None], disabled: bool = False,
                     attention_paths: Sequence[str] = ()) -> NumericsPolicy:
    """The policy from a capability set: `unavailable` maps each library `needed_libraries` names
    to why it cannot be loaded (None: loaded); `disabled`: KVSHARE_DISABLE_CPP_KERNELS is set (the
    PyTorch paths chosen, nothing needed); `attention_paths`: the paged attention library's CPU
    paths. Raises MissingKernelError for a library the mode needs that is unavailable."""
    required, optional = needed_libraries(mode, kept_quantized)
    for name in required:
        why = unavailable[name]
        if why is not None and not disabled:
            raise MissingKernelError(
                f"kvshare's {mode} mode needs the C++ kernel library {name!r} ({LIBRARY_ROLES[name]}), which cannot "
                f"be loaded: {why}\nBuild it with `make setup` (python -m kvshare.model.kernels --build), or run the "
                f"pure-PyTorch paths with {build.DISABLE_ENV}=1, or the exact mode (quantization=None, "
                f"dtype='float32').")
    libraries = tuple((name, unavailable[name]) for name in required + optional)
    used = {name for name, why in libraries if why is None}
    kernels = [("decode attention", "C++ paged kernel" if "paged_attention" in used
                else "PyTorch (padded gather, matmul-softmax)")]
    token_rows = mode == DEFAULT and "paged_attention" in used
    causal = "paged_attention" in used and "avx512" in attention_paths
    if token_rows:
        kernels.append(("prompt attention", "as decode rows (C++ paged kernel, each row over its own keys)"))
    else:
        kernels.append(("prompt attention", "C++ causal kernel for float32 chunks from position 0, else SDPA"
                        if causal else "SDPA"))
    if kept_quantized:
        packed = "C++ int8 / int4 group matmul"
        kernels.append(("decode linears", packed if "qmatmul" in used else "dense copies of the dequantized weights"))
        kernels.append(("prompt linears", ("as decode rows (" + packed + ")" if token_rows else
                                           "dense GEMM over a dequantized scratch") if "qmatmul" in used
                        else "dense copies of the dequantized weights"))
    else:
        kernels += [("decode linears", "dense"), ("prompt linears", "dense")]
    kernels.append(("decode steps", ("one fused C++ call where the model and row allow (prompt rows too), else layer by "
                                     "layer" if token_rows else
                                     "one fused C++ call where the model and step allow, else layer by layer")
                    if "decode_step" in used else "layer by layer"))
    return NumericsPolicy(mode, tuple(kernels), libraries, token_rows)


_LIBRARIES = {"paged_attention": lambda: paged_attention.ATTENTION, "qmatmul": lambda: qmatmul.QMATMUL,
              "decode_step": lambda: decode_step.DECODE}


def probe_libraries(names: Sequence[str]) -> dict[str, str | None]:
    """Blocking: load (or compile) each library now; why each cannot be used (None: it can)."""
    return {name: _LIBRARIES[name]().settle() for name in names}


def numerics_for(exact: bool, kept_quantized: bool) -> NumericsPolicy:
    """The policy of an engine being built here: its libraries loaded before it runs a step."""
    mode = EXACT if exact else DEFAULT
    required, optional = needed_libraries(mode, kept_quantized)
    unavailable = probe_libraries(required + optional)
    paths = paged_attention.cpu_paths() if unavailable.get("paged_attention") is None else []
    return resolve_numerics(mode, kept_quantized, unavailable, build.disabled_by_env(), paths)
