"""The speculation policies in a simulated closed loop: no model, no device, seconds.

    PYTHONPATH=. python benchmarks/policy_sim.py --acceptance '{"mean": 0.6, "std": 0.25}' --concurrency 1,8,32,128
    PYTHONPATH=. python benchmarks/policy_sim.py --acceptance '[0.9, 0.75, 0.6, 0.45]' --output-len 512

Each of c clients sends its next request as soon as the last one ends. A step's seconds
come from a cost function that stands in for the device (`h200_8b`: a Llama-3.1-8B with an
EAGLE-3 head on one H200, fitted by eye to run82's decision log), and drafts are accepted
as `SimulatedAcceptance` says (per position, per request). The policy is the engine's own
(`tidal.spec.policy`), fed plans and results as the scheduler feeds it; its profile is the
cost function's decode steps, and its online corrections learn the rest. So a figure says
whether the policy chooses right when its prices can be right, and what it learns of
acceptance; what a GPU gives, `tidal bench matrix` measures. The "oracle" mode is goodput
told each request's true acceptance rates.

Tokens per second are counted after `--warmup` steps, the clients' first requests starting
at staggered points (a steady state). Every mode meets the same requests (each request's
rates come from its seed). For goodput, `expected_draft_tokens` sums what its estimates
expected its drafts to add, `accepted_draft_tokens` what they added. Writes --json if given.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch

from tidal.config import SamplingParams, SimulatedAcceptance
from tidal.request import Request, Status
from tidal.spec.acceptance import AcceptanceModel
from tidal.spec.cost_model import CostModel, grid_axes
from tidal.spec.policy import Fixed, Goodput, Off
from tidal.step import StepPlan, StepResult


def h200_8b(b, drafts, max_draft, prompt_tokens=0):
    """Milliseconds of one step: the target's forward (a fixed cost, a share per row and per
    draft verified, and at least 0.027 ms a token in all: compute-bound), the drafter's K
    passes before it (each a little dearer with more rows), and 4 ms more for a step with
    prompt tokens (run82: 256 prompt tokens beside 31 decodes made a step of 11.8 ms, 512
    beside 30 one of 19.5)."""
    target = max(4.3 + 0.04 * b + 0.01 * drafts, 0.027 * (b + drafts + prompt_tokens))
    drafter = max_draft * (0.25 + 0.005 * b) if drafts else 0.0
    return target + drafter + (4.0 if prompt_tokens else 0.0)


def price_list(cost_ms, max_draft_len: int, max_num_seqs: int) -> CostModel:
    """The cost function as a start-up profile would measure it: the target's decode grid
    and the drafter's steps (a step's K draft passes, priced per batch size); the engine's
    online corrections then learn the rest (steps with prompt tokens)."""
    batch_sizes, widths = grid_axes(max_num_seqs, max_draft_len)
    grid = [[cost_ms(b, b * (w - 1), 0) / 1e3 for w in widths] for b in batch_sizes]
    draft_step = [(cost_ms(b, b, 1) - cost_ms(b, b, 0)) / 1e3 for b in batch_sizes]
    return CostModel(batch_sizes, widths, grid, draft_step=draft_step, source="simulated")


class Client:
    def __init__(self, index: int, args, acceptance: SimulatedAcceptance):
        self.index, self.args, self.acceptance, self.sent = index, args, acceptance, 0

    def next_request(self) -> tuple[Request, list[float], "Client"]:
        seed = self.index * 100003 + self.sent
        self.sent += 1
        req = Request(f"{self.index}-{self.sent}", None, list(range(self.args.input_len)),
                      SamplingParams(max_tokens=self.args.output_len, ignore_eos=True), seed, ())
        req.status = Status.RUNNING
        return req, self.acceptance.rates(seed, self.args.k), self


class Told(AcceptanceModel):
    """Acceptance estimates that are each request's true rates (the "oracle" mode): set
    beside goodput, what learning them costs it."""

    def __init__(self, max_draft_len: int):
        super().__init__(max_draft_len)
        self.truth: dict[Request, list[float]] = {}

    def estimates(self, rows):
        by_row = {self.row[req]: rates for req, rates in self.truth.items()}
        return np.array([by_row[r] for r in rows])


def simulate(policy, args, acceptance: SimulatedAcceptance, concurrency: int) -> dict:
    """Steps of the closed loop as the engine runs them: decodes (with the policy's drafts)
    first, then waiting prompts in chunks up to the step's token budget; a request decodes
    from the step after its prompt's last chunk."""
    rng = random.Random(args.seed)  # the stagger below, then each step's accept/reject draws
    decoding = [Client(i, args, acceptance).next_request() for i in range(concurrency)]
    for req, _, _ in decoding:  # the clients' first requests at staggered points, as in a steady state
        req.token_ids.extend([0] * (1 + rng.randrange(args.output_len - 1)))
        req.num_computed = req.num_absorbed = req.num_tokens - 1
    waiting = []  # requests still feeding their prompts, in order of arrival
    told = isinstance(policy, Goodput) and isinstance(policy.acceptance, Told)
    if isinstance(policy, Goodput):
        policy.demand = lambda limit: min(sum(r.num_tokens - r.num_computed for r, _, _ in waiting), limit)
    seconds = tokens = expected = got = 0.0
    for step in range(args.warmup + args.steps):
        reqs = [req for req, _, _ in decoding]
        ks = [0] * len(reqs)
        if reqs:
            if told:
                policy.acceptance.truth = {req: rates for req, rates, _ in decoding}
            ks = policy.choose(reqs, [min(args.k, r.params.max_tokens - (r.num_tokens - r.num_prompt_tokens) - 1)
                                      for r in reqs], len(waiting))
        if isinstance(policy, Goodput) and reqs:
            estimate = np.cumprod(policy.acceptance.estimates(policy.acceptance.rows(reqs)), axis=1)
            want = sum(estimate[i, :k].sum() for i, k in enumerate(ks))
        accepted = []
        for k, (_, rates, _) in zip(ks, decoding):
            n = 0
            while n < k and rng.random() < rates[n]:
                n += 1
            accepted.append(n)
        room = args.token_budget - len(reqs) - sum(ks)
        chunks = []
        for req, _, _ in waiting:
            chunks.append(min(req.num_tokens - req.num_computed, room))
            room -= chunks[-1]
            if room == 0:
                break
        ms = args.cost(len(reqs), sum(ks), max(ks, default=0), sum(chunks))
        if reqs:
            fed = [req for req, _, _ in waiting[:len(chunks)]]
            done = [req.num_computed + n == req.num_tokens for req, n in zip(fed, chunks)]
            plan = StepPlan(reqs + fed, [1] * len(reqs) + chunks, list(ks) + [0] * len(fed), ks.note)
            result = StepResult(torch.zeros(len(plan.requests), 1 + max(ks), dtype=torch.int64),
                                torch.tensor([1 + n for n in accepted] + [int(d) for d in done]))
            policy.observe(plan, result, ms / 1e3)
        made = 0
        for (req, _, client), n in zip(decoding, accepted):
            req.token_ids.extend([0] * (1 + n))
            req.num_computed = req.num_absorbed = req.num_tokens - 1
            made += 1 + n
            if req.num_tokens - req.num_prompt_tokens >= req.params.max_tokens:
                req.status = Status.FINISHED
                waiting.append(client.next_request())
        decoding = [entry for entry in decoding if not entry[0].finished]
        for (req, rates, client), n in zip(list(waiting), chunks):
            req.num_computed += n
            if req.num_computed == req.num_tokens:  # its first token: it decodes from the next step
                req.token_ids.append(0)
                req.num_computed = req.num_absorbed = req.num_tokens - 1
                made += 1
                waiting.remove((req, rates, client))
                decoding.append((req, rates, client))
        if step >= args.warmup:
            seconds += ms / 1e3
            tokens += made
            if isinstance(policy, Goodput) and reqs:
                expected += want
                got += sum(accepted)
    row = {"mode": "oracle" if told else getattr(policy, "label", policy.name),
           "concurrency": concurrency, "tokens_per_s": tokens / seconds}
    if isinstance(policy, Goodput):
        row.update(expected_draft_tokens=expected, accepted_draft_tokens=got)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--acceptance", default='{"mean": 0.6, "std": 0.25}',
                   help="as speculative_config.simulate_acceptance (JSON)")
    p.add_argument("--concurrency", default="1,8,32,128,256")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--token-budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--modes", default="none,fixed:1,fixed:2,fixed:4,goodput,oracle")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    args.cost = h200_8b
    acceptance = SimulatedAcceptance.parse(json.loads(args.acceptance))
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        cell = {}
        for mode in args.modes.split(","):
            if mode == "none":
                policy = Off()
            elif mode.startswith("fixed:"):
                policy = Fixed(int(mode.split(":")[1]))
            else:
                policy = Goodput(price_list(args.cost, args.k, max(256, c)), args.k)
                if mode == "oracle":
                    policy.acceptance = Told(args.k)
            row = simulate(policy, args, acceptance, c)
            rows.append(row)
            cell[row["mode"]] = row
        best = max(r["tokens_per_s"] for m, r in cell.items() if m not in ("goodput", "oracle"))
        g = cell.get("goodput")
        extra = ""
        if g:
            extra = (f"  goodput/best {g['tokens_per_s'] / best:.3f}  drafts expected {g['expected_draft_tokens']:.0f}"
                     f" got {g['accepted_draft_tokens']:.0f}")
        print(f"c={c:4d}  " + "  ".join(f"{m} {r['tokens_per_s']:7.0f}" for m, r in cell.items()) + extra, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "cost"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
