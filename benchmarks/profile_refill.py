"""A stored cost profile's target grid with the shapes its budget cut guessed again by this
tree's `fill_by_tokens`, beside what served decode steps took, to see how those guesses price
the steps a loaded server runs.

    python benchmarks/profile_refill.py costs-*.json [--log decisions.jsonl.gz]
        [--min-rows 64] [--policies fixed:4 fixed:2 goodput]

A profile keeps its grid filled, not which shapes it measured; its `source` says how many
("profile: 56 of 63 shapes measured"), and they are the first of `profile_order`'s. Served
steps are decode steps without a drafter's catch-up, by policy, longest K and rows (sixteen
at a time from --min-rows): the median seconds taken, which hold the drafting and the
attention over the requests' contexts that the grid (width K + 1, context of one page)
leaves out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict

import numpy as np

from step_kinds import is_prompt, read
from tidal.profiling import drafter_ks, profile_order
from tidal.speculative.cost_model import fill_by_tokens, monotone


def refill(model: dict) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
    """Batch sizes, widths, which grid cells were guessed, and the grid with those guessed again."""
    found = re.match(r"profile: (\d+) of", model["source"])
    if found is None:
        raise ValueError(f"source {model['source']!r} does not say how many shapes the profile measured")
    rows, widths = [int(b) for b in model["batch_sizes"]], [int(w) for w in model["widths"]]
    grid = np.array(model["grid"], dtype=float)
    guessed = np.zeros(grid.shape, dtype=bool)
    for kind, i, j in profile_order(rows, widths, drafter_ks(widths[-1] - 1))[int(found[1]):]:
        if kind == 0:
            guessed[i, j] = True
    cut = np.where(guessed, np.nan, grid)
    return rows, widths, guessed, monotone(fill_by_tokens(cut, rows, widths, rows_add=True))


def served(lines: list[dict], policies: list[str], min_rows: int) -> dict:
    """Median seconds of decode steps without a catch-up, by (policy, longest K, first of
    the sixteen rows counts from min_rows that hold the step's)."""
    seen = defaultdict(list)
    for line in lines:
        if line["policy"] in policies and line["rows"] >= min_rows and not is_prompt(line) \
                and not line.get("catch_up_s"):
            bin_ = min_rows + (line["rows"] - min_rows) // 16 * 16
            seen[line["policy"], max(line["drafted"], default=0), bin_].append(line["observed_s"])
    return {key: (len(v), statistics.median(v)) for key, v in sorted(seen.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("costs")
    p.add_argument("--log", help="a step log (speculative_config.decision_log) of the same model")
    p.add_argument("--policies", nargs="+", default=["fixed:4", "fixed:2", "goodput"])
    p.add_argument("--min-rows", type=int, default=64)
    args = p.parse_args()
    model = json.load(open(args.costs))["model"]
    rows, widths, guessed, grid = refill(model)
    stored = np.array(model["grid"], dtype=float)
    print(f"{int(guessed.sum())} target shapes guessed; ms stored -> guessed again by this tree")
    print("rows  " + "".join(f"{'width ' + str(w):>18}" for w in widths))
    for i, b in enumerate(rows):
        cells = [f"{stored[i, j] * 1e3:7.2f} -> {grid[i, j] * 1e3:6.2f}" if guessed[i, j]
                 else f"{stored[i, j] * 1e3:18.2f}" for j in range(len(widths))]
        print(f"{b:4d}  " + "".join(f"{c:>18}" for c in cells))
    if args.log:
        print("\nserved decode steps (no catch-up): policy, longest K, rows, steps, median ms taken")
        for (policy, k, bin_), (n, s) in served(read(args.log), args.policies, args.min_rows).items():
            if n >= 5:
                print(f"{policy:>8}  K={k}  {bin_:3d}-{bin_ + 15:3d}  {n:4d}  {s * 1e3:6.2f}")


if __name__ == "__main__":
    main()
