"""The 70-client cell at one acceptance level, step by step, from a run's logs:
1. each policy's decode-only and prompt-carrying steps at >= 60 rows (same rows for all:
   the ramp and the tail left out), time a step and tokens a second;
2. goodput's K shares per pass at >= 60 rows, and how many decisions explored;
3. goodput's decode-only steps by their longest K: predicted against observed tokens
   and milliseconds (is the choice's own price right?).

    python c70_steps.py RUN_DIR ACCEPTANCE    (e.g. run52 0.6)
"""
import collections
import gzip
import json
import sys

run, acc = sys.argv[1], sys.argv[2]
dec = [json.loads(l) for l in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
steps = [json.loads(l) for l in gzip.open(f"{run}/steps_a{acc}.jsonl.gz")]
by_policy = collections.defaultdict(list)
for r in steps:
    if r["load"] == "c=70":
        by_policy[r["policy"]].append(r)
# goodput's c=70 passes: runs of decisions with at most 70 rows running or waiting, past the ramp
passes, cur = [], []
for r in dec:
    if 10 < r["batch"] <= 70 and r["batch"] + r["waiting"] <= 70:
        cur.append(r)
    else:
        if len(cur) > 100:
            passes.append(cur)
        cur = []
if len(cur) > 100:
    passes.append(cur)
by_policy["goodput"] = [r for p in passes for r in p]
print("1. steps at >= 60 rows: count, ms a step, tokens a step, tokens a second")
for name, rows in by_policy.items():
    for kind in ("decode", "prompt"):
        sel = [r for r in rows if r["batch"] >= 60 and (r["prefill"] == 0) == (kind == "decode")]
        if not sel:
            continue
        t = sum(r["observed_s"] for r in sel)
        tok = sum(sum(a + 1 for a in r["accepted"]) for r in sel)
        print(f"  {name:8} {kind:6} {len(sel):4} steps {1e3 * t / len(sel):6.2f} ms {tok / len(sel):6.1f} tok "
              f"{tok / t:7.0f} tok/s")
print("2. goodput's K shares per pass at >= 60 rows; decisions that explored")
for i, p in enumerate(passes):
    ks = collections.Counter(k for r in p if r["batch"] >= 60 for k in r["k"])
    total = sum(ks.values())
    print(f"  pass {i}: " + " ".join(f"K={k} {v / total:.2f}" for k, v in sorted(ks.items()))
          + f"; explored {sum(r.get('explored', False) for r in p)} of {len(p)} decisions")
print("3. goodput's decode-only steps at >= 60 rows by longest K (no catch-up, no probes): "
      "predicted / observed tokens, ms")
plain = [r for r in by_policy["goodput"] if r["batch"] >= 60 and not r["prefill"] and not r["catch_up"]
         and not r["probes"]]
for k in sorted({max(r["k"]) for r in plain}):
    sel = [r for r in plain if max(r["k"]) == k]
    pt = sum(r["tokens_per_s"] * r["predicted_s"] for r in sel) / len(sel)
    at = sum(r["batch"] + sum(r["accepted"]) for r in sel) / len(sel)
    pm = 1e3 * sum(r["predicted_s"] for r in sel) / len(sel)
    om = 1e3 * sum(r["observed_s"] for r in sel) / len(sel)
    print(f"  longest K={k}: {len(sel):4} steps, tokens {pt:6.1f} / {at:6.1f}, ms {pm:6.2f} / {om:6.2f}")
