"""Turns a step plan into tensors, runs the model, and returns only the logits needed.

The runner consumes the plan alone (kvshare/engine/step_plan.py): block ids, table indices,
write slots and RoPE positions all come from it, so it knows nothing of the KV manager. Each KV
cache group's attention policy only says what each query may see (its `variants`, plain mask
specs the model side turns into masks, and `plain_until`); which blocks a sequence still holds is
already in the plan."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvshare.engine.kv_tier_store import KVTierStore
from kvshare.engine.step_plan import ChunkPlan, GroupAccess, StepPlan
from kvshare.model.attention import AttentionMetadata, DecodeGroup, PagedKVStorage, PrefillChunk
from kvshare.model.attention_masks import visible
from kvshare.model.layers import rope_inv_freq
from kvshare.model.lora import LoRAAdapter, LoRABatch
from kvshare.model.rerotate import rerotate_keys

_NEG_INF = float("-inf")


@dataclass
class StepLogits:
    # Rows that produce a next token, in the order of `sample_chunks`.
    sample_chunks: list[ChunkPlan]
    sample_logits: torch.Tensor | None
    # Per chunk wanting prompt logprobs: (chunk, first position, logits [k, V]) for positions
    # first .. first+k-1, each predicting the prompt token after it.
    prompt_logits: list[tuple[ChunkPlan, int, torch.Tensor]]


def padded_blocks(blocks: int) -> int:
    """The blocks a decode row is padded to on the PyTorch path: a function of its own length
    alone, so its matmul shapes (and with them its bits) never depend on the rows beside it.
    Exact up to 8 blocks, then rounded up to one of 8 steps per power of two (at most 1/8 more
    keys read), so rows of similar length still share a group."""
    if blocks <= 8:
        return blocks
    step = 1 << (blocks.bit_length() - 4)
    return -(-blocks // step) * step


def group_by_length(ctx_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split rows (sorted by context length) into [start, end) runs of the same padded width
    (`padded_blocks` of each row's own block count): a group never pads a row past its own width."""
    widths = [padded_blocks(-(-x // block_size)) for x in ctx_lens]
    bounds = [0] + [i for i in range(1, len(widths)) if widths[i] != widths[i - 1]] + [len(widths)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVStorage, group_policies: list, layer_groups: list[int],
                 layer_slots: list[int], token_rows: bool = False) -> None:
        """Group g's layers attend over the plan's group g accesses with `group_policies[g]`; layer
        i is slot `layer_slots[i]` of group `layer_groups[i]` (one group: every layer, in order).
        token_rows: every row of a step, prompt rows too, is handed to the model as a row of its own
        (its table, its context length, its visible range), as a decode row is: the default mode's
        one arithmetic per token row (kvshare.model.numerics)."""
        self.token_rows = token_rows
        self.model = model
        self.kv_cache = kv_cache
        self.group_policies = group_policies
        self.layer_groups = layer_groups
        self.layer_slots = layer_slots
        self.block_size = kv_cache.block_size
        self._inv_freq = rope_inv_freq(model.config)
        # The KV tiers' bytes (kvshare.engine.kv_tier_store), when tiers are configured: it applies
        # the plan's stores, loads and drops before anything else in a step.
        self.tier_store: KVTierStore | None = None
        # LoRA adapters by cache key (kvshare.model.lora), those a chunk may name: the engine's.
        self.adapters: dict[str, LoRAAdapter] = {}

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed inputs for the plan's chunks (decode rows first, then prefill chunks).

        Each row attends over the blocks its chunk reads, with the policy's mask per attention
        variant (one per distinct layer window), per KV cache group when there are several."""
        decode = [c for c in plan.chunks if c.is_decode]
        prefill = [c for c in plan.chunks if not c.is_decode]
        ids: list[int] = []
        positions: list[int] = []
        for c in plan.chunks:
            ids.extend(c.token_ids)
            positions.extend(range(c.rope_start, c.rope_start + c.num_tokens))
        metas = [self._metadata(plan, decode, prefill, g, p) for g, p in enumerate(self.group_policies)]
        layers = [metas[g].for_layer(j) for g, j in zip(self.layer_groups, self.layer_slots)]
        meta = metas[0]
        if any(m is not meta for m in layers):  # layers attend differently: each gets its own
            meta = dataclasses.replace(meta, layer_metadata=layers)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def _metadata(self, plan: StepPlan, decode: list[ChunkPlan], prefill: list[ChunkPlan], group: int,
                  policy) -> AttentionMetadata:
        """One KV cache group's view of the step: its write slots, tables and masks."""
        bs = self.block_size
        slots: list[int] = []
        for c in plan.chunks:
            slots.extend(c.access(group).write_slots)
        variants = policy.variants
        if self.token_rows:
            return self._token_rows_metadata(plan, group, policy, torch.tensor(slots, dtype=torch.long))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), num_decode=len(decode))
        groups: dict = {v: [] for v in variants}
        prefills: dict = {v: [] for v in variants}
        ranges: dict = {v: (None, None) for v in variants}
        if decode:
            ranges = self._decode_tables(decode, group, policy, meta, variants)
            if self.model.backend.wants_decode_groups:  # the pure-PyTorch path: padded groups
                self._decode_groups(decode, group, policy, groups)
        row = len(decode)
        for c in prefill:
            a = c.access(group)
            q_pos = torch.arange(c.start, c.end).unsqueeze(1)
            k_pos = _key_positions(_table_index(a), bs).unsqueeze(0)
            table_t = torch.tensor(a.read_blocks, dtype=torch.long)
            for v in variants:
                mask = visible(v, q_pos, k_pos)
                prefills[v].append(PrefillChunk(row, c.num_tokens, table_t, mask, _plain_causal(c.start, mask)))
            row += c.num_tokens
        meta.decode_groups, meta.prefills = groups[variants[0]], prefills[variants[0]]
        meta.decode_sink_end, meta.decode_window_start = ranges[variants[0]]
        if len(variants) > 1:
            by_variant = {v: dataclasses.replace(meta, decode_groups=groups[v], prefills=prefills[v],
                                                 decode_sink_end=ranges[v][0], decode_window_start=ranges[v][1])
                          for v in variants}
            meta.layer_metadata = [by_variant[v] for v in policy.layer_variants]
        return meta

    def _decode_tables(self, decode: list[ChunkPlan], group: int, policy, meta: AttentionMetadata,
                       variants: list) -> dict:
        """Each row's table by table index (0 where a block was released: never read) and its
        context length, for kernels that walk tables themselves; when some row no longer sees
        every earlier key, also each variant's visible range per row (sink end, window start).
        A row that still sees every key gets a range hiding nothing: the model sends it down the
        path it takes alone (kvshare.model.ops.windowed_decode_rows), whatever its neighbours."""
        bs = self.block_size
        ctx_lens = [c.num_keys for c in decode]
        width = -(-max(ctx_lens) // bs)
        rows = []
        for c in decode:
            a = c.access(group)
            if a.read_index is None:
                rows.append(a.read_blocks + [0] * (width - len(a.read_blocks)))
            else:
                row = [0] * width
                for i, b in zip(a.read_index, a.read_blocks):
                    row[i] = b
                rows.append(row)
        meta.decode_block_tables = torch.tensor(rows, dtype=torch.long)
        meta.decode_context_lens = torch.tensor(ctx_lens, dtype=torch.long)
        if max(ctx_lens) <= policy.plain_until:
            return {v: (None, None) for v in variants}  # plain causal attention for every row
        out = {}
        for v in variants:
            pairs = [v.decode_range(c.start) for c in decode]
            out[v] = (torch.tensor([p[0] for p in pairs], dtype=torch.long),
                      torch.tensor([p[1] for p in pairs], dtype=torch.long))
        return out

    def _token_rows_metadata(self, plan: StepPlan, group: int, policy, slots: torch.Tensor) -> AttentionMetadata:
        """Every row a decode row of its own (token rows): tables, context lengths and, per
        attention variant, visible ranges."""
        variants = policy.variants
        meta = AttentionMetadata(slot_mapping=slots, num_decode=len(slots))
        ranges = self._row_tables(plan.chunks, group, policy, meta, variants)
        meta.decode_sink_end, meta.decode_window_start = ranges[variants[0]]
        if len(variants) > 1:
            by_variant = {v: dataclasses.replace(meta, decode_sink_end=ranges[v][0], decode_window_start=ranges[v][1])
                          for v in variants}
            meta.layer_metadata = [by_variant[v] for v in policy.layer_variants]
        return meta

    def _row_tables(self, chunks: list[ChunkPlan], group: int, policy, meta: AttentionMetadata,
                    variants: list) -> dict:
        """Token rows: every row of every chunk gets its chunk's table (by table index, 0 where a
        block was released), its own context length (its position + 1) and, once some row no
        longer sees every earlier key, each variant's visible range for its own position."""
        bs = self.block_size
        width = -(-max(c.num_keys for c in chunks) // bs)
        tables, positions = [], []
        for c in chunks:
            a = c.access(group)
            row = torch.zeros(width, dtype=torch.long)
            index = _table_index(a)
            if index:
                row[torch.tensor(index, dtype=torch.long)] = torch.tensor(a.read_blocks, dtype=torch.long)
            tables.append(row.expand(c.num_tokens, width))
            positions.append(torch.arange(c.start, c.end, dtype=torch.long))
        meta.decode_block_tables = torch.cat(tables)
        pos = torch.cat(positions)
        meta.decode_context_lens = pos + 1
        if int(pos.max()) + 1 <= policy.plain_until:
            return {v: (None, None) for v in variants}
        out = {}
        for v in variants:
            pairs = [v.decode_range(p) for p in pos.tolist()]
            out[v] = (torch.tensor([p[0] for p in pairs], dtype=torch.long),
                      torch.tensor([p[1] for p in pairs], dtype=torch.long))
        return out

    def _decode_groups(self, decode: list[ChunkPlan], group: int, policy, groups: dict) -> None:
        """The pure-PyTorch path: decode rows over the blocks each holds, each padded to a width
        of its own length (`padded_blocks`), rows of the same width in one group; the bias is -inf
        for padding and for keys the policy hides from the row."""
        bs = self.block_size
        access = [c.access(group) for c in decode]
        for r0, r1 in group_by_length([len(a.read_blocks) * bs for a in access], bs):
            n, width = r1 - r0, padded_blocks(len(access[r0].read_blocks))
            table = torch.zeros(n, width, dtype=torch.long)
            k_pos = torch.full((n, width * bs), -1, dtype=torch.long)  # -1: padding
            for r in range(r0, r1):
                a = access[r]
                table[r - r0, :len(a.read_blocks)] = torch.tensor(a.read_blocks, dtype=torch.long)
                k_pos[r - r0, :len(a.read_blocks) * bs] = _key_positions(_table_index(a), bs)
            q_pos = torch.tensor([c.start for c in decode[r0:r1]]).unsqueeze(1)
            for v in groups:
                bias = torch.zeros(n, width * bs)
                bias.masked_fill_(~(visible(v, q_pos, k_pos) & (k_pos >= 0)), _NEG_INF)
                groups[v].append(DecodeGroup(r0, n, table, bias.view(1, n, 1, width * bs)))

    def _lora_batch(self, plan: StepPlan) -> LoRABatch | None:
        """Which rows (in the plan's chunk order, as `prepare` lays them out) use which adapter."""
        if not any(c.adapter for c in plan.chunks):
            return None
        rows: dict[str, list[int]] = {}
        row = 0
        for c in plan.chunks:
            if c.adapter is not None:
                rows.setdefault(c.adapter, []).extend(range(row, row + c.num_tokens))
            row += c.num_tokens
        return LoRABatch([(self.adapters[k], torch.tensor(r, dtype=torch.long)) for k, r in rows.items()],
                         self.model.config)

    def execute(self, plan: StepPlan) -> StepLogits:
        if self.tier_store is not None and (plan.block_stores or plan.block_loads or plan.tier_drops):
            self.tier_store.apply(plan.block_stores, plan.block_loads, plan.tier_drops)
        if plan.block_copies:
            self.kv_cache.copy_blocks(plan.block_copies)
        for _, block_ids, shift in plan.rotations:  # after the copies: a copy takes unrotated keys
            rerotate_keys(self.kv_cache, block_ids, shift, self._inv_freq)
        input_ids, positions, meta = self.prepare(plan)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, lora=self._lora_batch(plan))
        rows, spans, sample_chunks = plan.logit_rows()
        if not rows:  # no row scores anything: neither prompt logprobs nor a sample
            return StepLogits(sample_chunks, None, [])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)])
        prompt_logits = [(c, first, logits[r0:r0 + k]) for c, first, r0, k in spans]
        sample_logits = logits[len(rows) - len(sample_chunks):] if sample_chunks else None
        return StepLogits(sample_chunks, sample_logits, prompt_logits)


def _plain_causal(start: int, mask: torch.Tensor) -> bool:
    """Whether a chunk's mask [n, keys] is exactly query i seeing keys 0..i (a chunk from position 0
    whose first n key slots are positions 0..n-1, nothing hidden by a window or sinks)."""
    n = mask.shape[0]
    return (start == 0 and mask.shape[1] >= n and not mask[:, n:].any()
            and torch.equal(mask[:, :n], torch.ones(n, n, dtype=torch.bool).tril_()))


def _table_index(c: GroupAccess) -> list[int]:
    return c.read_index if c.read_index is not None else list(range(len(c.read_blocks)))


def _key_positions(index: list[int], block_size: int) -> torch.Tensor:
    """Text positions of every slot of the blocks at these table indices, in order."""
    return (torch.tensor(index, dtype=torch.long).unsqueeze(1) * block_size
            + torch.arange(block_size)).flatten()
