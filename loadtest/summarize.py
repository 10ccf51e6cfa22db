#!/usr/bin/env python3
"""Summarises a loadtest/sweep.sh folder: for every rate and target, the median and the range
(min-max) over seeds of goodput, served and shed requests, p50/p95/p99 TTFT and prefix hit
ratio, and per seed the ratio of each target's goodput, p95 and p99 TTFT to the base target's
in the same seed and rate (the first target, or --base NAME). Where the reports carry the
oracle's TTFT floor (sim fleets), a `floor` row gives it with the same ratios: the lowest any
router could reach on that traffic. Where a kvgate gateway wrote a full access log
(logs/access-NAME.jsonl; sweep.sh turns it on), a second table says where its tail comes from
and how well it predicted: time queued in the gateway at p99 and as a share of the TTFT p99,
the share of the slowest 5% of requests' TTFT spent queued in the gateway, and the error of
placement's predicted TTFT against the measured one from sending to the first token
(|predicted - measured| / measured, p50 and p90 over requests after the warm-up).

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
    tail_table(folder, float(meta.get("warmup_s") or 0.0))


def quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def access_stats(path: Path, warmup_s: float):
    """Tail source and prediction error from one gateway's access log, warm-up left out."""
    recs = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("ttft_ms") is not None and r.get("status") == 200:
            recs.append(r)
    if not recs:
        return None
    start = min(r["ts"] for r in recs)
    recs = [r for r in recs if r["ts"] >= start + warmup_s]
    if not recs:
        return None
    # The tail is the streamed requests' (an unstreamed record's ttft_ms is an estimate).
    streamed = [r for r in recs if r.get("stream") is not False] or recs
    ttft = [r["ttft_ms"] for r in streamed]
    queue = [r.get("queue_ms") or 0.0 for r in streamed]
    p95 = quantile(ttft, 0.95)
    slow = [r for r in streamed if r["ttft_ms"] >= p95]
    slow_share = sum(r.get("queue_ms") or 0.0 for r in slow) / max(1e-9, sum(r["ttft_ms"] for r in slow))

    # Placement predicts the replica's part: from sending to the first token, so the time the
    # request spent queued in the gateway is taken off the measured TTFT before comparing. For
    # an unstreamed answer the measured TTFT is the gateway's estimate (the whole answer less
    # its decode at the learnt step).
    def errors(rs):
        out = []
        for r in rs:
            replica_ms = r["ttft_ms"] - (r.get("queue_ms") or 0.0)
            if r.get("predicted_ttft_ms") is not None and replica_ms > 0:
                out.append(abs(r["predicted_ttft_ms"] - replica_ms) / replica_ms)
        return out

    errs = errors(recs)
    whole = errors([r for r in recs if r.get("stream") is False])
    # The same per replica (those with 20 predicted requests or more): a replica whose speed
    # the gateway has wrong shows here when the pooled figure hides it.
    by_replica = defaultdict(list)
    for r in recs:
        by_replica[r.get("replica")].append(r)
    replica_p90 = [
        quantile(e, 0.9) for e in (errors(rs) for rs in by_replica.values()) if len(e) >= 20
    ]
    return {
        "queue_p99": quantile(queue, 0.99),
        "queue_share_p99": quantile(queue, 0.99) / max(1e-9, quantile(ttft, 0.99)),
        "slow_share": slow_share,
        "err_p50": quantile(errs, 0.5),
        "err_p90": quantile(errs, 0.9),
        "err_p90_unstreamed": quantile(whole, 0.9) if whole else None,
        "err_p90_best_replica": min(replica_p90) if replica_p90 else None,
        "err_p90_worst_replica": max(replica_p90) if replica_p90 else None,
        "unstreamed": len(whole),
        "predicted": len(errs) / len(recs),
    }


def tail_table(folder: Path, warmup_s: float) -> None:
    cells = defaultdict(list)  # (rate, target) -> [stats]
    for log in sorted(folder.glob("seed-*-rate-*/logs/access-*.jsonl")):
        rate = float(log.parent.parent.name.split("-rate-")[1])
        target = log.stem[len("access-"):]
        st = access_stats(log, warmup_s)
        if st:
            cells[(rate, target)].append(st)
    if not cells:
        return
    print()
    print("Where kvgate's tail comes from, and its TTFT prediction error (access logs, after warm-up):")
    print()
    print(
        "| rate/s | target | gateway queue p99 ms | ÷ TTFT p99 | queued share of the slowest 5% | "
        "prediction error p50 | prediction error p90 | p90 of the best / worst replica | "
        "of which unstreamed: n, p90 | requests predicted |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (rate, t), sts in sorted(cells.items()):
        col = lambda k: [x[k] for x in sts if x[k] is not None]  # noqa: E731
        print(
            f"| {rate:g} | {t} | {fmt(col('queue_p99'), digits=0)} | "
            f"{fmt(col('queue_share_p99'), unit='%', digits=1, scale=100)} | "
            f"{fmt(col('slow_share'), unit='%', digits=1, scale=100)} | "
            f"{fmt(col('err_p50'), unit='%', digits=0, scale=100) if col('err_p50') else '-'} | "
            f"{fmt(col('err_p90'), unit='%', digits=0, scale=100) if col('err_p90') else '-'} | "
            f"{fmt(col('err_p90_best_replica'), unit='%', digits=0, scale=100) if col('err_p90_best_replica') else '-'} / "
            f"{fmt(col('err_p90_worst_replica'), unit='%', digits=0, scale=100) if col('err_p90_worst_replica') else '-'} | "
            f"{fmt(col('unstreamed'), digits=0) if any(col('unstreamed')) else '0'}, "
            f"{fmt(col('err_p90_unstreamed'), unit='%', digits=0, scale=100) if col('err_p90_unstreamed') else '-'} | "
            f"{fmt(col('predicted'), unit='%', digits=0, scale=100)} |"
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    base_arg = None
    if "--base" in args:
        i = args.index("--base")
        base_arg = args[i + 1]
        del args[i : i + 2]
    main(Path(args[0] if args else "."), base_arg)
