"""The step plan: the one contract between the scheduler and the model runner.

The scheduler (with the KV manager) decides everything about a step: which sequences compute
which positions, which blocks each reads and which slots it writes, the block copies and key
re-rotations to perform first, and which rows' logits are needed. The runner turns this into
tensors and runs the model; it knows nothing of block tables, the manager or the policy's
bookkeeping. Plain data only (numbers, strings, lists, tuples): sequences are named by id, never
by the engine's records, so a plan can be compared, logged and sent to tensor-parallel workers
as it is (kvshare/engine/wire.py derives that form from the fields). Nothing here imports from
`kvshare.kvcache` or the engine's request records.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GroupAccess:
    """A chunk's writes and reads in one KV cache group. Every model has at least one group; a
    hybrid model has one per attention type, each with its own block table per sequence over the
    same pool."""

    write_slots: list[int]
    read_blocks: list[int]
    read_index: list[int] | None


@dataclass
class ChunkPlan:
    """One sequence's part of a step."""

    seq_id: str  # the sequence (the engine resolves it: Scheduler.scheduled_seqs)
    start: int  # first text position computed
    token_ids: list[int]  # the tokens computed: positions start .. start + len - 1
    rope_start: int  # RoPE position of the first (text position minus the sequence's rope offset)
    # The chunk's writes and reads, one entry per KV cache group (index = group). In each:
    # write_slots, the KV cache slot of each computed token; read_blocks, the block ids attention
    # walks in table order (blocks still held only); read_index, the table index of each block
    # read when the sequence no longer holds all of its blocks (windows, sinks), else None
    # (table indices 0 .. len(read_blocks) - 1).
    kv: tuple[GroupAccess, ...]
    samples: bool  # the last row yields the next token
    # Rows whose logits score prompt tokens (prompt_logprobs): (first position, count); position
    # p's logits predict the prompt token at p + 1.
    prompt_logits: tuple[int, int] | None = None
    # The LoRA adapter the rows run under (its cache key, kvshare.model.lora.LoRAAdapter.key), or None.
    adapter: str | None = None

    def access(self, group: int) -> GroupAccess:
        """The writes and reads of KV cache group `group`."""
        return self.kv[group]

    @property
    def blocks_read(self) -> int:
        """Blocks attention walks, over every group (the scheduler orders decode rows by it)."""
        return sum(len(a.read_blocks) for a in self.kv)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_keys(self) -> int:
        """Keys visible to the chunk's last row under plain causal attention (its own included)."""
        return self.end

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1


@dataclass
class StepPlan:
    # Decode rows first (by how many blocks they read, then position), then prefill chunks.
    chunks: list[ChunkPlan] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # ids of the sequences preempted planning it
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    # Sink sequences' kept keys to re-rotate after the copies: (seq id, block ids, position shift).
    rotations: list[tuple[str, list[int], int]] = field(default_factory=list)
    # KV moving between the pool and the KV tiers (host RAM, disk: kvshare/kvcache/kv_tiers.py), as
    # (block id, tier key) pairs, the tier key being what the tiers keep that KV under (the block's
    # hash). The runner applies them before anything else in the step, in this order: stores copy
    # out the KV of blocks evicted while planning this step (before the step overwrites them),
    # loads fill pool blocks from the RAM tier (so this step can read them), drops forget entries
    # the tiers pushed out: (tier name, key, KV cache group: part of a disk file's name).
    block_stores: list[tuple[int, bytes]] = field(default_factory=list)
    block_loads: list[tuple[int, bytes]] = field(default_factory=list)
    tier_drops: list[tuple[str, bytes, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def is_empty(self) -> bool:
        return not self.chunks

    def logit_rows(self) -> tuple[list[int], list[tuple[ChunkPlan, int, int, int]], list[ChunkPlan]]:
        """Rows of the packed batch whose logits are needed: prompt-logprob rows first, then one
        sampling row per sampling chunk. Returns (rows, prompt spans as (chunk, first position,
        first row in `rows`, count), sampling chunks in row order)."""
        rows: list[int] = []
        spans: list[tuple[ChunkPlan, int, int, int]] = []
        offset = 0
        for c in self.chunks:
            if c.prompt_logits is not None:
                first, count = c.prompt_logits
                spans.append((c, first, len(rows), count))
                rows.extend(range(offset + first - c.start, offset + first - c.start + count))
            offset += c.num_tokens
        sampling: list[ChunkPlan] = []
        offset = 0
        for c in self.chunks:
            if c.samples:
                rows.append(offset + c.num_tokens - 1)
                sampling.append(c)
            offset += c.num_tokens
        return rows, spans, sampling
