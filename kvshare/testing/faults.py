"""Fault injection: plant, into one engine instance, a bug class that has really shipped in
inference engines, so tests (and `kvshare doctor --inject-fault`) can prove the audit and the
doctor catch it. Test-only: nothing here is reachable from normal configuration, and planting
patches the given engine object alone.

  share_without_incref   (a) a prefix hit puts cached blocks in the table without counting them
  no_copy_on_write       (b) a sequence appends into a block it shares (fork tail) in place
  abort_ignores_refcount (c) the abort path drops every reference to its blocks, others' too
  evict_held_block       (d) the allocator reuses a cached block that a running sequence holds
  lookup_ignores_salt    (e) the prefix lookup hashes without the tenant's cache salt
  slot_off_by_one        (f) the first token of each block is written one slot too early
  hit_before_written     (g) blocks are published when their last token is sampled, before its
                             KV is computed: a request that finished on that token leaves a
                             cached block with an unwritten slot for the next turn to hit
"""
from __future__ import annotations

import torch

FAULTS = {
    "share_without_incref": "a", "no_copy_on_write": "b", "abort_ignores_refcount": "c",
    "evict_held_block": "d", "lookup_ignores_salt": "e", "slot_off_by_one": "f", "hit_before_written": "g",
}


def plant(engine, fault: str) -> None:
    """After planting, `engine.fault_fired` lists (step, block ids) each time the bug did harm."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
    engine.fault_fired = []
    globals()["_" + fault](engine)


def _fired(engine, blocks) -> None:
    engine.fault_fired.append((engine.step_count, {int(b) for b in blocks}))


def _share_without_incref(engine) -> None:
    mgr = engine.manager
    admit = mgr.admit

    def buggy_admit(seq_id, cached, salt=None):
        admit(seq_id, [], salt)
        mgr.tables[seq_id] = list(cached)  # shared, never counted
        if cached:
            _fired(engine, [b.block_id for b in cached])
        mgr._registered[seq_id] = len(cached)

    mgr.admit = buggy_admit


def _no_copy_on_write(engine) -> None:
    def buggy_cow(seq_id, table, index):
        _fired(engine, [table[index].block_id])  # and writes into the shared block in place

    engine.manager._copy_on_write = buggy_cow


def _abort_ignores_refcount(engine) -> None:
    mgr = engine.manager
    abort = engine.abort_request

    def buggy_abort(request_ids):
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            st = engine.requests.get(rid)
            for seq in (st.seqs if st is not None and not st.finished else []):
                for block in mgr.tables.pop(seq.seq_id, []):
                    if block.ref_count > 1:
                        _fired(engine, [block.block_id])
                    while block.ref_count > 0:  # "make sure it is really freed"
                        mgr.pool.decref(block, seq.seq_id)
        abort(ids)

    engine.abort_request = buggy_abort


def _evict_held_block(engine) -> None:
    pool = engine.manager.pool
    allocate = pool.allocate

    def buggy_allocate(owner, salt=None):
        for bid in list(pool.cached.values()):
            block = pool.blocks[bid]
            if block.ref_count > 0 and owner not in block.owners:
                _fired(engine, [bid])
                pool._evict(block)
                block.ref_count, block.owners, block.salt = 1, {owner}, salt
                block.generation += 1
                if pool.events is not None:
                    pool.events.record("alloc", block=bid, seq=owner)
                return block
        return allocate(owner, salt)

    pool.allocate = buggy_allocate


def _lookup_ignores_salt(engine) -> None:
    mgr = engine.manager
    find = mgr.find_cached_prefix

    def buggy_find(seq_id, token_ids, cache_salt):
        key = seq_id + "\0lookup"
        hits = find(key, token_ids, None)
        mgr._hashes.pop(key, None)
        foreign = [b.block_id for b in hits if b.salt != cache_salt]
        if foreign:
            _fired(engine, foreign)
        return hits

    mgr.find_cached_prefix = buggy_find


def _slot_off_by_one(engine) -> None:
    runner = engine.runner
    prepare = runner.prepare
    bs = runner.block_size

    def buggy_prepare(decode, prefill):
        input_ids, positions, meta = prepare(decode, prefill)
        boundary = (positions % bs == 0) & (positions > 0) & (meta.slot_mapping > 0)
        if bool(boundary.any()):
            _fired(engine, (meta.slot_mapping[boundary] - 1) // bs)
        meta.slot_mapping = torch.where(boundary, meta.slot_mapping - 1, meta.slot_mapping)
        return input_ids, positions, meta

    runner.prepare = buggy_prepare


def _hit_before_written(engine) -> None:
    mgr = engine.manager
    append = engine._append_token

    def buggy_append(seq, res, now):
        seq_id, tokens = seq.seq_id, seq.token_ids
        # Publishes by tokens known, not tokens computed: the new token's KV does not exist yet.
        mgr.cache_full_blocks(seq_id, tokens + [res.token_id], len(tokens) + 1, seq.params.cache_salt)
        if (len(tokens) + 1) % mgr.block_size == 0 and seq_id in mgr.tables:
            _fired(engine, [mgr.tables[seq_id][len(tokens) // mgr.block_size].block_id])
        append(seq, res, now)

    engine._append_token = buggy_append
