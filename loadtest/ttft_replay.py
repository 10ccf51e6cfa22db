#!/usr/bin/env python3
"""Replays the gateway's TTFT fit offline on a run's access log, to try a change to the fit in
seconds instead of a bench run, and says how far any such fit could get on that run.

For each request of a kvgate access log (`loadtest/vllm_bench.sh` writes one per seed) it has
the prefill queued ahead, the uncached and cached tokens, the step wait and the measured (or,
unstreamed, estimated) TTFT. Three figures, each |predicted − measured| ÷ measured at p50 and
p90 over the requests after the warm-up:
- *logged*: what the gateway predicted in the run;
- *replay*: the fit of `gateway/src/fleet/ttft_fit.rs` (the plane over 1, work and attention,
  decayed least squares with the generic prior as a ridge) fed the same observations in the
  order their first tokens came back, per replica, and asked at each request's send time —
  once as built and once per `--clip C` (once the replica has 8 observations, a slow one
  is taught at most C × its prediction unless the 3 before it were clipped too: a burst of
  slow answers then moves the plane a bounded step each, a lasting slowdown is learnt as
  without the clip; fast ones are never clipped);
- *hindsight*: one plane per replica fitted to all of that replica's requests after the
  warm-up at once, minimising relative error — the best a plane of this form could do knowing
  every answer in advance (in-sample, so optimistic). `idle` repeats it for the requests that
  arrived with no other prefill outstanding on their replica.

    python3 loadtest/ttft_replay.py ACCESS.jsonl [...] [--warmup 150] [--clip 2 ...]
"""
import argparse
import json
import statistics

ATTENTION_UNIT = 4096.0  # policies::ATTENTION_UNIT
FORGET = 0.98
PRIOR_SPAN = 4096.0
GENERIC = (0.02, 1.0 / 8000.0, 0.002)  # overhead s, s per token, prior weight


def solve3(m, v):
    def det(a):
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    d = det(m)
    scale = max(abs(x) for row in m for x in row)
    if d == 0 or abs(d) <= 1e-12 * scale ** 3:
        return None
    out = []
    for k in range(3):
        mk = [row[:] for row in m]
        for i in range(3):
            mk[i][k] = v[i]
        out.append(det(mk) / d)
    return out


class Fit:
    """`TtftFit` as built, with an optional clip of each observation."""

    def __init__(self, clip=None, run=3):
        self.s = [[0.0] * 3 for _ in range(3)]
        self.sy = [0.0] * 3
        self.n = 0
        self.clip = clip
        self.run = run
        self.clipped = 0

    def coefficients(self):
        a0, b0, w = GENERIC
        s = [row[:] for row in self.s]
        sy = self.sy[:]
        for k, (lam, p) in enumerate([(w, a0), (w * PRIOR_SPAN ** 2, b0), (w * PRIOR_SPAN ** 2, 0.0)]):
            s[k][k] += lam
            sy[k] += lam * p
        plane = solve3(s, sy)
        if plane is None or plane[2] < 0:
            det = s[0][0] * s[1][1] - s[0][1] * s[1][0]
            b = (s[0][0] * sy[1] - s[1][0] * sy[0]) / det
            plane = [(sy[0] - s[0][1] * b) / s[0][0], b, 0.0]
        return [max(plane[0], 0.0), max(plane[1], b0 / 20), plane[2]]

    def predict(self, x):
        return sum(c * v for c, v in zip(self.coefficients(), x))

    def observe(self, x, y):
        if self.clip and self.n >= 8:
            ceiling = self.predict(x) * self.clip
            if 0 < ceiling < y:
                self.clipped += 1
                if self.clipped <= self.run:
                    y = ceiling
            else:
                self.clipped = 0
        for i in range(3):
            for j in range(3):
                self.s[i][j] = self.s[i][j] * FORGET + x[i] * x[j]
            self.sy[i] = self.sy[i] * FORGET + x[i] * y
        self.n += 1


def features(r, ahead=True):
    u = r["prompt_tokens"] - r["cached_tokens"]
    c = r["cached_tokens"]
    return [1.0, (r["ahead_tokens"] if ahead else 0) + u, u * (c + u / 2) / ATTENTION_UNIT]


def load(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if r.get("path", "").endswith("completions")
            and r.get("status") == 200 and r.get("ttft_ms") and "predicted_ttft_ms" in r]


def spread(errors):
    if not errors:
        return "n/a"
    q = statistics.quantiles(errors, n=10, method="inclusive") if len(errors) > 1 else errors * 9
    return f"{statistics.median(errors) * 100:3.0f}% / {q[8] * 100:3.0f}%  (n={len(errors)})"


def replay(rows, clip):
    events = sorted([(r["ts"], 0, i) for i, r in enumerate(rows)]
                    + [(r["ts"] + r["ttft_ms"] / 1e3, 1, i) for i, r in enumerate(rows)])
    fits, predicted = {}, {}
    for _, kind, i in events:
        r = rows[i]
        fit = fits.setdefault(r["replica"], Fit(clip))
        if kind == 0:
            predicted[i] = fit.predict(features(r)) * 1e3 + r.get("step_wait_ms", 0.0)
        else:
            fit.observe(features(r), r["ttft_ms"] / 1e3)
    return predicted


def hindsight(rows):
    """Relative-error least squares per replica: minimises Σ (x·p / y − 1)²."""
    errors = []
    for replica in {r["replica"] for r in rows}:
        mine = [r for r in rows if r["replica"] == replica]
        if len(mine) < 4:
            continue
        m = [[0.0] * 3 for _ in range(3)]
        v = [0.0] * 3
        for r in mine:
            x = [f / r["ttft_ms"] for f in features(r)]
            for i in range(3):
                for j in range(3):
                    m[i][j] += x[i] * x[j]
                v[i] += x[i]
        p = solve3(m, v)
        if p is None:
            continue
        errors += [abs(sum(a * b for a, b in zip(p, features(r))) / r["ttft_ms"] - 1) for r in mine]
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--warmup", type=float, default=150.0)
    ap.add_argument("--clip", type=float, action="append", default=[])
    a = ap.parse_args()
    for path in a.logs:
        rows = load(path)
        t0 = min(r["ts"] for r in rows)
        warm = [i for i, r in enumerate(rows) if r["ts"] - t0 >= a.warmup]
        err = lambda pred: [abs(pred[i] / rows[i]["ttft_ms"] - 1) for i in warm]
        print(path)
        print(f"  logged              {spread(err({i: r['predicted_ttft_ms'] for i, r in enumerate(rows)}))}")
        print(f"  replay, as built    {spread(err(replay(rows, None)))}")
        for c in a.clip:
            print(f"  replay, clip {c:<4}   {spread(err(replay(rows, c)))}")
        after = [rows[i] for i in warm]
        idle = [r for r in after if not any(
            o is not r and o["replica"] == r["replica"] and o["ts"] <= r["ts"] < o["ts"] + o["ttft_ms"] / 1e3
            for o in rows)]
        print(f"  hindsight, all      {spread(hindsight(after))}")
        print(f"  hindsight, idle     {spread(hindsight(idle))}")


if __name__ == "__main__":
    main()
