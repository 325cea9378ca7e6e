"""Run39's slow spell at batch 1 (acceptance 0.8): how long goodput stayed below K = 4
after it, the prices its decision log shows, and what the cost model would price after
replaying every observed step of the log up to the spell's end, with run39's settings
(level and cells both at rate 0.05, cells unclipped) and with c58991a's (level 0.25,
cells clipped at 20% of the prediction per step).

The replayed model starts from a grid of run39's batch-1 step medians by K (fixed
policies' steps, `steps_a0.8.jsonl.gz`), scaled by batch size as b ** 0.1; only its
batch-1 row matters for the figures printed.

    PYTHONPATH=. python benchmarks/results/2026-12-01-h200/scripts/spell_replay.py  (from the repository root)
"""
import gzip
import json
from pathlib import Path

import numpy as np

from tidal.spec.cost_model import CostModel, grid_axes

RUN = Path(__file__).parent.parent / "run39"
decisions = [json.loads(line) for line in gzip.open(RUN / "decisions_a0.8.jsonl.gz")]
steps = [json.loads(line) for line in gzip.open(RUN / "steps_a0.8.jsonl.gz")]
policy_of_k = {0: "off", 1: "fixed:1", 2: "fixed:2", 4: "fixed:4"}
median = {k: float(np.median([s["observed_s"] for s in steps if s["policy"] == p and s["load"] == "c=1"
                               and s["prefill"] == 0 and len(s["k"]) == 1])) for k, p in policy_of_k.items()}
median[3] = (median[2] + median[4]) / 2
print("batch-1 step medians (ms) by K:", {k: round(1e3 * v, 2) for k, v in sorted(median.items())})
tokens = {k: sum(0.8 ** m for m in range(k + 1)) for k in range(5)}

spell = [d for d in decisions[1116:1156] if d["batch"] == 1]
print(f"spell (decisions 1116-1155): {len(spell)} steps at K = 4, observed median "
      f"{1e3 * np.median([d['observed_s'] for d in spell]):.2f} ms, max {1e3 * max(d['observed_s'] for d in spell):.2f}")
after = [d for d in decisions[1156:] if d["batch"] == 1 and d["prefill"] == 0]
run = next(i for i, d in enumerate(after) if i > 50 and all(a["k"][0] == 4 for a in after[i:i + 20]))
print(f"after it: {run} batch-1 decode steps before 20 in a row at K = 4; "
      f"K counts there {np.bincount([d['k'][0] for d in after[:run]], minlength=5).tolist()}")
print(f"logged predictions: K = 4 at decision 1155 {1e3 * decisions[1155]['predicted_s']:.2f} ms, "
      f"K = 3 at 1160 {1e3 * decisions[1160]['predicted_s']:.2f} ms")


def replay(**settings):
    model = CostModel.from_function(lambda b, w: median[min(w - 1, 4)] * b ** 0.1, *grid_axes(256, 4),
                                    padded=True, **settings)
    for d in decisions[:1159]:
        ks = d["drafted"]
        model.observe(d["batch"], sum(ks), max(ks), sum(k > 0 for k in ks), 0, d["observed_s"], d["prefill"],
                      d["catch_up"])
    price = [float(model.step_time(1, k, k, int(k > 0), 0)) for k in range(5)]
    best = max(range(5), key=lambda k: tokens[k] / price[k])
    return [round(1e3 * p, 2) for p in price], best


for name, settings in (("run39 (level 0.05, cells unclipped)", dict(level_rate=0.05, cell_step=np.inf)),
                       ("c58991a (level 0.25, cells clipped at 0.2)", {})):
    price, best = replay(**settings)
    print(f"replayed to decision 1159, {name}: price by K (ms) {price}, best K at a = 0.8: {best}")
