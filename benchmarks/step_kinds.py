"""Where a server's time went, by policy and kind of step, from its step log
(`speculative_config.decision_log`: a line per step, for every policy).

    python benchmarks/step_kinds.py decisions_matrix.jsonl[.gz] --min-rows 24 [--split k|around]
        [--steps goodput=845:1464 --steps fixed:2=884:1549]

A step is a `decode` when every row fed one token, a `prompt` step when prompt chunks
shared it. `--split k` splits the decode steps by their longest K; `--split around` into
those just before a prompt step, just after one, and the others (the steps next to an
arrival). For each policy and kind: steps, seconds and their share of the policy's, tokens
committed and their rate, drafts per row, the median step and, where the policy predicted
it (goodput), the median prediction. --min-rows keeps the steps with at least that many
rows (one cell's steady state when a log holds several loads); --steps POLICY=FIRST:LAST
keeps only those of that policy's steps (its lines' `step`, inclusive), one cell of a matrix.
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


def is_prompt(line: dict) -> bool:
    return line["new_tokens"] > line["rows"]


def step_kind(line: dict, before: dict | None, after: dict | None, split: str) -> str:
    if is_prompt(line):
        return "prompt"
    if split == "k":
        return f"decode K={max(line['drafted'], default=0)}"
    if split == "around" and after is not None and is_prompt(after):
        return "before a prompt step"
    if split == "around" and before is not None and is_prompt(before):
        return "after a prompt step"
    return "decode"


def summarize(lines: list[dict], min_rows: int = 0, split: str = "kind",
              steps: dict[str, tuple[int, int]] | None = None) -> list[dict]:
    by_policy = defaultdict(list)
    for line in lines:
        first, last = (steps or {}).get(line["policy"], (0, float("inf")))
        if line["rows"] >= min_rows and first <= line["step"] <= last and (not steps or line["policy"] in steps):
            by_policy[line["policy"]].append(line)
    groups = defaultdict(list)
    for policy, steps in by_policy.items():
        for i, line in enumerate(steps):
            before, after = steps[i - 1] if i else None, steps[i + 1] if i + 1 < len(steps) else None
            groups[policy, step_kind(line, before, after, split)].append(line)
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
                    "median_ms": 1e3 * statistics.median(s["observed_s"] for s in steps),
                    "median_predicted_ms": 1e3 * statistics.median(s["predicted_s"] for s in steps)
                    if all("predicted_s" in s for s in steps) else None})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--min-rows", type=int, default=0)
    p.add_argument("--split", choices=("kind", "k", "around"), default="kind")
    p.add_argument("--steps", action="append", default=[], metavar="POLICY=FIRST:LAST")
    args = p.parse_args()
    steps = {}
    for item in args.steps:
        policy, _, span = item.rpartition("=")
        first, _, last = span.partition(":")
        steps[policy] = (int(first), int(last))
    print(f"{'policy':10} {'kind':20} {'steps':>6} {'s':>7} {'share':>6} {'tokens':>7} {'tok/s':>7} "
          f"{'drafts/row':>10} {'median ms':>9} {'predicted':>9}")
    for r in summarize(read(args.log), args.min_rows, args.split, steps):
        predicted = "" if r["median_predicted_ms"] is None else f"{r['median_predicted_ms']:9.2f}"
        print(f"{r['policy']:10} {r['kind']:20} {r['steps']:6d} {r['seconds']:7.2f} {r['share']:6.2f} "
              f"{r['tokens']:7d} {r['tokens_per_s']:7.0f} {r['drafts_per_row']:10.2f} {r['median_ms']:9.2f} {predicted:>9}")


if __name__ == "__main__":
    main()
