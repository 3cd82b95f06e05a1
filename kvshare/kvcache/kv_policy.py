"""Bounded KV per sequence: which keys each query sees, and which blocks a sequence can let go of.

Plain integers only: what a query sees is a `MaskSpec` per attention variant, and the model side
turns it into mask tensors (kvshare/model/attention_masks.py); the bookkeeping knows no tensors.

Everything here is in text positions (the token's index in the sequence), which are also the
block-table indices: a released block leaves a `None` placeholder in its table, so block i
always holds positions [i * block_size, (i + 1) * block_size).

`SlidingWindow` is the model's own attention (Mistral `sliding_window`, Qwen2 `layer_types`),
with HF transformers' semantics: a query at t sees key k iff k <= t and t - k < window, per layer
(None = global). A block is released once no later query of any layer can see it, so nothing is
released when any layer is global.

`SinkWindow` is StreamingLLM (Xiao et al., 2023), an opt-in approximation: a query at t sees the
first `sink_tokens` tokens plus the recent blocks holding the last `window_tokens` positions
(between window_tokens and window_tokens + block_size - 1 tokens, as blocks are dropped whole).
Block 0 holds the sinks: its other tokens are masked once the window has passed them, and blocks
1.. are dropped. Positions inside the cache, not in the text, feed RoPE, as in the paper: the
sinks sit at 0..sink_tokens-1 and the window right after them, so when tokens leave the cache
the kept keys are re-rotated back by as many positions (`rope_offset` says by how many in all).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MaskSpec:
    """What a query at text position t sees, as plain ints: keys k <= t, within the last `window`
    positions (None: no window), and under attention sinks (`sink_window` set) the first
    `sink_tokens` keys plus the blocks of `block_size` reaching into the last `sink_window`
    positions (blocks are dropped whole)."""

    window: int | None = None
    sink_tokens: int = 0
    sink_window: int | None = None
    block_size: int = 1

    def decode_range(self, t: int) -> tuple[int, int]:
        """(sink_end, window_start): a query at t sees [0, sink_end) and [window_start, t]."""
        if self.sink_window is not None:
            return self.sink_tokens, max(0, (t + 1 - self.sink_window) // self.block_size) * self.block_size
        return self.sink_tokens, 0 if self.window is None else max(0, t - self.window + 1)


CAUSAL = MaskSpec()


@dataclass(frozen=True)
class FullAttention:
    """The null policy: plain causal attention over every earlier key, nothing ever released.
    Same interface as the bounded policies below, so no caller special-cases "no policy"."""

    block_size: int
    num_layers: int = 1
    generates_past_max_model_len = False

    @property
    def layer_variants(self) -> tuple[MaskSpec, ...]:
        return (CAUSAL,) * self.num_layers

    @property
    def variants(self) -> list[MaskSpec]:
        return [CAUSAL]

    @property
    def plain_until(self) -> float:
        return float("inf")  # every query sees every earlier key

    @property
    def keep_head(self) -> int:
        return 0

    def released_blocks(self, start: int) -> int:
        return 0

    def rope_offset(self, start: int) -> int:
        return 0

    def chunk_limit(self, start: int) -> int | None:
        return None

    def publishable_blocks(self) -> int | None:
        return None

    def max_blocks_per_seq(self, chunk_tokens: int) -> int | None:
        return None

    @property
    def decode_blocks(self) -> int | None:
        return None


@dataclass(frozen=True)
class SlidingWindow:
    windows: tuple[int | None, ...]  # per layer
    block_size: int
    # Positions stay text positions: a sequence still ends at max_model_len.
    generates_past_max_model_len = False

    @property
    def layer_variants(self) -> tuple[MaskSpec, ...]:
        return tuple(MaskSpec(window=w) for w in self.windows)

    @property
    def variants(self) -> list[MaskSpec]:
        return [MaskSpec(window=w) for w in sorted(set(self.windows), key=lambda w: (w is None, w or 0))]

    @property
    def plain_until(self) -> int:
        """Queries before this position see every earlier key: plain causal attention."""
        return min(w for w in self.windows if w is not None)

    @property
    def keep_head(self) -> int:
        return 0  # no block is kept for its own sake

    @property
    def release_window(self) -> int | None:
        bounded = [w for w in self.windows if w is not None]
        return None if len(bounded) < len(self.windows) else max(bounded)

    def released_blocks(self, start: int) -> int:
        """Blocks [0, n) hold no key any query at `start` or later sees, in any layer."""
        w = self.release_window
        return 0 if w is None else max(0, (start - w + 1) // self.block_size)

    def rope_offset(self, start: int) -> int:
        return 0

    def chunk_limit(self, start: int) -> int | None:
        return None

    def publishable_blocks(self) -> int | None:
        return None  # windowed KV equals what any later request with this prefix computes

    def max_blocks_per_seq(self, chunk_tokens: int) -> int | None:
        """Most blocks a sequence holds while computing a chunk of `chunk_tokens` (None: unbounded)."""
        w = self.release_window
        if w is None:
            return None
        return (w + chunk_tokens - 2) // self.block_size + 2

    @property
    def decode_blocks(self) -> int | None:
        """Most blocks a decoding sequence holds: ceil(window / block_size) + 1 at worst."""
        return self.max_blocks_per_seq(1)


@dataclass(frozen=True)
class SinkWindow:
    sink_tokens: int
    window_tokens: int
    block_size: int
    max_positions: int  # RoPE table size: cache positions stay below it
    num_layers: int
    # Cache positions stay below max_model_len however long the sequence grows.
    generates_past_max_model_len = True

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(sink_tokens=self.sink_tokens, sink_window=self.window_tokens, block_size=self.block_size)

    @property
    def layer_variants(self) -> tuple[MaskSpec, ...]:
        return (self.mask,) * self.num_layers

    @property
    def variants(self) -> list[MaskSpec]:
        return [self.mask]

    @property
    def plain_until(self) -> int:
        # The first query whose window has left block 0 behind.
        return self.window_tokens + self.block_size - 1

    @property
    def keep_head(self) -> int:
        return 1  # block 0 holds the sinks

    def evicted(self, t: int) -> int:
        """Leading blocks whose every position is older than the recent window of a query at t."""
        return max(0, (t + 1 - self.window_tokens) // self.block_size)

    def released_blocks(self, start: int) -> int:
        return self.evicted(start)  # [keep_head, n): block 0 stays for its sinks

    def rope_offset(self, start: int) -> int:
        """How far the kept non-sink keys have moved back: dropped blocks plus block 0's masked
        tail, so the window starts right after the sinks."""
        e = self.evicted(start)
        return 0 if e == 0 else e * self.block_size - self.sink_tokens

    def chunk_limit(self, start: int) -> int:
        """Tokens a chunk from `start` may hold so its last cache position has a RoPE entry."""
        return self.max_positions + self.rope_offset(start) - start

    def publishable_blocks(self) -> int:
        """Blocks whose queries all ran before any masking, with text positions as cache
        positions: their KV is what any request with this prefix computes. A position at
        plain_until - 1 or later may have seen a masked block 0 (within the same chunk)."""
        return (self.plain_until - 1) // self.block_size

    def max_blocks_per_seq(self, chunk_tokens: int) -> int:
        """Most blocks a sequence holds while computing a chunk of `chunk_tokens`."""
        return (self.window_tokens + chunk_tokens - 2) // self.block_size + 3

    @property
    def decode_blocks(self) -> int:
        """Most blocks a decoding sequence holds: block 0, the blocks reaching into the last
        window_tokens positions, and the one the next token starts."""
        return (self.window_tokens + self.block_size - 2) // self.block_size + 2

    @property
    def max_decode_position(self) -> int:
        return self.window_tokens + self.block_size - 2 + self.sink_tokens


AttentionPolicy = FullAttention | SlidingWindow | SinkWindow


def build_kv_policy(config, arch, max_model_len: int) -> AttentionPolicy:
    """The policy for an engine (FullAttention when nothing bounds the KV), or ValueError
    saying what to change."""
    windows = tuple(arch.attention_windows())
    has_windows = any(w is not None for w in windows)
    if config.kv_policy is None:
        return SlidingWindow(windows, config.block_size) if has_windows else FullAttention(config.block_size,
                                                                                             arch.num_layers)
    if has_windows:
        raise ValueError(f"kv_policy={config.kv_policy!r} cannot be combined with this model's own sliding "
                         f"window(s) {sorted({w for w in windows if w})}: leave kv_policy unset")
    if (arch.rope_scaling or {}).get("rope_type") == "longrope":
        # Re-rotation composes one rotation per shift; longrope's frequencies change along the
        # positions (short / long factors), so a moved key would carry the wrong ones.
        raise ValueError("kv_policy='sink' cannot be used with longrope RoPE scaling (Phi-3): leave kv_policy unset")
    policy = SinkWindow(config.sink_tokens, config.window_tokens, config.block_size, max_model_len,
                        arch.num_layers)
    if policy.max_decode_position >= max_model_len:
        raise ValueError(
            f"kv_policy='sink' with window_tokens={config.window_tokens}, sink_tokens={config.sink_tokens}, "
            f"block_size={config.block_size} places tokens at cache positions up to {policy.max_decode_position}, "
            f"beyond max_model_len={max_model_len}: lower window_tokens to at most "
            f"{max_model_len - config.block_size + 1 - config.sink_tokens}")
    return policy
