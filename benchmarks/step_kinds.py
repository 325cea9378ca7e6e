"""Where a server's time went, by policy and kind of step, from its step log
(`speculative_config.decision_log`: a line per step, for every policy).

    python benchmarks/step_kinds.py decisions_matrix.jsonl[.gz] --min-rows 24

A step is a `decode` when every row fed one token, a `prompt` step when prompt chunks
shared it. For each policy and kind: steps, seconds and their share of the policy's,
tokens committed and their rate, drafts per row, the median step. --min-rows keeps the
steps with at least that many rows (one cell's steady state when a log holds several
loads).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict


def read(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f]


def summarize(lines: list[dict], min_rows: int = 0) -> list[dict]:
    groups = defaultdict(list)
    for line in lines:
        if line["rows"] >= min_rows:
            kind = "decode" if line["new_tokens"] == line["rows"] else "prompt"
            groups[line["policy"], kind].append(line)
    total = defaultdict(float)
    for (policy, _), steps in groups.items():
        total[policy] += sum(s["observed_s"] for s in steps)
    out = []
    for (policy, kind), steps in sorted(groups.items()):
        seconds = sum(s["observed_s"] for s in steps)
        tokens = sum(s["rows"] + sum(s["accepted"]) for s in steps)
        out.append({"policy": policy, "kind": kind, "steps": len(steps), "seconds": seconds,
                    "share": seconds / total[policy], "tokens": tokens, "tokens_per_s": tokens / seconds,
                    "drafts_per_row": sum(sum(s["drafted"]) for s in steps) / sum(s["rows"] for s in steps),
                    "median_ms": 1e3 * statistics.median(s["observed_s"] for s in steps)})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--min-rows", type=int, default=0)
    args = p.parse_args()
    print(f"{'policy':10} {'kind':7} {'steps':>6} {'s':>7} {'share':>6} {'tokens':>7} {'tok/s':>7} "
          f"{'drafts/row':>10} {'median ms':>9}")
    for r in summarize(read(args.log), args.min_rows):
        print(f"{r['policy']:10} {r['kind']:7} {r['steps']:6d} {r['seconds']:7.2f} {r['share']:6.2f} {r['tokens']:7d} "
              f"{r['tokens_per_s']:7.0f} {r['drafts_per_row']:10.2f} {r['median_ms']:9.2f}")


if __name__ == "__main__":
    main()
