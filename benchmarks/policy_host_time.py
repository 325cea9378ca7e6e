"""Host time of the goodput policy per step (choose + observe), at several batch sizes.

On a GPU this work hides behind the step in flight; on a CPU it adds to every step, so it
is what goodput costs over "off" where it chooses K = 0. Requests decode with simulated
acceptance `--acceptance` against a cost model whose drafts are priced `--draft-price` of a
plain step per token, so that K settles where the prices say (0 with a high price).

    PYTHONPATH=. python benchmarks/policy_host_time.py [--batch-sizes 1,8,64,256]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tidal.config import SamplingParams
from tidal.request import Request
from tidal.speculative.cost_model import CostModel, grid_axes
from tidal.speculative.policy import Goodput
from tidal.step import StepPlan, StepResult


def time_policy(batch: int, steps: int, acceptance: float, draft_price: float, max_draft_len: int,
                seed: int = 0) -> dict:
    plain = 0.010
    cost = CostModel.from_function(lambda b, w: plain * (1 + draft_price * (w - 1)), *grid_axes(256, max_draft_len))
    policy = Goodput(cost, max_draft_len)
    requests = [Request(str(i), None, list(range(3, 35)), SamplingParams(max_tokens=10**6, ignore_eos=True), 0, ())
                for i in range(batch)]
    for req in requests:
        req.num_computed = req.num_absorbed = len(req.token_ids) - 1
    rng = np.random.default_rng(seed)
    choose_s, observe_s, ks = [], [], []
    for _ in range(steps):
        limits = [max_draft_len] * batch
        t = time.perf_counter()
        choice = policy.choose(requests, limits, 0)
        choose_s.append(time.perf_counter() - t)
        accepted = [1 + int(np.argmin(np.append(rng.random(k) < acceptance, False))) for k in choice]
        plan = StepPlan(requests, [1] * batch, list(choice), choice.note)
        result = StepResult(torch.zeros(batch, 1 + max(choice), dtype=torch.int64), torch.tensor(accepted))
        seconds = float(cost.step_time(batch, sum(choice), max(choice), sum(k > 0 for k in choice),
                                       batch * len(requests[0].token_ids)))
        t = time.perf_counter()
        policy.observe(plan, result, seconds)
        observe_s.append(time.perf_counter() - t)
        ks.append(float(np.mean(choice)))
        for req, k, n in zip(requests, choice, accepted):  # commit: the drafter is caught up where it drafted
            req.token_ids.extend([7] * n)
            req.num_computed = len(req.token_ids) - 1
            if k:
                req.num_absorbed = req.num_computed
    warm = steps // 4
    return {"batch": batch, "steps": steps - warm, "choose_us": 1e6 * float(np.median(choose_s[warm:])),
            "observe_us": 1e6 * float(np.median(observe_s[warm:])), "mean_k": float(np.mean(ks[warm:]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--acceptance", type=float, default=0.5)
    p.add_argument("--draft-prices", default="1.0,0.02", help="each a run: a draft token's price, in plain steps")
    p.add_argument("--max-draft-len", type=int, default=4)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = [time_policy(b, args.steps, args.acceptance, price, args.max_draft_len) | {"draft_price": price}
            for price in map(float, args.draft_prices.split(",")) for b in map(int, args.batch_sizes.split(","))]
    print(f"{'draft price':>11} {'batch':>5} {'mean K':>6} {'choose us':>9} {'observe us':>10}")
    for r in rows:
        print(f"{r['draft_price']:>11g} {r['batch']:>5} {r['mean_k']:>6.2f} {r['choose_us']:>9.0f} {r['observe_us']:>10.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
