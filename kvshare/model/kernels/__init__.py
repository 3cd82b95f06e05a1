"""kvshare's optional C++ CPU kernels, by role: `build` (the compiler, the per-user cache and
`KernelLibrary`), `openmp` (the OpenMP runtime torch and the kernels share), and one module per
library with its ctypes bindings:

* `paged_attention.ATTENTION`: decode rows' attention straight from the paged KV cache, and a
  causal prompt chunk over its own keys.
* `qmatmul.QMATMUL`: int8 / int4 group-quantized matmuls (and VNNI blocks).
* `decode_step.DECODE`: a decode-only step's whole decoder stack in one call.
* `shm.SHM`: tensor-parallel all-reduces through shared memory.

`python -m kvshare.model.kernels --build` prebuilds them all (`make setup`).
"""
from __future__ import annotations

from kvshare.model.kernels.build import KernelLibrary, disabled_by_env
from kvshare.model.kernels.decode_step import DECODE
from kvshare.model.kernels.paged_attention import ATTENTION
from kvshare.model.kernels.qmatmul import QMATMUL
from kvshare.model.kernels.shm import SHM

LIBRARIES = (ATTENTION, QMATMUL, DECODE, SHM)


def build_all(timeout: float | None = None) -> list[KernelLibrary]:
    """Blocking: build (in parallel) or load every library; returns them (check `.path()`,
    `.unavailable_reason()`)."""
    for lib in LIBRARIES:
        lib._start()
    for lib in LIBRARIES:
        lib.wait_until_built(timeout)
    return list(LIBRARIES)


def start_background_builds() -> None:
    """Non-blocking: load every cached library, start building the missing ones."""
    if not disabled_by_env():
        for lib in LIBRARIES:
            lib.available()
