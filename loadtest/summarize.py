#!/usr/bin/env python3
"""Summarises a loadtest/sweep.sh folder: for every rate and target, the median and the range
(min-max) over seeds of goodput, served and shed requests, p50/p95/p99 TTFT and prefix hit
ratio, and per seed the ratio of each target's goodput, p95 and p99 TTFT to the base target's
in the same seed and rate (the first target, or --base NAME). Where the reports carry the
oracle's TTFT floor (sim fleets), a `floor` row gives it with the same ratios: the lowest any
router could reach on that traffic.

    python3 loadtest/summarize.py DIR [--base NAME]
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


FLOOR = "floor (oracle cache, idle replica)"


def fmt(values, unit="", digits=2, scale=1.0):
    v = [x * scale for x in values]
    med = statistics.median(v)
    if len(v) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} [{min(v):.{digits}f}–{max(v):.{digits}f}]"


def main(folder: Path, base_name: str | None = None) -> None:
    runs = defaultdict(list)  # (rate, target) -> [run]
    by_seed = defaultdict(dict)  # (rate, seed) -> {target: run}
    floors = defaultdict(list)  # rate -> [floor run-shaped dict]
    targets, meta = [], None
    for report in sorted(folder.glob("seed-*-rate-*/report.json")):
        r = json.loads(report.read_text())
        meta = meta or r
        for t in r["targets"]:
            name = t["name"] if isinstance(t, dict) else t
            if name not in targets:
                targets.append(name)
        for run in r["runs"]:
            key = (run["rate"], run["target"])
            runs[key].append(run)
            by_seed[(run["rate"], r["seed"])][run["target"]] = run
        for o in r.get("oracle") or []:
            if o.get("ttft_floor_s"):
                f = {"rate": o["rate"], "ttft_s": o["ttft_floor_s"]}
                floors[o["rate"]].append(f)
                by_seed[(o["rate"], r["seed"])][FLOOR] = f
    if not runs:
        sys.exit(f"no seed-*-rate-*/report.json under {folder}")
    seeds = sorted({s for (_, s) in by_seed})
    print(f"# Sweep summary: {meta['workload']} workload, seeds {', '.join(map(str, seeds))}")
    print()
    slo = meta["slo"]
    print(
        f"{meta['duration_s']:.0f} s per run after {meta['warmup_s']:.0f} s warm-up; SLO TTFT "
        f"{(slo.get('ttft_s') or 0) * 1e3:.0f} ms, inter-token {(slo.get('itl_s') or 0) * 1e3:.0f} ms "
        f"(p95 per request). Median [min–max] over seeds; every run with fresh processes."
    )
    print()
    base = base_name or targets[0]
    if base not in targets:
        sys.exit(f"--base {base}: not a target here ({', '.join(targets)})")
    print(
        "| rate/s | target | goodput/s | "
        f"goodput ÷ {base} | ok | shed | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | "
        f"p95 ÷ {base} | p99 ÷ {base} | prefix hit |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(rate, t, value):
        out = []
        for (rr, _), g in sorted(by_seed.items()):
            if rr == rate and t in g and base in g:
                b = value(g[base])
                if b and value(g[t]) is not None:
                    out.append(value(g[t]) / b)
        return fmt(out) if out else "-"

    def pct(q):
        return lambda run: (run.get("ttft_s") or {}).get(q)

    for rate in sorted({r for (r, _) in runs}):
        for t in targets:
            rs = runs.get((rate, t), [])
            if not rs:
                continue
            print(
                f"| {rate:g} | {t} | {fmt([x['goodput_requests_per_s'] for x in rs])} | "
                f"{ratio(rate, t, lambda run: run['goodput_requests_per_s'])} | "
                f"{fmt([x['ok'] for x in rs], digits=0)} | {fmt([x['shed'] for x in rs], digits=0)} | "
                f"{fmt([x['ttft_s']['p50'] for x in rs if x.get('ttft_s')], digits=0, scale=1e3)} | "
                f"{fmt([x['ttft_s']['p95'] for x in rs if x.get('ttft_s')], digits=0, scale=1e3)} | "
                f"{fmt([x['ttft_s']['p99'] for x in rs if x.get('ttft_s')], digits=0, scale=1e3)} | "
                f"{ratio(rate, t, pct('p95'))} | {ratio(rate, t, pct('p99'))} | "
                f"{fmt([x['prefix_hit_ratio'] for x in rs], unit='%', digits=1, scale=100)} |"
            )
        if floors.get(rate):
            fs = floors[rate]
            print(
                f"| {rate:g} | {FLOOR} | - | - | - | - | "
                f"{fmt([x['ttft_s']['p50'] for x in fs], digits=0, scale=1e3)} | "
                f"{fmt([x['ttft_s']['p95'] for x in fs], digits=0, scale=1e3)} | "
                f"{fmt([x['ttft_s']['p99'] for x in fs], digits=0, scale=1e3)} | "
                f"{ratio(rate, FLOOR, pct('p95'))} | {ratio(rate, FLOOR, pct('p99'))} | - |"
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    base_arg = None
    if "--base" in args:
        i = args.index("--base")
        base_arg = args[i + 1]
        del args[i : i + 2]
    main(Path(args[0] if args else "."), base_arg)
