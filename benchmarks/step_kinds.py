"""Where a server's time went, by policy and kind of step, from its step log
(`speculative_config.decision_log`: a line per step, for every policy).

    python benchmarks/step_kinds.py decisions_matrix.jsonl[.gz] --min-rows 24 [--split k|around|catch-up]
        [--catch-up-ms 1.5] [--steps goodput=845:1464 --steps fixed:2=884:1549] [--prompt-fit]

A step is a `decode` when every row fed one token, a `prompt` step when prompt chunks
shared it. `--split k` splits both kinds by their longest K; `--split around` into
those just before a prompt step, just after one, and the others (the steps next to an
arrival); `--split catch-up` by their drafter's catch-up: none, or timed at most or over
--catch-up-ms (the same catch-up has run at two speeds). For each policy and kind: steps,
seconds and their share of the policy's, tokens committed and their rate, drafts per row,
the median step and, where the policy predicted it (goodput), the median prediction, and
how many of the steps carried a drafter's catch-up (goodput logs it). --min-rows keeps the
steps with at least that many rows (one cell's steady state when a log holds several loads);
--steps POLICY=FIRST:LAST keeps only those of that policy's steps (its lines' `step`,
inclusive), one cell of a matrix.
--prompt-fit also fits, per policy, each step that carries prompt tokens as the median decode
step of its longest K plus a fixed cost plus a price per prompt token (least squares), to see
what a prompt adds to a step (the cost model's form for such steps is another).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

import numpy as np


def read(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f]


def is_prompt(line: dict) -> bool:
    return line["new_tokens"] > line["rows"]


def step_kind(line: dict, before: dict | None, after: dict | None, split: str, catch_up_ms: float = 1.5) -> str:
    if split == "catch-up":
        seconds = line.get("catch_up_s") or 0.0
        speed = "none" if not seconds else f"<= {catch_up_ms:g} ms" if 1e3 * seconds <= catch_up_ms else f"> {catch_up_ms:g} ms"
        return f"{'prompt' if is_prompt(line) else 'decode'}, catch-up {speed}"
    if split == "k":
        return f"{'prompt' if is_prompt(line) else 'decode'} K={max(line['drafted'], default=0)}"
    if is_prompt(line):
        return "prompt"
    if split == "around" and after is not None and is_prompt(after):
        return "before a prompt step"
    if split == "around" and before is not None and is_prompt(before):
        return "after a prompt step"
    return "decode"


def summarize(lines: list[dict], min_rows: int = 0, split: str = "kind",
              steps: dict[str, tuple[int, int]] | None = None, catch_up_ms: float = 1.5) -> list[dict]:
    by_policy = defaultdict(list)
    for line in lines:
        first, last = (steps or {}).get(line["policy"], (0, float("inf")))
        if line["rows"] >= min_rows and first <= line["step"] <= last and (not steps or line["policy"] in steps):
            by_policy[line["policy"]].append(line)
    groups = defaultdict(list)
    for policy, steps in by_policy.items():
        for i, line in enumerate(steps):
            before, after = steps[i - 1] if i else None, steps[i + 1] if i + 1 < len(steps) else None
            groups[policy, step_kind(line, before, after, split, catch_up_ms)].append(line)
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
                    "with_catch_up": sum(s.get("catch_up", 0) > 0 for s in steps),
                    "median_ms": 1e3 * statistics.median(s["observed_s"] for s in steps),
                    "median_predicted_ms": 1e3 * statistics.median(s["predicted_s"] for s in steps)
                    if all("predicted_s" in s for s in steps) else None})
    return out


def prompt_fit(lines: list[dict], min_rows: int = 0) -> list[dict]:
    """Per policy: seconds of a step with prompt tokens ~ the median decode step at its longest
    K + fixed + price x prompt tokens, over the steps whose K some decode steps (5 or more) ran
    at; and the fit's median absolute residual, as a share of the step."""
    out = []
    for policy in sorted({line["policy"] for line in lines}):
        steps = [s for s in lines if s["policy"] == policy and s["rows"] >= min_rows]
        decode = defaultdict(list)
        for s in steps:
            if not is_prompt(s):
                decode[max(s["drafted"], default=0)].append(s["observed_s"])
        base = {k: statistics.median(v) for k, v in decode.items() if len(v) >= 5}
        fitted = [s for s in steps if is_prompt(s) and max(s["drafted"], default=0) in base]
        if len(fitted) < 2:
            continue
        prompt = np.array([s["new_tokens"] - s["rows"] for s in fitted], dtype=float)
        seconds = np.array([s["observed_s"] for s in fitted])
        decode_s = np.array([base[max(s["drafted"], default=0)] for s in fitted])
        terms = np.stack([np.ones_like(prompt), prompt], axis=1)
        (fixed, price), *_ = np.linalg.lstsq(terms, seconds - decode_s, rcond=None)
        residual = np.abs(seconds - decode_s - terms @ (fixed, price)) / seconds
        out.append({"policy": policy, "steps": len(fitted), "fixed_ms": 1e3 * fixed, "us_per_prompt_token": 1e6 * price,
                    "median_abs_residual": float(np.median(residual))})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--min-rows", type=int, default=0)
    p.add_argument("--split", choices=("kind", "k", "around", "catch-up"), default="kind")
    p.add_argument("--catch-up-ms", type=float, default=1.5)
    p.add_argument("--steps", action="append", default=[], metavar="POLICY=FIRST:LAST")
    p.add_argument("--prompt-fit", action="store_true")
    args = p.parse_args()
    steps = {}
    for item in args.steps:
        policy, _, span = item.rpartition("=")
        first, _, last = span.partition(":")
        steps[policy] = (int(first), int(last))
    print(f"{'policy':10} {'kind':26} {'steps':>6} {'s':>7} {'share':>6} {'tokens':>7} {'tok/s':>7} "
          f"{'drafts/row':>10} {'median ms':>9} {'predicted':>9} {'catch-ups':>9}")
    lines = read(args.log)
    for r in summarize(lines, args.min_rows, args.split, steps, args.catch_up_ms):
        predicted = "" if r["median_predicted_ms"] is None else f"{r['median_predicted_ms']:9.2f}"
        print(f"{r['policy']:10} {r['kind']:26} {r['steps']:6d} {r['seconds']:7.2f} {r['share']:6.2f} "
              f"{r['tokens']:7d} {r['tokens_per_s']:7.0f} {r['drafts_per_row']:10.2f} {r['median_ms']:9.2f} {predicted:>9}"
              f" {r['with_catch_up']:9d}")
    if args.prompt_fit:
        print(f"\n{'policy':10} {'prompt steps':>12} {'fixed ms':>8} {'us/prompt token':>15} {'median |residual|':>17}")
        for r in prompt_fit(lines, args.min_rows):
            print(f"{r['policy']:10} {r['steps']:12d} {r['fixed_ms']:8.2f} {r['us_per_prompt_token']:15.2f} "
                  f"{r['median_abs_residual']:17.3f}")


if __name__ == "__main__":
    main()
