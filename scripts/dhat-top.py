#!/usr/bin/env python3
"""The allocation sites of a dhat heap profile (dhat-heap.json, written by a kvgate binary built
with `--features dhat-heap` when it exits) that held the most memory, with their call stacks
trimmed to the project's and libraries' frames.

  scripts/dhat-top.py dhat-heap.json [--by mb|eb|tb] [--top N]

--by mb (default): the most bytes a site held live at any one time — what a growing structure
shows as; eb: bytes still live at exit; tb: bytes allocated in all (churn).
"""

import argparse
import json

NOISE = ("alloc::", "dhat::", "core::", "std::", "hashbrown", "__rust", "<alloc", "[root]",
         ": alloc", ": allocate", "alloc_impl", "box_new", "with_capacity", "reserve", "grow",
         "finish_grow", "do_reserve")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--by", default="mb", choices=["mb", "eb", "tb"])
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    d = json.load(open(a.profile))
    frames = d["ftbl"]

    def where(pp, n=6):
        out = []
        for i in pp["fs"]:
            f = frames[i]
            if any(s in f for s in NOISE):
                continue
            out.append(f.split(": ", 1)[-1][:100])
            if len(out) >= n:
                break
        return "\n      <- ".join(out)

    pps = sorted(d["pps"], key=lambda p: -p[a.by])
    print(f"{len(pps)} sites; peak heap at {d.get('tg', 0) / 1e6:.1f} s, exit at {d.get('te', 0) / 1e6:.1f} s")
    for p in pps[:a.top]:
        print(f"\n{p[a.by] / 1e6:8.2f} MB ({a.by}); max live {p['mb'] / 1e6:.2f} MB in {p['mbk']} blocks; "
              f"{p['tb'] / 1e6:.1f} MB allocated in all\n      {where(p)}")


if __name__ == "__main__":
    main()
