#!/usr/bin/env python3
"""Measures one OpenAI-compatible engine from outside, the same way for every engine: TTFT of a
long chat prompt cold and with its system prompt cached, and decode tokens/s at batch 1 and 16.

    loadtest/engine_probe.py BASE_URL MODEL [--trials N]

Prints one JSON object. Standard library only, so it runs beside any engine.

- Cold TTFT: a ~1,300-token chat prompt whose system prompt starts with a fresh number, so no
  block of it can be cached; streamed, max_tokens 1; time from sending to the first content.
- Cached TTFT: the same system prompt again with another question, right after the cold one.
- Decode: streamed 64-token answers (ignore_eos) to short prompts; one stream's rate is
  (completion_tokens - 1) / (last content - first content). Batch 16: sixteen such streams sent
  at once; the aggregate is the sum of their (completion_tokens - 1) over the span from the
  first first-content to the last last-content.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

SYSTEM = (
    "You are the dispatch assistant of a regional freight company. You know the depots in "
    "Leeds, Hull, York and Derby, the lorries that serve them and the hours they keep. Answer "
    "in one sentence, quote every consignment number exactly, and never promise a delivery "
    "time the timetable does not support. "
)
FACT = "Depot {i}: opens at {h}:00, closes at {c}:00, serves routes {a} and {b}, dock {d}. "


def system_prompt(salt):
    facts = "".join(
        FACT.format(i=i, h=5 + i % 4, c=18 + i % 5, a=100 + i, b=200 + i, d=i % 9) for i in range(32)
    )
    return f"Session {salt}. " + SYSTEM + facts


def stream(base, model, messages, max_tokens, ignore_eos):
    """Sends one streamed chat request; returns (t_sent, [content times], completion_tokens)."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"{base}: HTTP {r.status}: {r.read()[:300]!r}")
    times, tokens = [], None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        for ch in ev.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    conn.close()
    return t0, times, tokens


def ttft(base, model, salt, question):
    msgs = [{"role": "system", "content": system_prompt(salt)}, {"role": "user", "content": question}]
    t0, times, _ = stream(base, model, msgs, 1, True)
    return times[0] - t0


def decode(base, model, n):
    results = [None] * n

    def one(k):
        msgs = [{"role": "user", "content": f"Write a long story about lorry number {k} and its driver."}]
        results[k] = stream(base, model, msgs, 64, True)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per = [(tok - 1) / (ts[-1] - ts[0]) for _, ts, tok in results]
    span = max(ts[-1] for _, ts, _ in results) - min(ts[0] for _, ts, _ in results)
    return sum(tok - 1 for _, _, tok in results) / span, statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("model")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    salt0 = time.time_ns()
    # One warm-up of each shape (first-call allocations, lazy initialisation).
    ttft(args.base, args.model, salt0, "Warm up.")
    decode(args.base, args.model, 2)
    cold, cached = [], []
    for t in range(args.trials):
        cold.append(ttft(args.base, args.model, salt0 + 1 + t, "Where is consignment 4471 now?"))
        cached.append(ttft(args.base, args.model, salt0 + 1 + t, "When does the Hull depot open?"))
    b1 = [decode(args.base, args.model, 1)[0] for _ in range(args.trials)]
    b16 = [decode(args.base, args.model, 16) for _ in range(args.trials)]
    print(
        json.dumps(
            {
                "ttft_cold_s": statistics.median(cold),
                "ttft_cached_s": statistics.median(cached),
                "decode_b1_tok_s": statistics.median(b1),
                "decode_b16_tok_s": statistics.median(x[0] for x in b16),
                "decode_b16_per_stream_tok_s": statistics.median(x[1] for x in b16),
            }
        )
    )


if __name__ == "__main__":
    main()
