"""Host time of the planner per step, on a CPU, no model: `Scheduler.schedule(in_flight)`,
the plan made while a step runs (async scheduling), plus `Scheduler.commit` of that step's
result, as `EngineCore.step` drives them.

`--rows` requests decode side by side (their prompts prefilled first, untimed) with a
fixed K (`--k`) or the goodput policy (`--policy goodput`, priced by a made-up cost model
whose drafts cost `--draft-price` of a plain step per token). Each step's result is made
up: every draft accepted, or with `--acceptance p` each draft accepted with probability p
after the one before it was (seeded, so that two trees given the same plans see the same
results). On a GPU this host time hides behind the step in flight while it is shorter;
on a CPU it adds to every step. Two trees side by side: run this file with each tree's
root first on PYTHONPATH (trees from 014a743 on, whose planner is `schedule(in_flight)`),
alternating, and compare the medians of the runs' medians (the host is noisy).

    PYTHONPATH=. python benchmarks/planner_host_time.py [--rows 256] [--k 1] [--steps 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import torch

from tidal.config import EngineConfig, SamplingParams, SpecConfig
from tidal.kv_cache import PagePool
from tidal.request import Request
from tidal.scheduler import Scheduler, pages_for
from tidal.speculative.policy import Fixed, Goodput
from tidal.step import StepPlan, StepResult

PLAIN_STEP_S = 0.010  # the made-up cost model's plain step (goodput only)


def build(args) -> Scheduler:
    """A planner with `args.rows` requests waiting, and pages for all of them to the end."""
    budget = max(args.budget, args.rows * (1 + args.k))  # room for every row's drafts
    config = EngineConfig(model="unused", device="cpu", page_size=args.page_size, max_num_seqs=args.rows,
                          max_num_batched_tokens=budget, enable_prefix_caching=True, async_scheduling=True)
    prefill_steps = math.ceil(args.rows * args.prompt_len / budget)  # (the first rows decode meanwhile)
    longest = args.prompt_len + (prefill_steps + args.warmup + args.steps + 4) * (1 + args.k)
    pool = PagePool(args.rows * pages_for(longest, args.page_size) + 1, args.page_size)
    speculation = SimpleNamespace(max_draft_len=args.k, proposer=SimpleNamespace(drafts_ahead=True),
                                  config=SpecConfig("draft_model", max(args.k, 1), model="unused"),
                                  make_policy=lambda demand, queued, config: Fixed(args.k))
    s = Scheduler(pool, config, 1 << 30, speculation if args.k else None)
    if args.policy == "goodput":
        from tidal.speculative.cost_model import CostModel, grid_axes

        cost = CostModel.from_function(lambda b, w: PLAIN_STEP_S * (1 + args.draft_price * (w - 1)),
                                       *grid_axes(args.rows, args.k))
        s.policy = Goodput(cost, args.k, token_budget=budget, demand=s.prefill_demand)
    params = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
    for i in range(args.rows):  # distinct prompts: no prefix shared
        s.add(Request(str(i), None, [3 + i] + list(range(4, 3 + args.prompt_len)), params, 0, ()))
    return s


def made_up_result(plan: StepPlan, rng: np.random.Generator, acceptance: float) -> StepResult:
    """Row i commits 1 + the drafts accepted (drafts accepted in order, each with
    probability `acceptance`); a prompt chunk that does not reach its end commits none."""
    width = 1 + plan.max_draft_len
    lens = []
    for i, k in enumerate(plan.draft_lens):
        accepted = k if acceptance >= 1 else int(np.argmin(np.append(rng.random(k) < acceptance, False)))
        lens.append(1 + accepted if plan.samples(i) else 0)
    return StepResult(torch.full((len(plan.requests), width), 7, dtype=torch.int64), torch.tensor(lens))


def observe(s: Scheduler, plan: StepPlan, result: StepResult, draft_price: float) -> None:
    """What the engine tells the policy after a step (untimed: the engine does it apart)."""
    seconds = PLAIN_STEP_S * (1 + draft_price * plan.max_draft_len)
    s.policy.observe(plan, result, seconds)


def run_once(args, seed: int) -> dict:
    s = build(args)
    rng = np.random.default_rng(seed)
    plan = s.schedule()
    while any(r.num_computed < r.num_tokens - 1 for r in s.running) or len(s.running) < args.rows:  # prefill
        result = made_up_result(plan, rng, args.acceptance)
        s.commit(plan, result)
        observe(s, plan, result, args.draft_price)
        plan = s.schedule()
    gc.collect()
    gc.freeze()  # as the engine does while serving (`frozen_heap`)
    plan_s, commit_s, not_ahead, ks = [], [], 0, []
    try:
        for step in range(args.warmup + args.steps):
            result = made_up_result(plan, rng, args.acceptance)
            started = time.perf_counter()
            ahead = s.schedule(plan)
            planned = time.perf_counter()
            s.commit(plan, result, ahead)
            if ahead is None:  # the engine plans after the commit instead
                ahead = s.schedule()
            done = time.perf_counter()
            observe(s, plan, result, args.draft_price)
            if step >= args.warmup:
                plan_s.append(planned - started)
                commit_s.append(done - planned)
                not_ahead += ahead is None
                ks.append(float(np.mean(ahead.draft_lens)))
            plan = ahead
    finally:
        gc.unfreeze()
    total = np.add(plan_s, commit_s) * 1e3
    return {"median_ms": float(np.median(total)), "p90_ms": float(np.percentile(total, 90)),
            "plan_median_ms": 1e3 * float(np.median(plan_s)), "commit_median_ms": 1e3 * float(np.median(commit_s)),
            "steps_not_planned_ahead": not_ahead, "mean_k": float(np.mean(ks)), "rows": len(plan.requests)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256, help="requests decoding side by side")
    p.add_argument("--k", type=int, default=1, help="the fixed K (goodput: K's limit)")
    p.add_argument("--policy", choices=("fixed", "goodput"), default="fixed")
    p.add_argument("--draft-price", type=float, default=0.02, help="goodput: a draft token's price, in plain steps")
    p.add_argument("--acceptance", type=float, default=1.0, help="each draft's acceptance (1: every draft)")
    p.add_argument("--steps", type=int, default=400, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=50, help="untimed decode steps before them")
    p.add_argument("--repeats", type=int, default=3, help="runs, each from a fresh planner")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (raised to fit every draft)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON here")
    args = p.parse_args()
    runs = [run_once(args, seed) for seed in range(args.repeats)]
    print(f"{'run':>3} {'median ms':>9} {'p90 ms':>7} {'plan ms':>7} {'commit ms':>9} {'mean K':>6} {'not ahead':>9}")
    for i, r in enumerate(runs):
        print(f"{i:>3} {r['median_ms']:>9.3f} {r['p90_ms']:>7.3f} {r['plan_median_ms']:>7.3f} "
              f"{r['commit_median_ms']:>9.3f} {r['mean_k']:>6.2f} {r['steps_not_planned_ahead']:>9}")
    summary = {key: float(np.median([r[key] for r in runs])) for key in ("median_ms", "p90_ms", "plan_median_ms",
                                                                        "commit_median_ms")}
    print(f"median of {len(runs)} runs: {summary['median_ms']:.3f} ms a step (p90 {summary['p90_ms']:.3f}; "
          f"plan {summary['plan_median_ms']:.3f}, commit {summary['commit_median_ms']:.3f})")
    if args.json:
        import tidal

        with open(args.json, "w") as f:
            json.dump({"tidal": tidal.__file__, "args": vars(args), "runs": runs, **summary}, f, indent=1)


if __name__ == "__main__":
    main()
