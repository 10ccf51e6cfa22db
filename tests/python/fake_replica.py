"""A misbehaving replica for scripts/chaos.sh: it answers /health (so the gateway admits it)
and then breaks one promise on cue, as a buggy engine, a wrong upstream or an overloaded box
would. Standard library only (plus pyzmq and msgspec for --flood).

Usage: fake_replica.py --port P --mode MODE [--flood tcp://*:Z]
Modes, for POST /v1/chat/completions and /v1/completions:
  ok            a proper answer (JSON, or SSE with [DONE] when stream is asked for)
  invalid_json  200 application/json whose body is not JSON
  html          200 text/html, whatever was asked for (a web server where a replica should be)
  endless       SSE token events every 5 ms, never ending (whatever max_tokens says)
  endless_body  200 application/json, chunked, bytes forever
  short_body    content-length 1000, 10 bytes sent, then nothing
  models_stall  generation is ok, but GET /v1/models sends its head and half a body, then stalls
--flood ENDPOINT publishes vLLM-format KV events on a ZMQ PUB socket: BlockStored batches of
1,000 chained blocks as fast as it can, never a BlockRemoved (a publisher that forgets its
removals). /get_load and /metrics (vLLM's names) report a cache of 4,096 blocks of 16 tokens.
Prints "serving PORT" once listening.
"""

import argparse
import json
import os
import random
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

TOKEN = json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "Qwen3-8B",
                    "choices": [{"index": 0, "delta": {"content": "tok "}}]})
WHOLE = json.dumps({"id": "x", "object": "chat.completion", "model": "Qwen3-8B",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}})
MODELS = json.dumps({"object": "list", "data": [{"id": "Qwen3-8B", "object": "model",
                                                 "max_model_len": 40960}]})


class Server(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def handler(mode):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send(self, status, ctype, body, extra=()):
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.send(200, "application/json", b"{}")
            elif self.path == "/v1/models" and mode == "models_stall":
                body = MODELS.encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                time.sleep(3600)
            elif self.path == "/v1/models":
                self.send(200, "application/json", MODELS.encode())
            elif self.path == "/metrics":
                # A vLLM-style page: its load, and its cache size (4,096 blocks).
                self.send(200, "text/plain", (
                    'vllm:num_requests_running{engine="0"} 0.0\n'
                    'vllm:num_requests_waiting{engine="0"} 0.0\n'
                    'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0\n').encode())
            elif self.path == "/get_load":
                self.send(200, "application/json", json.dumps([{
                    "dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                    "kv_cache_usage": 0.0, "max_total_num_tokens": 4096 * 16}]).encode())
            else:
                self.send(404, "application/json", b'{"error": {"message": "not found"}}')

        def do_POST(self):
            n = int(self.headers.get("content-length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            stream = bool(req.get("stream"))
            if mode == "invalid_json":
                self.send(200, "application/json", b"Internal things went sideways")
            elif mode == "html":
                self.send(200, "text/html", b"<!doctype html><html><body>Welcome to nginx!</body></html>")
            elif mode == "short_body":
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "1000")
                self.end_headers()
                self.wfile.write(b'{"id": "x",')
                self.wfile.flush()
                time.sleep(3600)
            elif mode == "endless_body":
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                chunk = b"x" * 65536
                frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
                try:
                    while True:
                        self.wfile.write(frame)
                except OSError:
                    pass
            elif stream or mode == "endless":
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                count = None if mode == "endless" else int(req.get("max_tokens") or 16)
                try:
                    i = 0
                    while count is None or i < count:
                        ev = f"data: {TOKEN}\n\n".encode()
                        self.wfile.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
                        self.wfile.flush()
                        i += 1
                        time.sleep(0.005)
                    ev = b"data: [DONE]\n\n"
                    self.wfile.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n0\r\n\r\n")
                except OSError:
                    pass
            else:
                self.send(200, "application/json", WHOLE.encode())

    return H


def flood(endpoint):
    import msgspec
    import zmq

    class Stored(msgspec.Struct, tag="BlockStored", array_like=False, omit_defaults=True):
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object
        medium: object

    class Batch(msgspec.Struct, array_like=False, omit_defaults=True):
        ts: float
        events: list

    enc = msgspec.msgpack.Encoder()
    sock = zmq.Context().socket(zmq.PUB)
    sock.bind(endpoint)
    time.sleep(1.0)  # let the gateway subscribe
    seq, parent, h = 0, None, random.getrandbits(60)
    while True:
        events = []
        for _ in range(1000):
            h += 1
            events.append(Stored(block_hashes=[h], parent_block_hash=parent,
                                 token_ids=[random.randrange(1000) for _ in range(16)],
                                 block_size=16, lora_id=None, medium=None))
            parent = h
        sock.send_multipart([b"kv-events", seq.to_bytes(8, "big"), enc.encode(Batch(ts=time.time(), events=events))])
        seq += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--flood")
    a = ap.parse_args()
    srv = Server(("127.0.0.1", a.port), handler(a.mode))
    if a.flood:
        threading.Thread(target=flood, args=(a.flood,), daemon=True).start()
    print(f"serving {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
