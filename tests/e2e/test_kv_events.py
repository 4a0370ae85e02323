"""`hybridserve serve --kv-events`: a real ZMQ subscriber receives the cache's events."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.kvcache.events import BlockStored, KVEventBatch, batch_from_wire
from hybridserve.kvcache.hashing import BlockHasher
from tests.e2e.conftest import free_port, wait_until_serving

MODEL = "qwen3-next-80b-a3b"
SERVING = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
BLOCK = 544  # the profile's block size in both groups (full attention, Mamba)


def _registered(base_url: str) -> dict[int, float]:
    """Per group, the blocks the server's cache registered (its /metrics counter)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "hybridserve:hybrid_group_registered_blocks_total":
                out[int(sample.labels["group"])] = sample.value
    return out


def test_a_zmq_subscriber_receives_the_blocks_the_server_cache_registered() -> None:
    port, events_port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--executor", "sim"]
    command += ["--port", str(port), "--sim-speed", "1000", "--kv-events", endpoint]
    command += ["--spec", "none"]  # block hashes as BlockHasher gives them (no MTP lookahead)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    readers: list[subprocess.Popen[str]] = []
    try:
        # docs/serving.md's subscriber, as written but for the port (ZMQ connects before the bind).
        (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", SERVING, re.S) if "SUB" in b]
        snippet = snippet.replace("5557", str(events_port))
        readers.append(
            subprocess.Popen(
                [sys.executable, "-u", "-c", snippet], stdout=subprocess.PIPE, text=True
            )
        )
        wait_until_serving(base_url, process)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # both subscriptions reach the publisher before anything is cached
        shared = [(7 * i) % 250 + 1 for i in range(3 * BLOCK)]
        prompts = [[*shared, *range(1, 51)], [*shared, *range(100, 180)]]
        with httpx.Client(timeout=30.0) as http:
            for prompt in prompts:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                response = http.post(base_url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
        registered = _registered(base_url)
        numbers: list[int] = []
        batches: list[KVEventBatch] = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + 10
        stored: list[BlockStored] = []
        while time.monotonic() < deadline:
            per_group = {g: sum(e.group_id == g for e in stored) for g in registered}
            if registered and per_group == registered:
                break
            if poller.poll(200):
                topic, number, payload = sub.recv_multipart()
                assert topic == b""
                numbers.append(int.from_bytes(number, "big"))
                batch = batch_from_wire(msgpack.unpackb(payload))
                batches.append(batch)
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
        # What the subscriber received is what the cache registered, group by group.
        assert {g: sum(e.group_id == g for e in stored) for g in registered} == registered
        assert {e.group_kind for e in stored} == {"full", "mamba"}
        # Both prompts share three blocks; the second hit them, so they were stored once.
        hashes = BlockHasher(BLOCK).hash_tokens(shared)
        full = [e for e in stored if e.group_id == 0]
        assert [e.block_hashes[0] for e in full] == hashes
        assert [e.parent_block_hash for e in full] == [None, *hashes[:-1]]
        assert [e.token_ids for e in full] == [
            tuple(shared[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)
        ]
        assert all(e.block_size == BLOCK and e.medium == "GPU" for e in stored)
        # Sequence numbers count the batches from 0, with no gap; timestamps do not go back.
        assert numbers == list(range(len(numbers)))
        assert [b.ts for b in batches] == sorted(b.ts for b in batches)
        stdout = readers[0].stdout
        assert stdout is not None
        assert stdout.readline().startswith("0 ['BlockStored'")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert process.stderr is not None
        assert "Traceback" not in process.stderr.read()
    finally:
        for reader in readers:
            reader.kill()
            reader.wait()
        sub.close(0)
        context.term()
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:5557", "tcp://127.0.0.1", "udp://127.0.0.1:5557", "tcp://h:0"]
)
def test_a_bad_kv_events_endpoint_is_refused_naming_the_flag(endpoint: str) -> None:
    from typer.testing import CliRunner

    from hybridserve.cli import app

    result = CliRunner().invoke(app, ["serve", "--kv-events", endpoint, "--port", "1"])
    assert result.exit_code != 0
    assert "--kv-events" in result.output and "tcp://HOST:PORT" in result.output


def _stored(block_id: int, tokens: tuple[int, ...] = (1, 2)) -> BlockStored:
    return BlockStored((block_id.to_bytes(4, "big"),), None, tokens, 16, None, None, group_id=0)


BIG = tuple(range(100_000, 108_000))  # 8,000 token ids, 5 msgpack bytes each: ~40 KB a batch


def test_a_replay_request_resends_the_kept_batches_from_the_asked_sequence_then_the_end() -> None:
    from hybridserve.server.kv_events import END_SEQ, ZmqEventPublisher

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint, buffer_steps=3)
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.connect(replay_endpoint)
    try:
        for block_id in range(5):  # five batches, one event each: the buffer keeps the last 3
            publisher(_stored(block_id))
            deadline = time.monotonic() + 5
            while publisher.sequence <= block_id and time.monotonic() < deadline:
                time.sleep(0.01)
        assert publisher.sequence == 5

        def replay(first: int) -> list[tuple[int, bytes]]:
            client.send_multipart((b"", first.to_bytes(8, "big")))
            got = []
            while client.poll(5_000):
                _, number, payload = client.recv_multipart()
                if number == END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(number, "big"), payload))
            raise AssertionError("no end marker")

        kept = replay(3)
        assert [n for n, _ in kept] == [3, 4]
        batches = [batch_from_wire(msgpack.unpackb(p, raw=False)) for _, p in kept]
        assert [b.events[0].block_hashes for b in batches] == [(b"\0\0\0\3",), (b"\0\0\0\4",)]
        assert [n for n, _ in replay(0)] == [2, 3, 4]  # older batches are gone
        assert replay(9) == []  # nothing past the newest: just the end
        client.send_multipart((b"", b"bad"))  # a malformed request gets the end alone ...
        assert client.poll(5_000) and client.recv_multipart() == [b"", END_SEQ, b""]
        assert [n for n, _ in replay(4)] == [4]  # ... and the socket still answers
        bare = context.socket(zmq.DEALER)  # a DEALER without the empty delimiter frame
        bare.connect(replay_endpoint)
        bare.send((4).to_bytes(8, "big"))
        assert bare.poll(5_000) and int.from_bytes(bare.recv_multipart()[0], "big") == 4
        assert bare.poll(5_000) and bare.recv_multipart() == [END_SEQ, b""]
        bare.close(0)
    finally:
        client.close(0)
        context.term()
        publisher.close()


