"""Goodput's prompt-carrying steps in each steady segment of a load (the segments of
steps_by_kind.py): how many, how many drafted, their predicted and observed time, and
their prompt tokens, from a run's decision log.

    python prompt_steps.py RUN_DIR ACCEPTANCE LOAD    (e.g. run51 0.6 c=70)
"""
import gzip
import json
import statistics
import sys

run, acc, load = sys.argv[1:4]
lo, hi = {"c=10": (1, 10), "c=70": (10, 70), "c=250": (70, 250)}[load]
rows = [json.loads(line) for line in gzip.open(f"{run}/decisions_a{acc}.jsonl.gz")]
segments, current = [], []
for r in rows + [{"batch": 0}]:  # a sentinel closes the last segment
    if lo < r["batch"] <= hi:
        current.append(r)
        continue
    if current and max(x["batch"] for x in current) >= 0.85 * hi and len(current) > 30:
        segments.append(current)
    current = []
for i, segment in enumerate(segments):
    prompt = [r for r in segment if r["prefill"]]
    print(f"goodput{i}: {len(segment)} steps, {len(prompt)} with prompt tokens, "
          f"{sum(1 for r in prompt if any(r['k']))} of them drafting; predicted "
          f"{1e3 * statistics.mean(r['predicted_s'] for r in prompt):.2f} ms, observed "
          f"{1e3 * statistics.mean(r['observed_s'] for r in prompt):.2f} ms, "
          f"{statistics.mean(r['prefill'] for r in prompt):.0f} prompt tokens")
