"""Publishes the engine's prefix updates (kvshare.kvcache.prefix_updates; vLLM's "KV cache events",
hence the `--kv-events-*` flags) over ZMQ in vLLM's wire format, so routers built for
vLLM (llm-d, Dynamo, our own data-parallel front end) can follow which blocks a replica holds.

Wire format (what vLLM's ZmqEventPublisher sends, msgpack of msgspec array-like structs):
  PUB multipart [topic, seq, payload]: seq is the batch's sequence number, 8 bytes big-endian
  signed; payload is msgpack of [ts, [event, ...]] (+ data_parallel_rank when set), each event
  [tag, fields...]: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. token_ids is
  an empty list unless the publisher is made with include_token_ids=True (--kv-events-token-ids).
  Replay (ROUTER, optional): a DEALER sends [b"", start_seq (8 bytes big-endian)]; the replies are
  [b"", seq, payload] for every buffered batch with seq >= start_seq, then [b"", -1, b""].

One batch per engine step that changed the cache. The PUB socket is used by the engine thread
only; the replay socket by its own thread; the buffer between them is under a lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgpack
import zmq

logger = logging.getLogger("kvshare")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_batch(events, ts: float, data_parallel_rank: int | None = None, include_token_ids: bool = True) -> bytes:
    batch = [ts, [e.wire(include_token_ids) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


class ZmqPrefixUpdatePublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, data_parallel_rank: int | None = None,
                 include_token_ids: bool = False) -> None:
        """BlockStored goes out with empty token_ids unless `include_token_ids`: the sockets have no
        authentication, and a block's token ids are a tenant's prompt text. A router needs only
        the hashes; consumers that want the tokens opt in. The replay socket keeps the last
        `buffer_batches` batches (vLLM's buffer_steps, 10,000) for anyone who connects."""
        self.include_token_ids = include_token_ids
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://...:0 resolves here
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._replay_thread = None
        self.replay_endpoint = None
        if replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,),
                                                   name="kv-events-replay", daemon=True)
            self._replay_thread.start()

    def publish(self, events) -> None:
        if not events:
            return
        payload = encode_batch(events, time.time(), self.data_parallel_rank, self.include_token_ids)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big", signed=True), payload), copy=False)

    def _serve_replay(self, sock) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                if not dict(poller.poll(100)):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: [identity, b"", start_seq]
                client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    sock.send_multipart((client, b"", s.to_bytes(8, "big", signed=True), p))
                sock.send_multipart((client, b"", END_OF_REPLAY, b""))
        finally:
            sock.close(0)

    def close(self) -> None:
        self._closing.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close(0)
        self._ctx.term()


def start_publisher(config, pool) -> ZmqPrefixUpdatePublisher:
    """The engine's publisher for config's --kv-events-* options, with the pool's update queue on."""
    from kvshare.kvcache.prefix_updates import PrefixUpdateQueue

    pool.prefix_updates = PrefixUpdateQueue(config.block_size, "CPU")
    publisher = ZmqPrefixUpdatePublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                    config.kv_events_topic, data_parallel_rank=config.data_parallel_rank,
                                    include_token_ids=config.kv_events_token_ids)
    logger.info("KV events: publishing on %s%s", publisher.endpoint,
                f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
    return publisher
