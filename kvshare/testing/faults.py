"""Fault injection: plant, into one engine instance, a bug class that has really shipped in
inference engines, so tests (and the hidden `--inject-fault` of `kvshare doctor` and `kvshare
serve`) can prove the audit, the doctor and the dashboard catch it. Test-only: planting is refused
unless KVSHARE_TESTING=1 (kvshare.testing.environment), and patches the given engine object alone.
Every fault is planted in each KV cache group's manager (the KV core runs one per group), so it
does harm on a hybrid engine (Gemma 3) as on a single-group one.

  share_without_incref   (a) a prefix hit puts cached blocks in the table without counting them
  no_copy_on_write       (b) a sequence appends into a block it shares (fork tail) in place
  abort_ignores_refcount (c) the abort path drops every reference to its blocks, others' too
  evict_held_block       (d) the allocator reuses a cached block that a running sequence holds
  lookup_ignores_salt    (e) the prefix lookup hashes without the request's cache namespace
  slot_off_by_one        (f) the first token of each block is written one slot too early
  hit_before_written     (g) blocks are published when their last token is sampled, before its
                             KV is computed: a request that finished on that token leaves a
                             cached block with an unwritten slot for the next turn to hit
  cached_k_one_ulp       (h) every block published to the prefix cache has one element of its K,
                             in one layer, moved by one unit in the last place once its KV is
                             written, before anyone hits it (a stray write, a bad copy on the
                             publish path: every publish, so a hit reads a changed block whatever
                             the cache held before): every invariant holds, only bits change, so
                             the audit cannot see it; only an exact comparison can (`kvshare
                             doctor` on a bit-transparent engine), a tolerance hides it
  lookup_ignores_adapter (i) the prefix lookup hashes without the request's LoRA adapter (its
                             salt kept): llama.cpp #26207's bug, a request under one adapter (or
                             the base model) served KV computed under another
"""
from __future__ import annotations

import torch

from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE, CacheNamespace
from kvshare.testing.environment import require_testing

FAULTS = {
    "share_without_incref": "a", "no_copy_on_write": "b", "abort_ignores_refcount": "c",
    "evict_held_block": "d", "lookup_ignores_salt": "e", "slot_off_by_one": "f", "hit_before_written": "g",
    "cached_k_one_ulp": "h", "lookup_ignores_adapter": "i",
}
# Faults that break no bookkeeping invariant, only a block's bits: the audit is blind to them.
NUMERIC_FAULTS = frozenset({"cached_k_one_ulp"})
# Faults that do harm only where requests name LoRA adapters (an engine with enable_lora=True).
ADAPTER_FAULTS = frozenset({"lookup_ignores_adapter"})
# Faults that get reference counts wrong: kvshare's block pool refuses a count below zero and the
# engine stops, where the engines that shipped these bugs had no such guard.
REFCOUNT_FAULTS = frozenset({"share_without_incref", "abort_ignores_refcount", "evict_held_block"})


def plant(engine, fault: str, unguarded: bool = False) -> None:
    """After planting, `engine.fault_fired` lists (step, block ids) each time the bug did harm.
    `unguarded` (serve --inject-fault-unaudited): a refcount fault also runs as in an engine
    without the pool's guard, so its harm reaches the answers instead of stopping the engine."""
    require_testing(f"planting the fault {fault!r}")
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
    engine.fault_fired = []
    globals()["_" + fault](engine)
    if unguarded and fault in REFCOUNT_FAULTS:
        _without_refcount_guard(engine, fault)


def _without_refcount_guard(engine, fault: str) -> None:
    """This engine's pool as in engines without the guard (vLLM's refcount bugs): a count that
    would go below zero stays at zero, and a block freed while a sequence still holds it is the
    next one handed out, so another request's KV overwrites what the holder reads."""
    pool = engine.manager.pool
    decref = pool.decref

    def unguarded_decref(block, owner):
        if block.ref_count <= 0:
            block.owners.discard(owner)
            return False
        freed = decref(block, owner)
        if freed and block.owners:
            pool._free.move_to_end(block.block_id, last=False)  # first in line for allocate()
            _fired(engine, [block.block_id])
        return freed

    pool.decref = unguarded_decref
    if fault == "share_without_incref":
        # The uncounted hits are held all the same: their holders are known, only not counted.
        mgr = engine.manager
        commit = mgr.commit_admission

        def commit_with_holders(plan):
            commit(plan)
            for b in plan.hits:
                if b is not None:
                    b.owners.add(plan.seq_id)

        mgr.commit_admission = commit_with_holders


def _fired(engine, blocks) -> None:
    engine.fault_fired.append((engine.step_count, {int(b) for b in blocks}))


def _share_without_incref(engine) -> None:
    mgr = engine.manager
    commit = mgr.commit_admission

    def buggy_commit(plan):
        pool = mgr.pool
        incref = pool.incref
        pool.incref = lambda block, owner: None  # the hits go into the table, never counted
        try:
            commit(plan)
        finally:
            pool.incref = incref
        hits = [b.block_id for b in plan.hits if b is not None]
        if hits:
            _fired(engine, hits)

    mgr.commit_admission = buggy_commit


def _no_copy_on_write(engine) -> None:
    for group in engine.manager.groups:
        def buggy_cow(seq_id, index, group=group):
            _fired(engine, [group.seqs[seq_id].blocks[index].block_id])  # and writes into the shared block in place

        group.copy_on_write = buggy_cow


