"""Turns a scheduled step into tensors, runs the model, and returns only the logits needed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvshare.kvcache.manager import KVCacheManager
from kvshare.model.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillChunk

_NEG_INF = float("-inf")


@dataclass
class StepLogits:
    # Rows that produce a next token, in the order of `sample_chunks`.
    sample_chunks: list[ScheduledChunk]
    sample_logits: torch.Tensor | None
    # Per chunk wanting prompt logprobs: (chunk, first position, logits [k, V]) for positions
    # first .. first+k-1, each predicting the prompt token after it.
    prompt_logits: list[tuple[ScheduledChunk, int, torch.Tensor]]


# Cost model for splitting decode rows into padded groups: each extra group costs a few ops per
# layer; each padded key slot costs a read of K and V in every layer.
_GROUP_OVERHEAD_SLOTS = 1024


def group_by_length(ctx_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split rows (sorted by context length) into [start, end) groups minimizing padded slots
    plus a fixed cost per group: a small dynamic program over the distinct padded widths."""
    n = len(ctx_lens)
    if n == 0:
        return []
    padded = [-(-x // block_size) * block_size for x in ctx_lens]
    # Runs of equal width never need splitting: cut points are the run boundaries.
    bounds = [0] + [i for i in range(1, n) if padded[i] != padded[i - 1]] + [n]
    m = len(bounds) - 1
    best = [0.0] + [float("inf")] * m
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        width = padded[bounds[j] - 1]
        for i in range(j):
            cost = best[i] + _GROUP_OVERHEAD_SLOTS + (bounds[j] - bounds[i]) * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = m
    while j > 0:
        groups.append((bounds[cut[j]], bounds[j]))
        j = cut[j]
    return groups[::-1]


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, manager: KVCacheManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.manager = manager
        self.block_size = kv_cache.block_size

    def prepare(self, decode: list[ScheduledChunk], prefill: list[ScheduledChunk]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed inputs for decode rows (sorted by context length) followed by prefill chunks."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode))
        tables = [self.manager.block_ids(c.seq.seq_id) for c in decode]
        for c, t in zip(decode, tables):
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start)
            slots.append(t[c.start // bs] * bs + c.start % bs)
        ctx_lens = [c.start + 1 for c in decode]
        if decode:
            width = -(-max(ctx_lens) // bs)
            meta.decode_block_tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables],
                                                    dtype=torch.long)
            meta.decode_context_lens = torch.tensor(ctx_lens, dtype=torch.long)
        groups = group_by_length(ctx_lens, bs) if self.model.backend.wants_decode_groups else []
        for r0, r1 in groups:
            # Rows are sorted by context length: the group's last row sets its padded width.
            width = -(-ctx_lens[r1 - 1] // bs)
            table = meta.decode_block_tables[r0:r1, :width]
            ctx = meta.decode_context_lens[r0:r1]
            bias = torch.zeros(r1 - r0, width * bs)
            bias.masked_fill_(torch.arange(width * bs).unsqueeze(0) >= ctx.unsqueeze(1), _NEG_INF)
            meta.decode_groups.append(DecodeGroup(r0, r1 - r0, table, bias.view(1, r1 - r0, 1, width * bs)))
        row = len(decode)
        for c in prefill:
            ids.extend(c.seq.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            table = self.manager.block_ids(c.seq.seq_id)[:-(-c.end // bs)]
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            q_pos = torch.arange(c.start, c.end).unsqueeze(1)
            k_pos = torch.arange(len(table) * bs).unsqueeze(0)
            meta.prefills.append(PrefillChunk(row, c.num_tokens, torch.tensor(table, dtype=torch.long), k_pos <= q_pos))
            row += c.num_tokens
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def execute(self, sched: SchedulerOutput) -> StepLogits:
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)
        decode = sorted((c for c in sched.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefill = [c for c in sched.chunks if c.num_tokens > 1]
        ordered = decode + prefill
        input_ids, positions, meta = self.prepare(decode, prefill)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)

        rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_spans: list[tuple[ScheduledChunk, int, int, int]] = []  # chunk, first pos, row0, count
        offset = 0
        for c in ordered:
            seq = c.seq
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done():
                have = len(seq.prompt_logprobs)  # entry 0 (the first prompt token) is None
                first = max(c.start, have - 1)
                last = min(c.end, seq.num_prompt_tokens - 1)  # exclusive: position p predicts p+1
                if last > first:
                    prompt_spans.append((c, first, len(rows), last - first))
                    rows.extend(range(offset + first - c.start, offset + last - c.start))
            if c.samples:
                sample_chunks.append(c)
            offset += c.num_tokens
        sample_row0 = len(rows)
        offset = 0
        for c in ordered:
            if c.samples:
                rows.append(offset + c.num_tokens - 1)
            offset += c.num_tokens
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)]) if rows else None
        prompt_logits = [(c, first, logits[r0:r0 + k]) for c, first, r0, k in prompt_spans]
        sample_logits = logits[sample_row0:] if sample_chunks else None
        return StepLogits(sample_chunks, sample_logits, prompt_logits)
