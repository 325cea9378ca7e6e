"""Goodput's steps that took more than twice their predicted time, from a run's decision
log (a stall: a pause of the host, not the shape's price), with their neighbours' shape.

    python slow_steps.py RUN_DIR ACCEPTANCE    (e.g. run58 0.6)
"""
import gzip
import json
import sys

run, acc = sys.argv[1], sys.argv[2]
dec = [json.loads(l) for l in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
print(f"{len(dec)} steps; those over twice their prediction:")
for r in dec:
    if r["observed_s"] > 2 * r["predicted_s"] and r["observed_s"] > 0.02:
        print(f"  step {r['step']:5}: {1e3 * r['observed_s']:7.1f} ms, predicted {1e3 * r['predicted_s']:6.1f}; "
              f"{r['batch']} rows, {r['prefill']} prompt tokens, K max {max(r['k'])}, catch-up {r['catch_up']}")
