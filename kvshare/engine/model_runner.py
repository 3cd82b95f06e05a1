"""Turns a scheduled step into tensors, runs the model, and returns only the logits needed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvshare.kvcache.manager import KVCacheManager
from kvshare.model.attention import AttentionMetadata, KVCache, PrefillChunk

_NEG_INF = float("-inf")


@dataclass
class StepLogits:
    # Rows that produce a next token, in the order of `sample_chunks`.
    sample_chunks: list[ScheduledChunk]
    sample_logits: torch.Tensor | None
    # Per chunk wanting prompt logprobs: (chunk, first position, logits [k, V]) for positions
    # first .. first+k-1, each predicting the prompt token after it.
    prompt_logits: list[tuple[ScheduledChunk, int, torch.Tensor]]


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, manager: KVCacheManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.manager = manager
        self.block_size = kv_cache.block_size

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(block_ids, dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // bs] * bs + pos % bs

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        tables = [self.manager.block_ids(c.seq.seq_id) for c in decode]
        for c in decode:
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start)
        slot_parts: list[torch.Tensor] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode))
        if decode:
            ctx = torch.tensor([c.start + 1 for c in decode])
            width = int(ctx.max())
            nblk = -(-width // bs)
            padded = torch.zeros(len(decode), nblk, dtype=torch.long)
            for r, t in enumerate(tables):
                t = t[:nblk]
                padded[r, :len(t)] = torch.tensor(t, dtype=torch.long)
            pos = torch.arange(width)
            meta.decode_slots = padded[:, pos // bs] * bs + pos % bs
            valid = pos.unsqueeze(0) < ctx.unsqueeze(1)
            bias = torch.zeros(len(decode), width)
            bias.masked_fill_(~valid, _NEG_INF)
            meta.decode_bias = bias.view(len(decode), 1, 1, width)
            last = (ctx - 1).unsqueeze(1)
            slot_parts.append(meta.decode_slots.gather(1, last).squeeze(1))
        row = len(decode)
        for c in prefill:
            ids.extend(c.seq.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            ctx_slots = self._slots(self.manager.block_ids(c.seq.seq_id), 0, c.end)
            q_pos = torch.arange(c.start, c.end).unsqueeze(1)
            k_pos = torch.arange(c.end).unsqueeze(0)
            meta.prefills.append(PrefillChunk(row, c.num_tokens, ctx_slots, k_pos <= q_pos))
            slot_parts.append(ctx_slots[c.start:])
            row += c.num_tokens
        meta.slot_mapping = torch.cat(slot_parts) if slot_parts else meta.slot_mapping
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def execute(self, sched: SchedulerOutput) -> StepLogits:
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)
        decode = [c for c in sched.chunks if c.num_tokens == 1]
        prefill = [c for c in sched.chunks if c.num_tokens > 1]
        ordered = decode + prefill
        input_ids, positions, meta = self.prepare(ordered)
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
