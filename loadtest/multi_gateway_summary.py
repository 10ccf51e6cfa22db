#!/usr/bin/env python3
"""Summary of a loadtest/multi_gateway.sh run: per rate, index mode and gateway count, the
median and range over seeds of the hit ratio, TTFT p95/p99 and goodput, each also as a ratio
to one gateway in the same seed and mode; the fleet's sampled use of the route budget (most
requests in flight and queued at once, summed over gateways) against the policy's limits; and
where the slowest 5% of TTFT came from (the gateways' queue share, from their access logs).

    python3 loadtest/multi_gateway_summary.py DIR
"""
import glob
import json
import os
import re
import statistics
import sys
import tomllib


def med_range(xs, fmt="{:.3f}"):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    m = statistics.median(xs)
    return f"{fmt.format(m)} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]"


def run_stats(d):
    rep = json.load(open(os.path.join(d, "report.json")))
    r = rep["runs"][0]
    s = {
        "hit": r.get("prefix_hit_ratio"),
        "p95": r["ttft_s"]["p95"],
        "p99": r["ttft_s"]["p99"],
        "goodput": r["goodput_requests_per_s"],
        "shed": r["shed"],
        "errors": r["errors"],
    }
    rows = [json.loads(l) for l in open(os.path.join(d, "budget.jsonl")) if l.strip()]
    rows = [x for x in rows if x["gateways"] > 0]
    sig = [x["signal"] for x in rows if "signal" in x]
    s["signal_mean"] = statistics.mean(sig) if sig else None
    s["signal_max"] = max(sig) if sig else None
    # The cost gauge over the run's second half (its 30 s window full of steady traffic).
    cost = [x["cost_per_mtok"] for x in rows[len(rows) // 2 :] if "cost_per_mtok" in x]
    s["cost_gauge"] = statistics.median(cost) if cost else None
    s["offered"] = r["offered_per_s"]
    s["out_tps"] = r["output_tokens_per_s"]
    s["max_in_flight"] = max((x["in_flight"] for x in rows), default=None)
    s["max_queued"] = max((x["queued"] for x in rows), default=None)
    pol = tomllib.load(open(os.path.join(d, "policy.toml"), "rb"))
    route = pol.get("routes", [{}])[0]
    s["limit"] = route.get("max_concurrency")
    s["queue_limit"] = route.get("queue_size") if s["limit"] else None
    reqs = []
    for f in glob.glob(os.path.join(d, "logs", "access-gw*.jsonl")):
        for l in open(f):
            j = json.loads(l)
            if j.get("path", "").startswith("/v1/") and j.get("status") == 200 and "ttft_ms" in j:
                reqs.append((j["ttft_ms"], j.get("queue_ms", 0.0)))
    reqs.sort(reverse=True)
    tail = reqs[: max(1, len(reqs) // 20)]
    s["queue_share_tail"] = (
        sum(q for _, q in tail) / sum(t for t, _ in tail) if tail and sum(t for t, _ in tail) > 0 else None
    )
    return s


def main(root):
    cells = {}
    for d in sorted(glob.glob(os.path.join(root, "seed-*-rate-*-gw*-*"))):
        m = re.match(r"seed-(\d+)-rate-([\d.]+)-gw(\d+)-(\w+)$", os.path.basename(d))
        if not m or not os.path.exists(os.path.join(d, "report.json")):
            continue
        seed, rate, n, mode = int(m[1]), float(m[2]), int(m[3]), m[4]
        cells[(rate, mode, n, seed)] = run_stats(d)
    print("| rate | index | gateways | hit ratio | ×1 gw | TTFT p95 s | TTFT p99 s | p99 ×1 gw | goodput/s | ×1 gw | most in flight (limit) | most queued (limit) | gateway queue share of slowest 5% |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(r, mo, n) for (r, mo, n, _) in cells})
    for rate, mode, n in keys:
        seeds = sorted(s for (r, mo, nn, s) in cells if (r, mo, nn) == (rate, mode, n))
        c = [cells[(rate, mode, n, s)] for s in seeds]
        one = [cells.get((rate, mode, 1, s)) for s in seeds]

        def ratio(k):
            return [x[k] / o[k] if o and o[k] else None for x, o in zip(c, one)]

        lim = c[0]["limit"]
        ql = c[0]["queue_limit"]
        print(
            f"| {rate:g} | {mode} | {n} | {med_range([x['hit'] for x in c])} | {med_range(ratio('hit'))} "
            f"| {med_range([x['p95'] for x in c], '{:.2f}')} | {med_range([x['p99'] for x in c], '{:.2f}')} "
            f"| {med_range(ratio('p99'), '{:.2f}')} | {med_range([x['goodput'] for x in c], '{:.2f}')} "
            f"| {med_range(ratio('goodput'), '{:.2f}')} "
            f"| {med_range([x['max_in_flight'] for x in c], '{:.0f}')} ({lim if lim else '–'}) "
            f"| {med_range([x['max_queued'] for x in c], '{:.0f}')} ({ql if ql else '–'}) "
            f"| {med_range([x['queue_share_tail'] for x in c], '{:.1%}')} |"
        )
    print("\n| rate | index | gateways | goodput ÷ offered | scale signal mean | max | cost gauge USD/Mtok | formula on the bench's tokens/s | gauge ÷ formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate, mode, n in keys:
        seeds = sorted(s for (r, mo, nn, s) in cells if (r, mo, nn) == (rate, mode, n))
        c = [cells[(rate, mode, n, s)] for s in seeds]
        gr = [x["goodput"] / x["offered"] if x["offered"] else None for x in c]
        # The capacity note's formula: 8 replicas at 2 USD an hour over the tokens/s the bench saw.
        n_rep = int(os.environ.get("KVGATE_REPLICAS", "8"))
        formula = [2.0 * n_rep / (x["out_tps"] * 3600) * 1e6 if x["out_tps"] else None for x in c]
        agree = [g / f if g and f else None for g, f in zip([x["cost_gauge"] for x in c], formula)]
        print(
            f"| {rate:g} | {mode} | {n} | {med_range(gr, '{:.2f}')} | {med_range([x['signal_mean'] for x in c], '{:.2f}')} "
            f"| {med_range([x['signal_max'] for x in c], '{:.2f}')} | {med_range([x['cost_gauge'] for x in c], '{:.3f}')} "
            f"| {med_range(formula, '{:.3f}')} | {med_range(agree, '{:.2f}')} |"
        )
    restarts = []
    for (rate, mode, n, seed), _ in sorted(cells.items()):
        d = os.path.join(root, f"seed-{seed}-rate-{rate:g}-gw{n}-{mode}")
        rj = os.path.join(d, "restart.json")
        if not os.path.exists(rj):
            continue
        t = json.load(open(rj))
        win = (t["back_in"], t["back_in"] + 10.0)

        def hits(files):
            p = c = 0
            for f in files:
                for l in open(f):
                    j = json.loads(l)
                    if win[0] <= j.get("ts", 0) <= win[1] and j.get("status") == 200 and "prompt_tokens" in j:
                        p += j["prompt_tokens"]
                        c += j.get("cached_tokens", 0)
            return c / p if p else None

        logs = sorted(glob.glob(os.path.join(d, "logs", "access-gw*.jsonl")))
        mine = hits([f for f in logs if f.endswith("access-gw0.jsonl")])
        peers = hits([f for f in logs if not f.endswith("access-gw0.jsonl")])
        restarts.append((rate, mode, n, seed, t["exited"] - t["term"], t["ready"] - t["started"], mine, peers, cells[(rate, mode, n, seed)]["errors"]))
    if restarts:
        print("\n| rate | index | gateways | seed | drain s | start → ready s | restarted gateway's hit ratio, first 10 s back | its peers', same 10 s | ratio | client errors in the run |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for rate, mode, n, seed, drain, ready, mine, peers, err in restarts:
            ratio = f"{mine / peers:.3f}" if mine is not None and peers else "–"
            f = lambda x: f"{x:.3f}" if x is not None else "–"
            print(f"| {rate:g} | {mode} | {n} | {seed} | {drain:.2f} | {ready:.2f} | {f(mine)} | {f(peers)} | {ratio} | {err} |")
    print(f"\nseeds per cell: {sorted({s for (_, _, _, s) in cells})}; shed/errors per run: "
          + ", ".join(f"{k[2]}gw/{k[1]}/{k[0]:g}/s{k[3]}:{v['shed']}/{v['errors']}" for k, v in sorted(cells.items()) if v['shed'] or v['errors']))


if __name__ == "__main__":
    main(sys.argv[1])
