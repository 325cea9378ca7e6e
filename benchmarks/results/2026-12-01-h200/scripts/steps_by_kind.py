"""Time per kind of step in a c-load cell, per policy, from a run's step and decision logs.

    python steps_by_kind.py RUN_DIR ACCEPTANCE LOAD    (e.g. run33 0.6 c=70)
"""
import json, gzip, sys, collections
d = sys.argv[1]; acc = sys.argv[2]; load = sys.argv[3]
rows = [json.loads(l) for l in gzip.open(f"{d}/steps_a{acc}.jsonl.gz")]
dec = [json.loads(l) for l in gzip.open(f"{d}/decisions_a{acc}.jsonl.gz")]
# goodput rows: segment by batch <=70 contiguous with max>=60
lo, hi = {"c=70": (10, 70), "c=250": (70, 250), "c=10": (1, 10)}[load]
segs = []; cur = []
for r in dec:
    if lo < r["batch"] <= hi: cur.append(r)
    else:
        if cur and max(x["batch"] for x in cur) >= 0.85 * hi and len(cur) > 30: segs.append(cur)
        cur = []
if cur and max(x["batch"] for x in cur) >= 0.85 * hi and len(cur) > 30: segs.append(cur)
groups = collections.defaultdict(list)
for r in rows:
    if r["load"] == load: groups[r["policy"]].append(r)
def summary(name, seg):
    tot = sum(r["observed_s"] for r in seg)
    toks = sum(sum(a + 1 for a in r["accepted"]) for r in seg)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0])
    for r in seg:
        kk = max(r["k"]) if r["k"] else 0
        kind = ("prefill " if r["prefill"] else "") + ("catch " if r.get("catch_up") else "") + ("K0" if kk == 0 else "K>0")
        kinds[kind][0] += 1; kinds[kind][1] += r["observed_s"]; kinds[kind][2] += sum(a + 1 for a in r["accepted"])
    print(f"{name:10} {len(seg):4} steps {tot:6.2f} s {toks:6} tok {toks/tot:7.0f} tok/s  |  " + "  ".join(
        f"{k}: {v[0]} st {v[1]:.2f}s {v[2]/max(v[1],1e-9):.0f}t/s" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])))
for name, steps in groups.items():
    summary(name, steps)
for i, seg in enumerate(segs):
    summary(f"goodput{i}", seg)
