"""Steps that look like stalls (a pause of the host, not the price of their shape), from a
run's logs:
- goodput's steps that took more than twice their predicted time, each with the range of
  goodput's other steps of about its shape (rows and prompt tokens within 10%);
- the other policies' steps over 120 ms (they log no prediction).

    python slow_steps.py RUN_DIR ACCEPTANCE    (e.g. run58 0.6)
"""
import gzip
import json
import sys

run, acc = sys.argv[1], sys.argv[2]
dec = [json.loads(l) for l in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
print(f"goodput: {len(dec)} steps; those over twice their prediction:")
for r in dec:
    if r["observed_s"] > 2 * r["predicted_s"] and r["observed_s"] > 0.02:
        alike = [1e3 * o["observed_s"] for o in dec if o is not r
                 and abs(o["batch"] - r["batch"]) <= 0.1 * r["batch"]
                 and abs(o["prefill"] - r["prefill"]) <= 0.1 * r["prefill"]
                 and max(o["k"]) == max(r["k"]) and bool(o["catch_up"]) == bool(r["catch_up"])]
        shape = f"{len(alike)} alike took {min(alike):.1f}-{max(alike):.1f} ms" if alike else "none alike"
        print(f"  step {r['step']:5}: {1e3 * r['observed_s']:7.1f} ms, predicted {1e3 * r['predicted_s']:6.1f}; "
              f"{r['batch']} rows, {r['prefill']} prompt tokens, K max {max(r['k'])}, catch-up {r['catch_up']}; "
              f"{shape}")
steps = [json.loads(l) for l in gzip.open(f"{run}/steps_a{acc}.jsonl.gz")]
print(f"other policies: {len(steps)} steps; those over 120 ms:")
for r in steps:
    if r["observed_s"] > 0.12:
        print(f"  {r['policy']:8} {r['load']:6}: {1e3 * r['observed_s']:7.1f} ms; {r['batch']} rows, "
              f"{r['prefill']} prompt tokens, K max {max(r['k'])}")