def _abort_ignores_refcount(engine) -> None:
    mgr = engine.manager
    abort = engine.abort_request

    def buggy_abort(request_ids):
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            st = engine.requests.get(rid)
            for seq, group in [(s, g) for s in (st.seqs if st is not None and not st.finished else [])
                               for g in mgr.groups]:
                rec = group.seqs.pop(seq.seq_id, None)
                for block in (rec.blocks if rec is not None else []):
                    if block is None:
                        continue
                    if block.ref_count > 1:
                        _fired(engine, [block.block_id])
                    while block.ref_count > 0:  # "make sure it is really freed"
                        mgr.pool.decref(block, seq.seq_id)
        abort(ids)

    engine.abort_request = buggy_abort


def _evict_held_block(engine) -> None:
    pool = engine.manager.pool
    allocate = pool.allocate

    def buggy_allocate(owner, namespace=DEFAULT_NAMESPACE):
        for bid in list(pool.cached.values()):
            block = pool.blocks[bid]
            if block.ref_count > 0 and owner not in block.owners:
                _fired(engine, [bid])
                pool.evict(block)
                block.ref_count, block.owners, block.namespace = 1, {owner}, namespace
                block.generation += 1
                pool.events.record("alloc", block=bid, seq=owner)
                return block
        return allocate(owner, namespace)

    pool.allocate = buggy_allocate


def _lookup_ignores_salt(engine) -> None:
    for group in engine.manager.groups:
        _unsalted_lookups(engine, group)


def _lookup_ignores_adapter(engine) -> None:
    for group in engine.manager.groups:
        _unsalted_lookups(engine, group, keep_salt=True)


def _unsalted_lookups(engine, group, keep_salt: bool = False) -> None:
    """keep_salt: only the adapter is dropped from the key (lookup_ignores_adapter)."""
    find, cached = group.find_cached_prefix, group.cached_block

    def lookup_namespace(namespace):
        return CacheNamespace(salt=namespace.salt) if keep_salt else DEFAULT_NAMESPACE

    def unsalted(seq_id, lookup, namespace):
        key = seq_id + "\0lookup"  # a fresh record: hashes in the lookup's namespace
        if keep_salt:
            group._set_namespace(group.record(key), lookup_namespace(namespace))
        hits = list(lookup(key))
        group.seqs.pop(key, None)
        foreign = [b.block_id for b in hits if b is not None and b.namespace != namespace]
        if foreign:
            _fired(engine, foreign)
        return hits

    group.find_cached_prefix = lambda seq_id, token_ids, namespace: unsalted(
        seq_id, lambda key: find(key, token_ids, lookup_namespace(namespace)), namespace)
    group.cached_block = lambda seq_id, token_ids, index: unsalted(
        seq_id, lambda key: [cached(key, token_ids, index)], group.record(seq_id).namespace)[0]


def _slot_off_by_one(engine) -> None:
    schedule = engine.scheduler.schedule
    bs = engine.manager.block_size

    def buggy_schedule():
        plan = schedule()
        hit = []
        for a, c in [(c.access(g), c) for c in plan.chunks for g in range(engine.manager.num_groups)]:
            for k, pos in enumerate(range(c.start, c.end)):
                slot = a.write_slots[k]
                if pos % bs == 0 and pos > 0 and slot > 0:
                    hit.append((slot - 1) // bs)
                    a.write_slots[k] = slot - 1
        if hit:
            _fired(engine, hit)
        return plan

    engine.scheduler.schedule = buggy_schedule


def _hit_before_written(engine) -> None:
    mgr = engine.manager
    append = engine._append_token

    def buggy_append(seq, res, now):
        seq_id, tokens = seq.seq_id, seq.token_ids
        # Publishes by tokens known, not tokens computed: the new token's KV does not exist yet.
        mgr.publish_full_blocks(seq_id, tokens + [res.token_id], len(tokens) + 1)
        if (len(tokens) + 1) % mgr.block_size == 0 and seq_id in mgr.tables:
            _fired(engine, [mgr.tables[seq_id][len(tokens) // mgr.block_size].block_id])
        append(seq, res, now)

    engine._append_token = buggy_append


def _cached_k_one_ulp(engine) -> None:
    pool = engine.manager.pool
    publish = pool.publish
    bs = engine.manager.block_size

    def buggy_publish(block, block_hash, token_ids, parent_hash=None, group=0):
        publish(block, block_hash, token_ids, parent_hash, group)
        # A code-path bug: it fires on every block this path is given (the copy kept private
        # because an identical block is cached already too), so what a block holds after it is
        # published depends on the block alone, never on what the cache held before.
        # The last storage slot (the last layer of the block's group), K, kv head 0: a change
        # that reaches the logits through one attention only; the element of largest magnitude,
        # so its ulp is one that matters to the scores.
        last = engine.kv_cache.data.shape[0] - 1
        k = engine.kv_cache.data[last, 0, 0, block.block_id * bs:(block.block_id + 1) * bs]
        flat = k.view(-1)  # a view: the change lands in the cache itself
        i = int(flat.float().abs().argmax())
        # The next representable value away from zero: the bit pattern + 1 (bfloat16, float16,
        # float32 alike; an int8 or fp8 cache moves by one code).
        bits = flat[i:i + 1].view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
        bits += 1
        _fired(engine, [block.block_id])

    pool.publish = buggy_publish
