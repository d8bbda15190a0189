"""Residency events over ZMQ, as a vLLM engine publishes its KV events.

- A PUB socket (``events_zmq``) sends multipart messages ``[topic, seq,
  payload]``: the topic is the tenant's ``events_topic``, else its name, ``seq`` the batch's number (8
  bytes, big-endian; one counter for the node, every topic), ``payload`` a
  msgpack batch (see vllm_wire). A subscriber that sees a number skipped
  lost a batch: ZMQ dropped it at the high-water mark, or this publisher
  fell ``events_queue`` events behind the store (the number of a batch it
  could not build is skipped on purpose, so the loss shows).
- A ROUTER socket (``events_zmq_replay``) answers a request ``[b"", seq (8
  bytes, big-endian)]`` with every batch still kept from that number on
  (``[b"", topic, seq, payload]`` each), then ``[b"", b"", -1 (8 bytes,
  signed), b""]``, as vLLM's replay does. The last ``events_backlog``
  batches are kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from kvstore.events.bus import EventBus, Gap
from kvstore.events.vllm_wire import Encoding, pack_batch, vllm_events
from kvstore.metrics import Metrics

log = logging.getLogger("kvstore.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HWM = 100_000  # messages ZMQ queues per subscriber before it drops


class ZmqPublisher:
    def __init__(
        self,
        bus: EventBus,
        endpoint: str,
        replay: str | None,
        encoding: Encoding,
        mediums: dict[str, str],
        backlog: int,
        metrics: Metrics,
    ) -> None:
        self._bus = bus
        self._encoding = encoding
        self._mediums = mediums
        self._metrics = metrics
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._kept: deque[tuple[int, bytes, bytes]] = deque(maxlen=backlog)  # (seq, topic, payload)
        self._sub = bus.subscribe()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._publish()))
        if self._router is not None:
            self._tasks.append(loop.create_task(self._replay()))
        log.info("events on ZMQ %s (replay: %s, encoding %s)", self.endpoint, self.replay_endpoint, self._encoding)

    async def _publish(self) -> None:
        while not self._sub.ended:
            items = await self._sub.next_batch()
            by_topic: dict[str, list[Any]] = {}
            for item in items:
                if isinstance(item, Gap):
                    self._flush(by_topic)
                    by_topic = {}
                    self._seq += 1  # a batch that cannot be built: its number is skipped
                    continue
                by_topic.setdefault(item.topic or item.tenant, []).extend(
                    vllm_events(item, self._mediums, self._encoding)
                )
            self._flush(by_topic)  # the last events too, when the daemon stops

    def _flush(self, by_topic: dict[str, list[Any]]) -> None:
        ts = time.time()
        for topic, events in by_topic.items():
            seq, self._seq = self._seq, self._seq + 1
            t, payload = topic.encode(), pack_batch(ts, events)
            self._kept.append((seq, t, payload))
            try:
                self._pub.send_multipart([t, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                self._metrics.inc("kvstore_event_batches_total", transport="zmq")
            except zmq.Again:
                self._metrics.inc("kvstore_events_dropped_total", len(events))

    async def _replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ZMQ replay: a malformed request (%d frames) ignored", len(frames))
                continue
            who, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, topic, payload in list(self._kept):
                if seq >= start:
                    await self._router.send_multipart([who, b"", topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([who, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sub.close()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()
