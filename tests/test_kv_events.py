"""KV cache events (issue 14 item 1): vLLM's wire format over ZMQ, decoded with msgpack by a plain
subscriber, rebuild exactly the set of block hashes the engine's prefix cache holds; the replay
socket resends missed batches; a hash seed makes block hashes computable from token ids."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kvshare import LLM, SamplingParams
from kvshare.bench.workloads import token_prompts
from kvshare.config import EngineConfig
from kvshare.kvcache.hashing import BlockHasher
from kvshare.kvcache.prefix_updates import cached_hashes_from_updates
from kvshare.server.routing import Router

BLOCK = 16


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        out = []
        while True:
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq_of(seq) == -1:
                assert payload == b""
                return out
            out.append((seq_of(seq), payload))
    finally:
        sock.close(0)


@pytest.fixture(scope="module")
def published():
    """A shared-prefix workload on a pool small enough to evict, with a live subscriber."""
    llm = LLM(kv_cache_memory=46080 * BLOCK * 60, kv_cache_dtype="float32", kv_events_endpoint="tcp://127.0.0.1:0",
              kv_events_replay_endpoint="tcp://127.0.0.1:0", kv_events_topic="kv", prefix_caching_hash_seed="s1",
              kv_events_token_ids=True)
    pub = llm.engine.prefix_update_publisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    # ZMQ's slow joiner: batches sent before the subscription reaches the publisher are lost to
    # this subscriber (the replay socket is how a late subscriber catches up; the test checks it).
    time.sleep(0.3)
    tok = llm.get_tokenizer()
    shared = token_prompts(tok.encode, [300], offset_step=11)[0]
    prompts = [shared + token_prompts(tok.encode, [40 + 8 * i], offset_step=53 + i)[0] for i in range(6)]
    prompts += token_prompts(tok.encode, [200, 250, 330], offset_step=97)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p in prompts:  # one at a time: later prompts hit the shared prefix, the small pool evicts
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    live = []
    while dict(poller.poll(1000)):
        live.append(sub.recv_multipart())
    sub.close(0)
    yield llm, prompts, live
    llm.engine.close()


def decode(payload: bytes) -> list:
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch[0], float) and len(batch) == 2  # [ts, events]; no data_parallel_rank here
    return batch[1]


def test_subscriber_rebuilds_the_cached_hash_set_exactly(published):
    llm, _, live = published
    pool = llm.engine.manager.pool
    assert live, "no batch reached the subscriber"
    assert all(len(f) == 3 and f[0] == b"kv" for f in live)
    seqs = [seq_of(f[1]) for f in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing lost after joining
    # The replay socket has every batch from 0; together with what was seen live, the full history.
    history = replay(llm.engine.prefix_update_publisher.replay_endpoint, 0)
    assert [s for s, _ in history] == list(range(len(history)))
    assert {s: p for s, p in history if s >= seqs[0]} == {seq_of(f[1]): f[2] for f in live}
    events = [e for _, p in history for e in decode(p)]
    tags = {e[0] for e in events}
    assert {"BlockStored", "BlockRemoved"} <= tags, tags  # the pool was small enough to evict
    assert pool.num_evictions > 0
    assert cached_hashes_from_updates(events) == set(pool.cached)
    for e in events:
        if e[0] == "BlockStored":
            _, hashes, parent, token_ids, block_size, lora_id, medium = e
            assert len(hashes) == 1 and len(hashes[0]) == 32 and block_size == BLOCK
            assert len(token_ids) == BLOCK and lora_id is None and medium == "CPU"
            assert parent is None or len(parent) == 32


def test_seeded_hashes_are_what_a_router_computes(published):
    llm, prompts, _ = published
    history = replay(llm.engine.prefix_update_publisher.replay_endpoint, 0)
    stored = {e[1][0]: (e[2], e[3]) for _, p in history for e in decode(p) if e[0] == "BlockStored"}
    router = BlockHasher.seeded(BLOCK, "s1")
    parent = None
    chain = []
    for i in range(300 // BLOCK):  # the shared prefix's full blocks
        h = router.hash_block(parent, prompts[0][i * BLOCK:(i + 1) * BLOCK])
        chain.append(h)
        parent = h
    assert all(h in stored for h in chain)
    for prev, h in zip([None] + chain, chain):
        assert stored[h][0] == prev  # parent_block_hash links the chain
    # Another seed (or none: a random per-process root) gives other hashes for the same tokens.
    other = BlockHasher.seeded(BLOCK, "s2").hash_block(None, prompts[0][:BLOCK])
    assert other != chain[0] and BlockHasher(BLOCK).hash_block(None, prompts[0][:BLOCK]) != chain[0]


def test_replay_from_a_later_sequence_number(published):
    llm, _, _ = published
    full = replay(llm.engine.prefix_update_publisher.replay_endpoint, 0)
    later = replay(llm.engine.prefix_update_publisher.replay_endpoint, len(full) - 2)
    assert later == full[-2:]
    assert replay(llm.engine.prefix_update_publisher.replay_endpoint, len(full) + 5) == []


def test_reset_prefix_cache_publishes_all_blocks_cleared():
    llm = LLM(kv_cache_memory="16MiB", kv_events_endpoint="tcp://127.0.0.1:0",
              kv_events_replay_endpoint="tcp://127.0.0.1:0")
    try:
        tok = llm.get_tokenizer()
        llm.generate([{"prompt_token_ids": token_prompts(tok.encode, [100])[0]}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
        llm.engine.manager.pool.reset_prefix_cache()
        llm.engine.publish_prefix_updates()
        events = [e for _, p in replay(llm.engine.prefix_update_publisher.replay_endpoint, 0) for e in decode(p)]
        assert events[-1] == ["AllBlocksCleared"]
        assert cached_hashes_from_updates(events) == set() == set(llm.engine.manager.pool.cached)
    finally:
        llm.engine.close()


def test_events_carry_no_token_ids_by_default_and_still_route_by_hash():
    """The default: BlockStored keeps vLLM's 7 fields but its token_ids are empty, for a live
    subscriber and on the replay socket alike, so no tenant's prompt text leaves the engine; the
    hashes alone rebuild the cache and a router still finds the prefix there."""
    llm = LLM(kv_cache_memory="16MiB", kv_events_endpoint="tcp://127.0.0.1:0",
              kv_events_replay_endpoint="tcp://127.0.0.1:0", prefix_caching_hash_seed="s1")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(llm.engine.prefix_update_publisher.endpoint)
        time.sleep(0.3)  # ZMQ's slow joiner
        tok = llm.get_tokenizer()
        prompt = token_prompts(tok.encode, [100])[0]
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.engine.publish_prefix_updates()
        live = []
        while sub.poll(1000):
            live += [e for e in decode(sub.recv_multipart()[2]) if e[0] == "BlockStored"]
        assert len(live) >= 2 * (100 // BLOCK) and all(e[3] == [] for e in live), live[0]
        events = [e for _, p in replay(llm.engine.prefix_update_publisher.replay_endpoint, 0) for e in decode(p)]
        stored = [e for e in events if e[0] == "BlockStored"]
        assert len(stored) >= 100 // BLOCK
        assert all(len(e) == 7 and e[3] == [] and e[4] == BLOCK for e in stored), stored[0]
        assert cached_hashes_from_updates(events) == set(llm.engine.manager.pool.cached)
        router = Router(2, block_size=BLOCK, hash_seed="s1")
        router.replicas[1].apply(events)  # replica 1 published these; replica 0 holds nothing
        decision = router.route(prompt + [7, 8, 9])
        assert (decision.index, decision.reason, decision.matched_blocks) == (1, "prefix", 100 // BLOCK)
    finally:
        sub.close(0)
        llm.engine.close()


def test_token_ids_flag_and_its_old_opposite():
    from kvshare.cli import build_parser
    from kvshare.engine_args import engine_options

    def options(*flags):
        return engine_options(build_parser().parse_args(["serve", *flags]))

    assert options()["kv_events_token_ids"] is False and EngineConfig().kv_events_token_ids is False
    assert options("--kv-events-token-ids")["kv_events_token_ids"] is True
    assert options("--kv-events-no-token-ids")["kv_events_token_ids"] is False  # the default now; still accepted
    with pytest.raises(ValueError, match="--kv-events-token-ids and --kv-events-no-token-ids contradict"):
        options("--kv-events-token-ids", "--kv-events-no-token-ids")
    assert options("--kv-events-allow-remote")["kv_events_allow_remote"] is True


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557",
                                      "tcp://example.com:5557", "tcp://eth0:5557", "tcp://[::]:5557"])
@pytest.mark.parametrize("option", ["kv_events_endpoint", "kv_events_replay_endpoint"])
def test_a_remote_event_endpoint_needs_allow_remote(option, endpoint):
    kwargs = {"kv_events_endpoint": "ipc:///tmp/kvshare-events", option: endpoint}
    with pytest.raises(ValueError, match=rf"{option}=.*can be reached from other machines.*--kv-events-allow-remote"):
        EngineConfig(**kwargs)
    assert EngineConfig(**kwargs, kv_events_allow_remote=True).kv_events_allow_remote is True


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:0", "tcp://[::1]:5557",
                                      "tcp://localhost:5557", "ipc:///tmp/kv-events", "inproc://kv"])
def test_local_event_endpoints_need_no_flag(endpoint):
    assert EngineConfig(kv_events_endpoint=endpoint, kv_events_replay_endpoint=endpoint).kv_events_endpoint == endpoint


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_events_endpoint="127.0.0.1:5557"), "kv_events_endpoint='127.0.0.1:5557' is invalid"),
    (dict(kv_events_replay_endpoint="tcp://127.0.0.1:5558"), "kv_events_replay_endpoint needs kv_events_endpoint"),
    (dict(prefix_caching_hash_seed=""), "prefix_caching_hash_seed='' is invalid"),
    (dict(kv_events_token_ids="no"), "kv_events_token_ids='no' is invalid"),
    (dict(kv_events_allow_remote=1), "kv_events_allow_remote=1 is invalid"),
])
def test_bad_kv_event_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