def test_a_replay_endpoint_needs_kv_events_and_its_own_port() -> None:
    from typer.testing import CliRunner

    from hybridserve.cli import app

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    runner = CliRunner()
    alone = runner.invoke(app, ["serve", "--kv-events-replay", endpoint, "--port", "1"])
    assert alone.exit_code != 0 and "needs --kv-events" in alone.output
    same = ["serve", "--kv-events", endpoint, "--kv-events-replay", endpoint, "--port", "1"]
    result = runner.invoke(app, same)
    assert result.exit_code != 0 and "--kv-events-replay" in result.output


def test_a_replay_longer_than_zmqs_default_queue_arrives_whole_to_a_slow_client() -> None:
    """3,000 kept batches of ~40 KB (more than the socket buffers hold), asked for at once and
    read a second later: a ROUTER with ZMQ's default high-water mark (1,000 messages a pipe)
    would drop part of them and the end marker."""
    from hybridserve.server.kv_events import END_SEQ, ZmqEventPublisher

    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay_endpoint, buffer_steps=3_000
    )
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.connect(replay_endpoint)
    try:
        for block_id in range(3_000):
            publisher(_stored(block_id, BIG))
            deadline = time.monotonic() + 5
            while publisher.sequence <= block_id and time.monotonic() < deadline:
                time.sleep(0.0005)
        assert publisher.sequence == 3_000
        client.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(1.0)
        numbers = []
        while client.poll(5_000):
            _, number, _payload = client.recv_multipart()
            if number == END_SEQ:
                break
            numbers.append(int.from_bytes(number, "big"))
        else:
            raise AssertionError(f"no end marker after {len(numbers)} batches")
        assert numbers == list(range(3_000))
    finally:
        client.close(0)
        context.term()
        publisher.close()
