"""One closed-loop cell (c = 10, 70 or 250 clients) at one acceptance level, step by step,
from a run's logs; "full" means at least 85% of c rows (the same rows for every policy:
the ramp and the tail left out):
1. each policy's decode-only and prompt-carrying steps at full rows: time a step, tokens
   a second;
2. goodput's passes: seconds of steps, K shares at full rows, decisions that explored;
3. goodput's decode-only steps at full rows by their longest K: predicted against
   observed tokens and milliseconds (is the choice's own price right?).

    python cell_steps.py RUN_DIR ACCEPTANCE LOAD    (e.g. run52 0.6 c=70)
"""
import collections
import gzip
import json
import sys

run, acc, load = sys.argv[1], sys.argv[2], sys.argv[3]
clients, below = {"c=10": (10, 1), "c=70": (70, 10), "c=250": (250, 70)}[load]
full = 0.85 * clients
dec = [json.loads(l) for l in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
steps = [json.loads(l) for l in gzip.open(f"{run}/steps_a{acc}.jsonl.gz")]
by_policy = collections.defaultdict(list)
for r in steps:
    if r["load"] == load:
        by_policy[r["policy"]].append(r)
# goodput's passes: runs of decisions with more rows than the load below and at most c
# running or waiting
passes, cur = [], []
for r in dec:
    if below < r["batch"] <= clients and r["batch"] + r["waiting"] <= clients:
        cur.append(r)
    else:
        if len(cur) > 100 and max(r["batch"] for r in cur) >= full:  # not a phase of the bursty load
            passes.append(cur)
        cur = []
if len(cur) > 100 and max(r["batch"] for r in cur) >= full:
    passes.append(cur)
by_policy["goodput"] = [r for p in passes for r in p]
print(f"1. steps at >= {full:.0f} rows: count, ms a step, tokens a step, tokens a second")
for name, rows in by_policy.items():
    for kind in ("decode", "prompt"):
        sel = [r for r in rows if r["batch"] >= full and (r["prefill"] == 0) == (kind == "decode")]
        if not sel:
            continue
        t = sum(r["observed_s"] for r in sel)
        tok = sum(sum(a + 1 for a in r["accepted"]) for r in sel)
        print(f"  {name:8} {kind:6} {len(sel):4} steps {1e3 * t / len(sel):6.2f} ms {tok / len(sel):6.1f} tok "
              f"{tok / t:7.0f} tok/s")
print(f"2. goodput's passes: seconds of steps; K shares at >= {full:.0f} rows; decisions that explored")
for i, p in enumerate(passes):
    ks = collections.Counter(k for r in p if r["batch"] >= full for k in r["k"])
    total = sum(ks.values())
    print(f"  pass {i}: {sum(r['observed_s'] for r in p):.2f} s; " + " ".join(f"K={k} {v / total:.2f}" for k, v in sorted(ks.items()))
          + f"; explored {sum(r.get('explored', False) for r in p)} of {len(p)} decisions")
print(f"3. goodput's decode-only steps at >= {full:.0f} rows by longest K (no catch-up, no probes): "
      "predicted / observed tokens, ms")
plain = [r for r in by_policy["goodput"] if r["batch"] >= full and not r["prefill"] and not r["catch_up"]
         and not r["probes"]]
for k in sorted({max(r["k"]) for r in plain}):
    sel = [r for r in plain if max(r["k"]) == k]
    pt = sum(r["tokens_per_s"] * r["predicted_s"] for r in sel) / len(sel)
    at = sum(r["batch"] + sum(r["accepted"]) for r in sel) / len(sel)
    pm = 1e3 * sum(r["predicted_s"] for r in sel) / len(sel)
    om = 1e3 * sum(r["observed_s"] for r in sel) / len(sel)
    print(f"  longest K={k}: {len(sel):4} steps, tokens {pt:6.1f} / {at:6.1f}, ms {pm:6.2f} / {om:6.2f}")
