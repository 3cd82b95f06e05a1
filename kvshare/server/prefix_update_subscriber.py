"""Following one replica's prefix updates (vLLM's KV-events wire format, kvshare.engine.prefix_update_publisher)
from the data-parallel front end: a ZMQ SUB socket on the replica's publisher, read by an asyncio
task on the front end's event loop, so the router's view of that replica (ReplicaState.cached)
is only ever touched on the loop that routes.

Batches carry consecutive sequence numbers. A gap (batches the SUB socket dropped: ZMQ's slow
joiner at startup, or a full high-water mark) is filled from the replica's replay socket before
the newer batch is applied, so the view never skips a BlockRemoved and goes on believing a block
is cached.

A batch that cannot be decoded or applied (a foreign or corrupt publisher) is logged, counted as
lost and skipped: one bad message never ends the subscription. If the subscription itself fails
(the socket), the replica's cached set is cleared, so the router stops favouring a view nobody
updates any more, and the error is raised (the front end's task callback logs it).
"""
from __future__ import annotations

import logging

import msgpack
import zmq
import zmq.asyncio

from kvshare.engine.prefix_update_publisher import END_OF_REPLAY
from kvshare.server.routing import ReplicaState

logger = logging.getLogger("kvshare.server")

REPLAY_TIMEOUT_MS = 5000


def decode_batch(payload: bytes) -> tuple[list, int | None]:
    """(events, data_parallel_rank) of one batch: msgpack of [ts, events] or [ts, events, rank]."""
    batch = msgpack.unpackb(payload, raw=False)
    return batch[1], (batch[2] if len(batch) > 2 else None)


def seq_number(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class PrefixUpdateSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, replica: ReplicaState, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "") -> None:
        self.ctx = ctx
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.next_seq: int | None = None  # the sequence number expected next; None before the first batch
        self.batches = 0  # batches applied (live or replayed)
        self.replayed = 0  # of which came from the replay socket
        self.lost = 0  # batches neither received nor replayable (the view may be stale until cleared)
        self.foreign = 0  # batches from another rank than this replica's, ignored
        self.malformed = 0  # batches that could not be decoded or applied, skipped
        self.failed = False  # the subscription ended with an error: the replica's view was cleared
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Connect now (before the replica publishes anything), so no early batch is lost to the
        # subscription still being in flight; ZMQ reconnects by itself if the publisher is not up yet.
        self._sub.connect(endpoint)

    async def run(self) -> None:
        """Apply batches until cancelled."""
        try:
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("KV events from engine %d: a message of %d frames, not [topic, 8-byte seq, "
                                   "payload]; skipped", self.replica.index, len(frames))
                    continue
                await self._accept(seq_number(frames[1]), frames[2])
        except Exception as e:
            self.failed = True
            self.replica.cached.clear()
            logger.error("KV events from engine %d: the subscription on %s stopped (%s: %s); its cached-prefix view is "
                         "cleared and no longer updated: it is routed to by load and in-flight prefixes only",
                         self.replica.index, self.endpoint, type(e).__name__, e)
            raise
        finally:
            self._sub.close(0)

    async def _accept(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            return  # already applied from a replay
        start = 0 if self.next_seq is None else self.next_seq
        if seq > start and self.replay_endpoint is not None:
            await self._replay(start, seq)
        if self.next_seq is not None and seq > self.next_seq:
            self.lost += seq - self.next_seq
            logger.warning("KV events from engine %d: batches %d..%d are lost; its cached-prefix view may be "
                           "stale", self.replica.index, self.next_seq, seq - 1)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1  # consumed even if it is bad: a replay would only bring it back
        try:
            events, rank = decode_batch(payload)
            if not isinstance(events, list) or not (rank is None or isinstance(rank, int)):
                raise ValueError(f"not [ts, events(, rank)]: {type(events).__name__} events, rank {rank!r}")
            if rank is not None and rank != self.replica.index:
                # Another engine's events on this endpoint (a misconfigured --kv-events-endpoint):
                # believing them would route by a cache this replica does not have.
                self.foreign += 1
                if self.foreign == 1:
                    logger.error("KV events on %s carry data_parallel_rank %s, not %d: ignored (is another server "
                                 "publishing there?)", self.endpoint, rank, self.replica.index)
                return
            if self.replica.alive:  # a dead replica's last batches must not refill what was cleared
                self.replica.apply(events)
        except Exception as e:  # whatever a bad payload raises (msgpack, its shape, an event tag): skip it
            # Events before the bad one may be applied: the view may be off, as after a lost batch.
            self.malformed += 1
            self.lost += 1
            logger.warning("KV events from engine %d: batch %d is malformed (%s: %s); skipped, its cached-prefix view "
                           "may be stale", self.replica.index, seq, type(e).__name__, e)
            return
        self.batches += 1

    async def _replay(self, start: int, stop: int) -> None:
        """Apply the replica's buffered batches start <= seq < stop (those it still has)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_MS):
                    logger.warning("KV events from engine %d: no replay answer in %d ms", self.replica.index,
                                   REPLAY_TIMEOUT_MS)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events from engine %d: a replay answer of %d frames, not [empty, seq, "
                                   "payload]; replay abandoned", self.replica.index, len(frames))
                    return
                _, seq_frame, payload = frames
                if seq_frame == END_OF_REPLAY:
                    return
                seq = seq_number(seq_frame)
                if seq >= stop:
                    continue  # arrives live as well; applied then, in order
                if self.next_seq is None or seq >= self.next_seq:
                    if self.next_seq is not None and seq > self.next_seq:
                        self.lost += seq - self.next_seq
                    self._apply(seq, payload)
                    self.replayed += 1
        finally:
            sock.close(0)
