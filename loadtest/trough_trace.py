#!/usr/bin/env python3
"""The trough's trace, a minute at a time.

    RUST_LOG=info,gateway::batch::trough=trace loadtest/batch_trough.sh ...
    loadtest/trough_trace.py DIR/logs/gateway-seed-S-api.log [--width 60]

Each look logs one line per replica (`trough look slot=.. lines=.. cap=.. kv=.. itl=.. stalls=..
streams=.. step_ms=..`); this prints, per bucket of the day, the mean over every replica and look
of the batch lines running, their cap, KV usage against the high-water mark (mean / highest),
the predicted decode step with one more stream against the inter-token promise, the stall share
(mean / highest), the interactive streams and the current decode step in ms. Standard library
only.
"""
import argparse
import collections
import datetime
import re

FIELD = re.compile(r"(\w+)=(\S+)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--width", type=float, default=60.0)
    a = ap.parse_args()
    buckets = collections.defaultdict(lambda: collections.defaultdict(list))
    t0 = None
    with open(a.log) as f:
        for line in f:
            if "trough look" not in line:
                continue
            stamp = line.split(" ", 1)[0].replace("Z", "+00:00")
            try:
                t = datetime.datetime.fromisoformat(stamp).timestamp()
            except ValueError:
                continue
            t0 = t if t0 is None else t0
            b = buckets[int((t - t0) // a.width)]
            for k, v in FIELD.findall(line.split("trough look", 1)[1]):
                try:
                    b[k].append(float(v))
                except ValueError:
                    pass

    def mean(v):
        return sum(v) / len(v) if v else float("nan")

    def top(v):
        return max(v) if v else float("nan")

    print(f"{'t s':>6} {'lines':>5} {'cap':>5} {'kv mean/max':>11} {'itl':>5} {'stalls % mean/max':>17} "
          f"{'streams':>7} {'step ms':>7}")
    for k in sorted(buckets):
        b = buckets[k]
        print(f"{int(k * a.width):6d} {mean(b['lines']):5.1f} {mean(b['cap']):5.1f} "
              f"{mean(b['kv']):5.2f}/{top(b['kv']):.2f} {mean(b['itl']):5.2f} "
              f"{100 * mean(b['stalls']):8.1f}/{100 * top(b['stalls']):<8.1f} "
              f"{mean(b['streams']):7.1f} {mean(b['step_ms']):7.1f}")


if __name__ == "__main__":
    main()
