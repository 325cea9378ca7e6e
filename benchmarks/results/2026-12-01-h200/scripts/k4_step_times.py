"""Wall time of steps in which all 1, 10 or 70 requests draft K = 4 (no prompt tokens; for
goodput also no catch-up), median per run, fixed:4 against goodput, from the step and
decision logs at acceptance 0.8; and goodput's share of rows at K = 4 at 10 requests.

    python k4_step_times.py      (from this folder)
"""
import gzip
import json

import numpy as np

for run in ("run28", "run36", "run37"):
    steps = [json.loads(line) for line in gzip.open(f"{run}/steps_a0.8.jsonl.gz")]
    decisions = [json.loads(line) for line in gzip.open(f"{run}/decisions_a0.8.jsonl.gz")]
    for b, load in ((1, "c=1"), (10, "c=10"), (70, "c=70")):
        fixed = [s["observed_s"] for s in steps if s["policy"] == "fixed:4" and s["load"] == load
                 and s["prefill"] == 0 and len(s["k"]) == b and min(s["k"]) == 4]
        goodput = [d["observed_s"] for d in decisions if len(d["k"]) == b and d["prefill"] == 0
                   and min(d["k"]) == 4 and d["catch_up"] == 0]
        print(f"{run} {load:5} fixed:4 {1e3 * np.median(fixed):5.2f} ms (n={len(fixed)})  "
              f"goodput {1e3 * np.median(goodput):5.2f} ms (n={len(goodput)})")
    rows = [k for d in decisions if len(d["k"]) == 10 and d["prefill"] == 0 for k in d["k"]]
    print(f"{run} goodput at 10 requests: {np.mean(np.array(rows) == 4):.1%} of {len(rows)} rows at K = 4")
