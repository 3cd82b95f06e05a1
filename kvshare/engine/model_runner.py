"""Turns a scheduled step into tensors, runs the model, and returns only the logits needed."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvshare.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvshare.kvcache.audit import KVAuditor
from kvshare.kvcache.block_pool import Block
from kvshare.kvcache.manager import KVCacheManager
from kvshare.model.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillChunk
from kvshare.model.layers import rope_inv_freq
from kvshare.model.rerotate import rerotate_keys

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
        self.auditor: KVAuditor | None = None  # set by the engine in audit mode
        self._inv_freq = rope_inv_freq(model.config)
        self.reads: list[tuple[str, list[int], int, list[int] | None]] = []

    def prepare(self, decode: list[ScheduledChunk], prefill: list[ScheduledChunk]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed inputs for decode rows (sorted by the blocks they attend over) followed by prefill chunks.

        With a bounded-KV policy, each row attends over the blocks its table still holds, with
        the policy's mask per attention variant (one per distinct layer window), and sink rows
        take their cache positions. With the event log on, also records per row exactly which
        blocks it reads (`self.reads`: seq id, block ids, table index of each, keys read)."""
        bs = self.block_size
        mgr = self.manager
        policy = mgr.policy
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode))
        variants = policy.variants if policy is not None else [None]
        groups: dict = {v: [] for v in variants}
        prefills: dict = {v: [] for v in variants}
        self.reads = []
        logged = mgr.events is not None  # audit off costs nothing: no bookkeeping then
        tables = [mgr.tables[c.seq.seq_id] for c in decode]  # Blocks, None where released
        for c, t in zip(decode, tables):
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start - mgr.rope_offset(c.seq.seq_id))
            slots.append(t[c.start // bs].block_id * bs + c.start % bs)
        ctx_lens = [c.start + 1 for c in decode]
        if decode and policy is not None and max(ctx_lens) > policy.plain_until:
            # Some row no longer sees all earlier keys: every row takes the padded groups with
            # the policy's bias (the C++ kernel knows only plain causal attention).
            self._windowed_decode(decode, tables, groups, logged)
        elif decode:
            width = -(-max(ctx_lens) // bs)
            # Nothing is released yet on this path (every row is within every window).
            meta.decode_block_tables = torch.tensor(
                [[b.block_id for b in t[:width]] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.long)
            meta.decode_context_lens = torch.tensor(ctx_lens, dtype=torch.long)
            if logged:
                rows = meta.decode_block_tables.tolist()
                self.reads.extend((c.seq.seq_id, r[:-(-n // bs)], n, None) for c, r, n in zip(decode, rows, ctx_lens))
            plain = group_by_length(ctx_lens, bs) if self.model.backend.wants_decode_groups else []
            for r0, r1 in plain:
                # Rows are sorted by context length: the group's last row sets its padded width.
                width = -(-ctx_lens[r1 - 1] // bs)
                table = meta.decode_block_tables[r0:r1, :width]
                ctx = meta.decode_context_lens[r0:r1]
                bias = torch.zeros(r1 - r0, width * bs)
                bias.masked_fill_(torch.arange(width * bs).unsqueeze(0) >= ctx.unsqueeze(1), _NEG_INF)
                for v in variants:  # within every window still: all variants agree
                    groups[v].append(DecodeGroup(r0, r1 - r0, table, bias.view(1, r1 - r0, 1, width * bs)))
        row = len(decode)
        for c in prefill:
            seq_id = c.seq.seq_id
            ids.extend(c.seq.token_ids[c.start:c.end])
            offset = mgr.rope_offset(seq_id)
            positions.extend(range(c.start - offset, c.end - offset))
            full = mgr.block_ids(seq_id)[:-(-c.end // bs)]
            slots.extend(full[p // bs] * bs + p % bs for p in range(c.start, c.end))
            index = [i for i, b in enumerate(full) if b is not None]
            table = [full[i] for i in index]
            q_pos = torch.arange(c.start, c.end).unsqueeze(1)
            k_pos = _key_positions(index, bs).unsqueeze(0)
            table_t = torch.tensor(table, dtype=torch.long)
            for v in variants:
                mask = k_pos <= q_pos if policy is None else policy.visible(q_pos, k_pos, v)
                prefills[v].append(PrefillChunk(row, c.num_tokens, table_t, mask))
            if logged:
                self.reads.append((seq_id, table, c.end, index if policy is not None else None))
            row += c.num_tokens
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta.decode_groups, meta.prefills = groups[variants[0]], prefills[variants[0]]
        if len(variants) > 1:
            by_variant = {v: dataclasses.replace(meta, decode_groups=groups[v], prefills=prefills[v])
                          for v in variants}
            meta.layer_metadata = [by_variant[v] for v in policy.layer_variants]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def _windowed_decode(self, decode: list[ScheduledChunk], tables: list[list[Block | None]], groups: dict,
                         logged: bool) -> None:
        """Decode rows over the blocks each still holds (sorted by how many), padded per group;
        the bias is -inf for padding and for keys the row's window does not cover."""
        bs = self.block_size
        policy = self.manager.policy
        index = [self.manager.held_indices(c.seq.seq_id, c.start // bs + 1) for c in decode]
        if logged:
            self.reads.extend((c.seq.seq_id, [t[i].block_id for i in idx], c.start + 1, idx)
                              for c, t, idx in zip(decode, tables, index))
        for r0, r1 in group_by_length([len(idx) * bs for idx in index], bs):
            n, width = r1 - r0, len(index[r1 - 1])
            table = torch.zeros(n, width, dtype=torch.long)
            k_pos = torch.full((n, width * bs), -1, dtype=torch.long)  # -1: padding
            for r in range(r0, r1):
                idx = index[r]
                table[r - r0, :len(idx)] = torch.tensor([tables[r][i].block_id for i in idx], dtype=torch.long)
                k_pos[r - r0, :len(idx) * bs] = _key_positions(idx, bs)
            q_pos = torch.tensor([c.start for c in decode[r0:r1]]).unsqueeze(1)
            for v in groups:
                bias = torch.zeros(n, width * bs)
                bias.masked_fill_(~(policy.visible(q_pos, k_pos, v) & (k_pos >= 0)), _NEG_INF)
                groups[v].append(DecodeGroup(r0, n, table, bias.view(1, n, 1, width * bs)))

    def _decode_order(self, decode: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Decode rows by how many blocks they attend over (padded groups stay tight)."""
        if self.manager.policy is None:
            return sorted(decode, key=lambda c: c.start)
        bs = self.block_size

        def live(c: ScheduledChunk) -> int:
            return len(self.manager.held_indices(c.seq.seq_id, c.start // bs + 1))

        return sorted(decode, key=lambda c: (live(c), c.start))

    def execute(self, sched: SchedulerOutput) -> StepLogits:
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)
        for _, block_ids, shift in sched.rotations:  # after the copies: a copy takes unrotated keys
            rerotate_keys(self.kv_cache, block_ids, shift, self._inv_freq)
        decode = self._decode_order([c for c in sched.chunks if c.num_tokens == 1])
        prefill = [c for c in sched.chunks if c.num_tokens > 1]
        ordered = decode + prefill
        input_ids, positions, meta = self.prepare(decode, prefill)
        if self.manager.events is not None:
            self._record_io(sched.block_copies, sched.rotations, decode, prefill, meta)
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

    def _record_io(self, copies, rotations, decode, prefill, meta: AttentionMetadata) -> None:
        """Log (and, in audit mode, check) exactly what the forward pass will read and write."""
        events = self.manager.events
        slots = meta.slot_mapping.tolist()
        rows = [(c.seq.seq_id, c.start, c.num_tokens) for c in decode + prefill]
        for src, dst in copies:
            events.record("copy", src=src, dst=dst)
        for seq_id, block_ids, shift in rotations:
            events.record("rotate", seq=seq_id, blocks=block_ids, shift=shift)
        k = 0
        for (seq_id, start, count), (_, table, ctx, index) in zip(rows, self.reads):
            fields = {} if index is None else {"index": index}
            events.record("access", seq=seq_id, table=table, ctx=ctx, write_pos=start,
                          write_slots=slots[k:k + count], **fields)
            k += count
        events.record("forward")
        if self.auditor is not None:
            self.auditor.apply_copies(copies)
            self.auditor.check_rotations(rotations)
            self.auditor.check_io(rows, slots, self.reads)
            self.auditor.check_state()


def _key_positions(index: list[int], block_size: int) -> torch.Tensor:
    """Text positions of every slot of the blocks at these table indices, in order."""
    return (torch.tensor(index, dtype=torch.long).unsqueeze(1) * block_size
            + torch.arange(block_size)).flatten()
