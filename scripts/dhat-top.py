"""Top allocation sites still live at the end of a dhat heap profile (dhat-heap.json)."""
import json, sys
d = json.load(open(sys.argv[1]))
frames = d["ftbl"]
pps = d["pps"]
def where(pp, depth=14):
    out = []
    for i in pp["fs"]:
        f = frames[i]
        if any(s in f for s in ("alloc::", "dhat::", "core::", "std::", "hashbrown", "__rust", "<alloc", "[root]")):
            continue
        out.append(f.split(" (")[0][:110])
        if len(out) >= depth:
            break
    return out
key = sys.argv[2] if len(sys.argv) > 2 else "eb"
pps.sort(key=lambda p: -p.get(key, 0))
total = sum(p.get(key, 0) for p in pps)
print(f"total {key}: {total/1e6:.1f} MB over {len(pps)} sites; t-end {d.get('te')}, t-gmax {d.get('tg')}")
for p in pps[:int(sys.argv[3]) if len(sys.argv) > 3 else 12]:
    print(f"\n{p.get(key,0)/1e6:8.2f} MB in {p.get('eb' if key=='eb' else 'gb', 0)} / blocks {p.get('ebk', p.get('gbk'))}")
    for f in where(p, 8):
        print("    ", f)
