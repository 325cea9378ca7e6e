"""Goodput's passes of one cell against off's: tok/s, drafted tokens and host time (choose +
observe) per pass, then goodput's decode steps at >= 150 rows from its decision log, by
whether they drafted: count, rows drafting, predicted and observed step time, and the
predicted rate of the K the policy chose.

    python goodput_passes.py RUN_DIR ACCEPTANCE LOAD    (e.g. run49 0.6 c=250)
"""
import gzip
import json
import statistics
import sys

run, acc, load = sys.argv[1:4]
runs = json.load(open(f"{run}/policy_sweep.json"))["runs"]
for policy in ("off", "goodput"):
    for i, p in enumerate(runs[f"a={acc} {policy} {load}"]):
        h = p["host_us_per_step"]
        print(f"{policy:8} pass {i}: {p['steady_tok_s']:7.0f} tok/s, drafted {p['drafted']:6}, "
              f"choose {h['choose']:5.0f} + observe {h['observe']:4.0f} = {h['choose'] + h['observe']:5.0f} us a step")
rows = [json.loads(line) for line in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
decode = [r for r in rows if r["batch"] >= 150 and not r["prefill"]]
for name, steps in (("K = 0", [r for r in decode if not any(r["k"])]), ("K > 0", [r for r in decode if any(r["k"])])):
    if steps:
        print(f"goodput {name} steps at >= 150 rows: {len(steps)}, "
              f"rows drafting {statistics.mean(sum(k > 0 for k in r['k']) for r in steps):.1f}, "
              f"predicted {1e3 * statistics.mean(r['predicted_s'] for r in steps):.2f} ms, "
              f"observed {1e3 * statistics.mean(r['observed_s'] for r in steps if r['observed_s']):.2f} ms, "
              f"chosen rate predicted {statistics.mean(r['tokens_per_s'] for r in steps):.0f} tok/s")
