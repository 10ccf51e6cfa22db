#!/usr/bin/env python3
"""The table of an engine comparison (loadtest/engine_vs_vllm.sh's JSON lines): per measure,
each engine's median [min–max] over the rounds, and each engine's ratio to the first engine
computed per round (so both saw the same machine state), median [min–max].

    loadtest/engine_table.py RESULTS.jsonl
"""

import json
import statistics
import sys
from collections import defaultdict

MEASURES = [
    ("ttft_cold_s", "TTFT, 1,332-token chat prompt, cold (s)"),
    ("ttft_cached_s", "TTFT, same system prompt cached (s)"),
    ("decode_b1_tok_s", "decode, batch 1 (tokens/s)"),
    ("decode_b16_tok_s", "decode, batch 16 (tokens/s, all streams)"),
    ("kv_bytes_per_token", "KV cache bytes per token"),
]


def fmt(xs, digits):
    m = statistics.median(xs)
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{min(xs):.{digits}f}–{max(xs):.{digits}f}]"


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    by = defaultdict(dict)  # (round, engine) -> values
    for r in rows:
        v = dict(r["result"])
        v["kv_bytes_per_token"] = r["kv_bytes_per_token"]
        by[r["round"]][r["engine"]] = v
    base = engines[0]
    head = " | ".join(engines) + " | " + " | ".join(f"{e} ÷ {base}" for e in engines[1:])
    print(f"| | {head} |")
    print("|---|" + "---:|" * (2 * len(engines) - 1))
    for key, name in MEASURES:
        digits = 0 if key == "kv_bytes_per_token" else (2 if key.startswith("ttft") else 1)
        cells = [fmt([by[k][e][key] for k in by if e in by[k]], digits) for e in engines]
        ratios = [
            fmt([by[k][e][key] / by[k][base][key] for k in by if e in by[k] and base in by[k]], 2)
            for e in engines[1:]
        ]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
