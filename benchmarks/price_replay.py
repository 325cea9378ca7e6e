"""A policy's step log replayed through goodput's cost model, to see how its prices learn:
each step is priced, then observed, in the log's order, from no profile (the grid learned
online), and the median price over what the step took is reported by kind and longest K.

    python benchmarks/price_replay.py decisions.jsonl[.gz] [--policy goodput] [--skip 0.33]

Whichever `tidal` is on the path prices the steps, so that one log can be replayed through the
cost model of two trees (PYTHONPATH=<a tree's root>). The log has no context lengths and no
profiled catch-up, so attention is not priced and a catch-up pass costs --catch-up-ms (a pass
and a token: run96's spans); what a replay tells is whether a term's error is learned away.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from step_kinds import is_prompt, read
from tidal.speculative.cost_model import CostModel, grid_axes


def replay(lines: list[dict], policy: str = "goodput", max_num_seqs: int = 256, k: int = 4, skip: float = 1 / 3,
           catch_up_ms: tuple[float, float] = (0.3, 0.001)) -> list[dict]:
    """Median price / seconds taken, by kind of step and longest K, over the steps after the
    first `skip` of the policy's."""
    model = CostModel(*grid_axes(max_num_seqs, k), catch_up_fixed=catch_up_ms[0] / 1e3,
                      catch_up_token=catch_up_ms[1] / 1e3)
    steps = [line for line in lines if line["policy"] == policy]
    ratios = defaultdict(list)
    for i, line in enumerate(steps):
        drafted = line["drafted"]
        longest = max(drafted, default=0)
        price = model.observe(line["rows"], sum(drafted), longest, sum(d > 0 for d in drafted), 0,
                              line["observed_s"], line["new_tokens"] - line["rows"], line.get("catch_up", 0))
        if i >= skip * len(steps):
            ratios["prompt" if is_prompt(line) else "decode", longest].append(price / line["observed_s"])
    return [{"kind": kind, "k": longest, "steps": len(r), "median_price_over_taken": statistics.median(r)}
            for (kind, longest), r in sorted(ratios.items())]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--policy", default="goodput")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--skip", type=float, default=1 / 3, help="share of the steps replayed before any is reported")
    p.add_argument("--catch-up-ms", type=float, nargs=2, default=(0.3, 0.001), metavar=("PASS", "TOKEN"))
    args = p.parse_args()
    print(f"{'kind':7} {'K':>2} {'steps':>6} {'price / taken':>13}")
    for r in replay(read(args.log), args.policy, args.max_num_seqs, args.k, args.skip, tuple(args.catch_up_ms)):
        print(f"{r['kind']:7} {r['k']:2d} {r['steps']:6d} {r['median_price_over_taken']:13.3f}")


if __name__ == "__main__":
    main()
