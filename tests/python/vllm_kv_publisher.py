"""A KV event publisher speaking vLLM's ZMQ wire format, for kvgate's end-to-end tests.

The message structs are copied in shape from vLLM's `vllm/distributed/kv_events.py` (main
branch, commit 0181ea3173e5: `EventBatch`, `KVCacheEvent` with `tag=True`, `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; hashes `bytes | int`), and the sockets behave like its
`ZmqEventPublisher`: a PUB socket sends `(topic, seq as 8 bytes big-endian, msgpack batch)`,
a ROUTER socket answers a replay request `(identity, b"", start seq)` with every buffered
`(identity, b"", seq, batch)` from that sequence on, then `(identity, b"", -1, b"")`.
`--layout array` encodes with `array_like=True` instead (SGLang and older vLLM).

Usage: vllm_kv_publisher.py --pub tcp://127.0.0.1:P --replay tcp://127.0.0.1:R \
           --stream FILE [--layout map|array] [--drop-batch K ...] [--start-seq N] [--no-hello]
It publishes an empty "hello" batch every 50 ms until a line `go` arrives on stdin (so a
subscriber can show it is connected), then the stream's batches, printing `sent N` when done,
and keeps serving replays until stdin closes. The stream's K-th batch (from 0) given to
`--drop-batch` is kept in the replay buffer but never sent on PUB: a gap the subscriber must
fill. `--no-hello` publishes the stream as soon as the sockets are bound, as an engine that
restarts and serves a request at once does: a subscriber that is not connected yet misses it
on PUB and must catch up from the replay socket.
"""

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import msgspec
import zmq


def structs(array_like: bool):
    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def as_hash(h):
    # The stream file writes bytes hashes as {"hex": "..."} and integers as numbers.
    return bytes.fromhex(h["hex"]) if isinstance(h, dict) else h


def build(ev, BlockStored, BlockRemoved, AllBlocksCleared):
    kind = ev["type"]
    if kind == "BlockStored":
        parent = ev["parent_block_hash"]
        return BlockStored(
            block_hashes=[as_hash(h) for h in ev["block_hashes"]],
            parent_block_hash=None if parent is None else as_hash(parent),
            token_ids=ev["token_ids"],
            block_size=ev["block_size"],
            lora_id=ev.get("lora_id"),
            medium=ev.get("medium"),
            lora_name=ev.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=[as_hash(h) for h in ev["block_hashes"]], medium=ev.get("medium"))
    return AllBlocksCleared()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--stream", required=True)
    ap.add_argument("--layout", choices=["map", "array"], default="map")
    ap.add_argument("--drop-batch", type=int, action="append", default=[])
    ap.add_argument("--start-seq", type=int, default=0)
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--no-hello", action="store_true")
    a = ap.parse_args()

    KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = structs(a.layout == "array")
    enc = msgspec.msgpack.Encoder()
    stream = json.load(open(a.stream))
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(a.pub)
    router = ctx.socket(zmq.ROUTER)
    router.bind(a.replay)
    topic = a.topic.encode()
    lock = threading.Lock()
    buffer: list[tuple[int, bytes]] = []
    seq = a.start_seq

    def publish(events, drop=False):
        nonlocal seq
        payload = enc.encode(KVEventBatch(ts=time.time(), events=events))
        with lock:
            buffer.append((seq, payload))
            if not drop:
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            seq += 1

    def serve_replays():
        while True:
            if not router.poll(50):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start = int.from_bytes(start, "big")
            with lock:
                for s, payload in list(buffer):
                    if s >= start:
                        router.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    threading.Thread(target=serve_replays, daemon=True).start()

    go = threading.Event()
    if a.no_hello:
        go.set()

    def read_stdin():
        for line in sys.stdin:
            if line.strip() == "go":
                go.set()
        # stdin closed: the test is done with us
        os._exit(0)

    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", flush=True)
    while not go.is_set():
        publish([])
        time.sleep(0.05)
    n = 0
    for k, batch in enumerate(stream["batches"]):
        publish([build(ev, BlockStored, BlockRemoved, AllBlocksCleared) for ev in batch], k in a.drop_batch)
        n += 1
        time.sleep(0.005)
    print(f"sent {n}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
