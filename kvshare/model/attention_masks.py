"""Attention masks from a KV group's plain visibility spec (kvshare.kvcache.kv_policy.MaskSpec:
window, sinks, block size as ints). The bookkeeping says what a query may see; the tensors are
built here, on the model side, so `kvcache/` stays free of torch."""
from __future__ import annotations

import torch


def visible(spec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """True where a query at text position q may attend to the key at text position k (broadcast)."""
    mask = k <= q
    if spec.window is not None:
        mask = mask & (q - k < spec.window)
    if spec.sink_window is not None:
        dropped = torch.clamp((q + 1 - spec.sink_window) // spec.block_size, min=0)  # leading blocks left behind
        mask = mask & ((k < spec.sink_tokens) | (k // spec.block_size >= dropped))
    return mask
