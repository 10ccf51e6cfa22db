#!/usr/bin/env python3
"""Where the interactive tail of a batch_trough.sh run comes from, from the gateway's access logs.

    loadtest/batch_tail.py --api DIR --alone DIR --seed S [--list]

For the *api* run of seed S (in --api DIR) against the *alone* run of the same seed (in --alone
DIR, the same folder by default): the slowest 1% of the interactive route's streamed requests
(their count, p99, the share of their TTFT spent in the gateway, their hold reasons and every
run's hold reasons), then a minute-by-minute timeline of the day: batch lines started, `stalls`
holds, long prompts that found no cache (over 1,500 tokens, at most 128 cached), and the p99
TTFT of each run in that minute. `--list` prints the slowest 1% one by one. Standard library
only.
"""
import argparse
import collections
import json


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def interactive(recs):
    return [r for r in recs if r.get("route") == "interactive" and r.get("status") == 200
            and r.get("ttft_ms") is not None]


def holds(r, reason=None):
    return [h for h in r.get("holds") or [] if reason is None or h["reason"] == reason]


def tail(name, recs, show):
    recs = sorted(recs, key=lambda r: r["ttft_ms"])
    k = max(1, len(recs) // 100)
    slow = recs[-k:]
    t0 = min(r["ts"] for r in recs)
    share = sum(r.get("queue_ms") or 0 for r in slow) / sum(r["ttft_ms"] for r in slow)
    in_tail = collections.Counter(h["reason"] for r in slow for h in holds(r))
    every = collections.Counter(h["reason"] for r in recs for h in holds(r))
    print(f"{name}: {len(recs)} requests, slowest {k}: p99 {recs[-k]['ttft_ms']:.0f} ms, "
          f"gateway share {share:.0%}, holds among them {dict(in_tail)}, holds in the run {dict(every)}")
    if show:
        for r in slow:
            hs = [(h["reason"], round(h["ms"])) for h in holds(r)]
            print(f"  t={r['ts'] - t0:7.1f} s {r.get('replica')} ttft {r['ttft_ms']:.0f} ms "
                  f"queue {r.get('queue_ms') or 0:.0f} predicted {r.get('predicted_ttft_ms') or 0:.0f} "
                  f"prompt {r.get('prompt_tokens')} cached {r.get('cached_tokens')} holds {hs}")


def minutes(recs, t0, width):
    m = collections.defaultdict(lambda: {"starts": 0, "stalls": 0, "cold": 0, "ttft": []})
    for r in recs:
        b = int((r["ts"] - t0) // width)
        if r.get("route") == "batch" and r.get("status") == 200:
            m[b]["starts"] += 1
        if r.get("route") == "interactive" and r.get("status") == 200 and r.get("ttft_ms") is not None:
            m[b]["ttft"].append(r["ttft_ms"])
            m[b]["stalls"] += len(holds(r, "stalls"))
            if r["prompt_tokens"] > 1500 and (r.get("cached_tokens") or 0) <= 128:
                m[b]["cold"] += 1
    return m


def p99(v):
    v = sorted(v)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", required=True)
    ap.add_argument("--alone")
    ap.add_argument("--seed", required=True)
    ap.add_argument("--width", type=float, default=60.0, help="timeline bucket, seconds")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    api = load(f"{a.api}/logs/access-seed-{a.seed}-api.jsonl")
    alone = load(f"{a.alone or a.api}/logs/access-seed-{a.seed}-alone.jsonl")
    ia, il = interactive(api), interactive(alone)
    tail(f"seed {a.seed} api", ia, a.list)
    tail(f"seed {a.seed} alone", il, a.list)
    ma = minutes(api, min(r["ts"] for r in ia), a.width)
    ml = minutes(alone, min(r["ts"] for r in il), a.width)
    print(f"{'t s':>6} {'lines started':>13} {'stalls holds api/alone':>22} {'cold long api/alone':>19} "
          f"{'p99 ms api/alone':>17}")
    for b in sorted(set(ma) | set(ml)):
        x, y = ma[b], ml[b]
        print(f"{int(b * a.width):6d} {x['starts']:13d} {x['stalls']:>11d} / {y['stalls']:<8d} "
              f"{x['cold']:>9d} / {y['cold']:<7d} {p99(x['ttft']):8.0f} / {p99(y['ttft']):<6.0f}")
    print("totals: stalls holds", sum(v["stalls"] for v in ma.values()), "/",
          sum(v["stalls"] for v in ml.values()), "; cold long prompts",
          sum(v["cold"] for v in ma.values()), "/", sum(v["cold"] for v in ml.values()))


if __name__ == "__main__":
    main()
