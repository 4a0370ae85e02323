"""`serve --kv-events tcp://HOST:PORT`: the cache's KV events on a ZMQ PUB socket, as vLLM's
`ZmqEventPublisher` (vllm/distributed/kv_events.py) sends them.

Each message is three frames: the topic (empty unless set), the batch's sequence number as 8
big-endian bytes (0, 1, 2, ... per publisher), and the msgpack encoding of the batch,
`[ts, [event, ...]]`, each event the tagged array of `hybridserve.kvcache.events.wire`
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_id, group_kind]`, `["BlockRemoved", block_hashes, medium,
group_id]`, `["AllBlocksCleared"]`). Block hashes are bytes (msgpack bin).

The engine thread only puts events on a bounded queue (never waits: when the queue is full an
event is dropped and counted in `dropped`); a background thread takes what has accumulated,
publishes it as one batch, and on `close` sends what is left before closing the socket.

A subscriber that sees a gap in the sequence numbers missed batches. With a replay endpoint
(`--kv-events-replay tcp://HOST:PORT`, vLLM's `replay_endpoint`) the publisher keeps the last
`buffer_steps` batches (vLLM's default, 10,000) and answers on a ZMQ ROUTER socket: a DEALER
client sends `[b"", seq]` (or just `[seq]`), the first sequence number it wants as 8 big-endian
bytes, and receives `[b"", seq, payload]` (`[seq, payload]`) for every kept batch from there on,
then `[b"", -1 as 8 signed bytes, b""]`, the end; a malformed request gets the end alone. (A REQ
socket takes only one reply per request, so it sees the first batch only.) The ROUTER queues a
whole replay however slowly the client reads (no high-water mark).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.events import KVEvent, KVEventBatch, attach_events, batch_wire

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

FLAG = "kv_events (--kv-events)"
REPLAY_FLAG = "kv_events_replay (--kv-events-replay)"
MAX_BATCH = 4_096  # events per published batch at most
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's KVEventsConfig.buffer_steps)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


def check_endpoint(endpoint: str, *, flag: str = FLAG) -> str:
    """`endpoint` if it is tcp://HOST:PORT with a port in 1-65535; else a ConfigError naming
    `flag` (--kv-events)."""
    fix = "use tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557"
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError:
        raise ConfigError(flag, endpoint, fix) from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or not 1 <= port <= 65535:
        raise ConfigError(flag, endpoint, fix)
    if parts.path or parts.query or parts.fragment:
        raise ConfigError(flag, endpoint, fix)
    return endpoint


def check_kv_event_flags(endpoint: str | None, replay_endpoint: str | None) -> None:
    """Check `--kv-events` and `--kv-events-replay` without binding anything (`serve` does it
    before it loads a model). Raises ConfigError naming the flag."""
    if endpoint is None:
        if replay_endpoint is not None:
            raise ConfigError(REPLAY_FLAG, replay_endpoint, "it needs --kv-events as well")
        return
    check_endpoint(endpoint)
    if replay_endpoint is not None:
        check_endpoint(replay_endpoint, flag=REPLAY_FLAG)
        if replay_endpoint == endpoint:
            raise ConfigError(REPLAY_FLAG, replay_endpoint, "use another port than --kv-events'")


class ZmqEventPublisher:
    """Publishes KV events on a ZMQ PUB socket bound to `endpoint` (see the module docstring).

    Call it with each event (from one thread: the engine's). `close()` flushes and stops."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        max_queue: int = 100_000,
        replay_endpoint: str | None = None,
        buffer_steps: int = BUFFER_STEPS,
    ) -> None:
        check_kv_event_flags(endpoint, replay_endpoint)
        if max_queue < 1:
            raise ConfigError("max_queue", max_queue, "use 1 or more events")
        if buffer_steps < 1:
            raise ConfigError("buffer_steps", buffer_steps, "use 1 or more batches")
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ConfigError(
                FLAG,
                endpoint,
                f"it needs pyzmq and msgpack ({exc}): pip install 'hybridserve[server]'",
            ) from None
        self._packb = msgpack.packb
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEvent] = queue.Queue(maxsize=max_queue)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket = self._bind(zmq.PUB, endpoint, FLAG)
        # Sockets are used by the sending thread only (ZMQ sockets are not thread-safe).
        self._replay = None
        if replay_endpoint is not None:
            try:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, REPLAY_FLAG)
            except ConfigError:
                self._socket.close(0)
                self._context.term()
                raise
        self.replay_endpoint = replay_endpoint
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.sequence = 0  # the next batch's number
        self.dropped = 0  # events lost because the queue was full
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridserve-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, flag: str) -> zmq.Socket[bytes]:
        import zmq

        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 1_000)  # ms to deliver what is sent on close
        if kind == zmq.ROUTER:
            # A replay is queued whole (a full-queue ROUTER would drop it silently), and a
            # client that is gone is an error to log rather than a silent discard.
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(0)
            if kind == zmq.PUB:
                self._context.term()
            raise ConfigError(
                flag, endpoint, f"cannot bind it ({exc}): use a free local port"
            ) from None
        return socket

    def __call__(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            if not self.dropped:
                logger.warning("KV events: the queue is full; events are being dropped")
            self.dropped += 1

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    first = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                events = [first]
                while len(events) < MAX_BATCH:
                    try:
                        events.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._send(KVEventBatch(time.time(), tuple(events)))
        finally:  # the sockets belong to this thread: it closes them
            self._socket.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, batch: KVEventBatch) -> None:
        payload = self._packb(batch_wire(batch), use_bin_type=True)
        number = self.sequence.to_bytes(8, "big")
        self._socket.send_multipart((self._topic, number, payload))
        if self._replay is not None:
            self._buffer.append((self.sequence, payload))
        self.sequence += 1

    def _serve_replays(self, most: int = 16) -> None:
        """Answer up to `most` replay requests waiting on the ROUTER socket (see the module
        docstring), so that publishing goes on between them."""
        import zmq

        replay = self._replay
        if replay is None:
            return
        for _ in range(most):
            if not replay.poll(0):
                return
            frames = replay.recv_multipart()
            # [client, b"", seq] from a DEALER that sends a delimiter, [client, seq] without.
            envelope: tuple[bytes, ...] = (frames[0],)
            request = frames[1] if len(frames) == 2 else b""
            if len(frames) == 3 and not frames[1]:
                envelope, request = (frames[0], b""), frames[2]
            if len(request) != 8:
                logger.warning(
                    "KV events replay: a malformed request (%d frames) gets the end only",
                    len(frames),
                )
                request = END_SEQ
            start = int.from_bytes(request, "big", signed=True)
            try:
                if start >= 0:
                    for number, payload in self._buffer:
                        if number >= start:
                            replay.send_multipart((*envelope, number.to_bytes(8, "big"), payload))
                replay.send_multipart((*envelope, END_SEQ, b""))
            except zmq.ZMQError as exc:  # the client went away
                logger.warning("KV events replay: a client left mid-replay (%s)", exc)

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued, then close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            # Its sockets are still in use: leave them (and the context) to the daemon thread.
            logger.warning("KV events: the publisher did not stop within %.1f s", timeout_s)
            return
        self._context.term()


def attach_kv_events(
    app: Any, endpoint: str | None, replay_endpoint: str | None = None
) -> ZmqEventPublisher | None:
    """Publish the served engine's KV events at `endpoint` (nothing when it is None), answering
    replay requests at `replay_endpoint` when given: bind now (a bad or busy endpoint fails
    before serving starts), attach to the cache, and close the publisher once the app's
    lifespan has stopped the engine. `app` is from `create_app`."""
    check_kv_event_flags(endpoint, replay_endpoint)
    if endpoint is None:
        return None
    publisher = ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint)
    state = app.state.hybridserve
    attach_events(state.parts.cache, publisher, tokens_of=state.parts.engine.token_ids)
    app.router.lifespan_context = _closing(app.router.lifespan_context, publisher.close)
    return publisher


def _closing(lifespan: Callable[[Any], Any], close: Callable[[], None]) -> Callable[[Any], Any]:
    @asynccontextmanager
    async def wrapped(app: Any) -> AsyncIterator[Any]:
        try:
            async with lifespan(app) as value:
                yield value
        finally:
            await asyncio.to_thread(close)

    return wrapped
