"""How well three forms of a prefill step's time fit the steps goodput logged (K = 0 rows,
no catch-up) in runs 27, 28 and 28/a06_c70, given off's decode-only step time per batch
size: the cost model's prediction as logged, max(decode step, price x tokens), and
decode step + price x prompt tokens, each price the best fit on a grid.

    python prompt_price_fit.py      (from this folder)
"""
import collections
import gzip
import json

import numpy as np

off = collections.defaultdict(list)
for f in ("run28/steps_a0.8.jsonl.gz", "run28/a06_c70/steps_a0.6.jsonl.gz"):
    for line in gzip.open(f):
        r = json.loads(line)
        if r["policy"] == "off" and r["prefill"] == 0:
            off[r["batch"]].append(r["observed_s"] * 1e3)
bs = np.array(sorted(off))
pure = np.array([np.median(off[b]) for b in bs])
pts = []
for f in ("run27/decisions_a0.6.jsonl.gz", "run28/a06_c70/decisions_a0.6.jsonl.gz", "run28/decisions_a0.8.jsonl.gz"):
    for line in gzip.open(f):
        r = json.loads(line)
        if r["prefill"] > 0 and max(r["k"]) == 0 and r["catch_up"] == 0:
            pts.append((r["batch"], r["prefill"], r["observed_s"] * 1e3, r["predicted_s"] * 1e3))
b, p, obs, pred = np.array(pts, dtype=float).T
decode = np.interp(b, bs, pure)


def mean_error(fit):
    return float(np.mean(np.abs(fit - obs) / obs))


prices = np.linspace(0.01, 0.06, 101)  # ms per token
print(f"{len(pts)} prefill steps")
print(f"logged prediction: mean |error| {mean_error(pred):.2f}")
e, c = min((mean_error(np.maximum(decode, c * (b + p))), c) for c in prices)
print(f"max(decode step, {c:.4f} ms x tokens): mean |error| {e:.2f}")
e, c = min((mean_error(decode + c * p), c) for c in prices)
print(f"decode step + {c:.4f} ms x prompt tokens: mean |error| {e:.2f}")
