"""The speculation policies in a simulated closed loop: no model, no device, seconds.

    PYTHONPATH=. python benchmarks/policy_sim.py --acceptance '{"mean": 0.6, "std": 0.25}' --concurrency 1,8,32,128
    PYTHONPATH=. python benchmarks/policy_sim.py --acceptance '[0.9, 0.75, 0.6, 0.45]' --output-len 512
    PYTHONPATH=. python benchmarks/policy_sim.py --cost-model h200_moe --burst --input-len 2048 --output-len 128
    PYTHONPATH=. python benchmarks/policy_sim.py --acceptance '{"mean": 0.7, "sibling": 0.3}' \
        --topk 4 --depth 5 --k 16 --modes none,fixed:4,fixed:8,fixed:16,goodput

Each of c clients sends its next request as soon as the last one ends. A step's seconds
come from a cost function that stands in for the device (`h200_8b`: a Llama-3.1-8B with an
EAGLE-3 head on one H200, fitted by eye to the decision logs of runs 82, 95 and 96; or
`--cost-model h200_moe`, a Qwen3-30B-A3B shape's, from its measured step cost curve), and
drafts are accepted
as `SimulatedAcceptance` says (per position, per request; with `--topk` > 1, per depth and
sibling rank, over the tree the drafter grows with those odds, `grow_tree`). The policy is the engine's own
(`tidal.speculative.policy`), fed plans and results as the scheduler feeds it; its profile is the
cost function's decode steps, and its online corrections learn the rest. So a figure says
whether the policy chooses right when its prices can be right, and what it learns of
acceptance; what a GPU gives, `tidal bench matrix` measures. The "oracle" mode is goodput
told each request's true acceptance rates.

Tokens per second are counted after `--warmup` steps, the clients' first requests starting
at staggered points (a steady state), or, with `--burst --warmup 0 --requests-per-client R`,
as `tidal bench matrix` counts a cell: every client's first prompt at once, R requests a
client (at least `--min-requests`), from the start until the last request is sent. Every
mode meets the same requests (each request's rates come from its seed). For goodput,
`expected_draft_tokens` sums what its estimates expected its drafts to add,
`accepted_draft_tokens` what they added. `--pause-every N` adds `--pause-ms` to one step in
N, at random (the same steps for every mode), as the H200's servers paused for 180-290 ms
every few hundred steps at 128 clients and more (runs 101-103). Writes --json if given.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import random

import numpy as np
import torch

from tidal.config import SamplingParams, SimulatedAcceptance, SpecConfig
from tidal.request import Request, Status
from tidal.speculative.acceptance import AcceptanceModel
from tidal.speculative.cost_model import CostModel, grid_axes
from tidal.speculative.policy import Fixed, Goodput, Off
from tidal.step import StepPlan, StepResult


CATCH_UP_MS = (0.3, 0.001)  # a catch-up pass, and each token it absorbs (run96's spans)


def h200_8b(b, drafts, max_draft, drafting, prompt_tokens=0, catch_up=0, passes=None, topk=1):
    """Milliseconds of one step: the target's forward (a fixed cost, a share per row and per
    draft verified, a draft dearer in a larger batch, and at least 0.027 ms a token in all:
    compute-bound), the drafter's K passes over the `drafting` rows before it (each a little
    dearer with more rows; a tree's `passes` are its depth, each after the catch-up over
    `topk` fed nodes a row, priced as a chain's pass over that many rows: an assumption, no
    tree's drafting was timed in graphs on the GPU yet), 4 ms more for a step with prompt tokens (run82: 256 prompt tokens beside 31 decodes made
    a step of 11.8 ms, 512 beside 30 one of 19.5), and the drafter's catch-up over `catch_up`
    tokens it missed. Decode steps of runs 95-96 (medians of the logged steps with one K for
    every row, no prompt and no catch-up, all modes): 6.16 / 8.31 ms at 32 rows and
    K = 1 / 4; 7.65 / 10.89 / 14.39 / 22.50 at 128 rows and K = 0 / 1 / 2 / 4; 11.54 /
    18.69 / 40.91 at 256 and K = 0 / 1 / 4 (this gives 5.9, 8.2; 7.8, 11.3, 14.9, 22.0;
    11.2, 18.4, 40.7)."""
    per_draft = min(0.022, 0.008 + 1e-4 * b)
    target = max(4.3 + 0.027 * b + per_draft * drafts, 0.027 * (b + drafts + prompt_tokens))
    passes = max_draft if passes is None else passes
    drafter = (0.25 + 0.005 * drafting) + (passes - 1) * (0.25 + 0.005 * drafting * topk) if drafts else 0.0
    return target + drafter + (4.0 if prompt_tokens else 0.0) + catch_up_ms(catch_up)


# One step of the Qwen3-30B-A3B shape (random weights: near-uniform routing) on one H200 by the
# tokens in it: up to 256 the target's step cost curve (M decode rows, CUDA graphs;
# `2026-12-04-h200-moe/`, run 6), past it read off the in-process W2 steps at 128 clients of
# `2026-12-07-h200/` run 1 (graphs to 2,048; the drafter's share taken out by eye).
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MOE_MS = (4.25, 5.17, 5.72, 7.81, 11.98, 16.22, 18.83, 19.98, 22.54, 26.0, 36.0, 50.0)


def h200_moe(b, drafts, max_draft, drafting, prompt_tokens=0, catch_up=0, passes=None, topk=1):
    """Milliseconds of one step of the MoE: the target's forward as its tokens set it (each
    token brings experts of its own until about 64 tokens read them all, then compute grows
    with the tokens; past 2,048 in proportion), the drafter's passes (an EAGLE-3-shaped head
    in graphs: batch 1 at K = 4 made 1.99x plain at acceptance 0.7, so its passes cost
    little), 3 ms more for a step with prompt tokens (its attention runs eagerly between
    the piecewise graphs), and the drafter's catch-up."""
    tokens = b + drafts + prompt_tokens
    target = float(np.interp(tokens, MOE_TOKENS, MOE_MS)) * max(1.0, tokens / MOE_TOKENS[-1])
    passes = max_draft if passes is None else passes
    drafter = passes * (0.12 + 0.002 * drafting * topk) if drafts else 0.0
    return target + drafter + (3.0 if prompt_tokens else 0.0) + catch_up_ms(catch_up)


COSTS = {"h200_8b": h200_8b, "h200_moe": h200_moe}


def catch_up_ms(tokens: int) -> float:
    return CATCH_UP_MS[0] + CATCH_UP_MS[1] * tokens if tokens else 0.0


def price_list(cost_ms, spec: SpecConfig, max_num_seqs: int, pass_scale: float = 1.0) -> CostModel:
    """The cost function as a start-up profile would measure it: the target's decode grid
    and the drafter's proposals at K = 1 and the largest K, a fixed part and a price per
    pass fitted through them (`tidal.profiling`); the engine's online corrections then
    learn the rest (steps with prompt tokens). `pass_scale`: a profile that times each
    drafter pass at that multiple of what it takes while serving (timed alone, its host
    work shows; in a served step it hides behind the step before)."""
    k = spec.max_draft_len
    batch_sizes, widths = grid_axes(max_num_seqs, k)
    grid = [[cost_ms(b, b * (w - 1), 0, 0) / 1e3 for w in widths] for b in batch_sizes]
    first, last = ([(cost_ms(b, b, n, b) - cost_ms(b, b, 0, 0)) / 1e3 for b in batch_sizes] for n in (1, k))
    passes = [spec.draft_depth(n) for n in range(k + 1)]
    span = passes[k] - passes[1]
    step = [pass_scale * (hi - lo) / span if span else lo for lo, hi in zip(first, last)]
    return CostModel(batch_sizes, widths, grid, draft_fixed=[lo - s for lo, s in zip(first, step)], draft_step=step,
                     draft_passes=passes, catch_up_fixed=CATCH_UP_MS[0] / 1e3, catch_up_token=CATCH_UP_MS[1] / 1e3,
                     source="simulated")


@functools.lru_cache(maxsize=None)
def grow_tree(rates: tuple[float, ...], sibling: float, topk: int, levels: int, k: int) -> dict[tuple, int]:
    """The best k nodes of the tree the drafter grows under simulated acceptance
    (`ChainDrafter._grow` with `_children`'s simulated odds): levels min(topk, k) wide at
    the root, then the topk best nodes of each level each given topk children; a node's
    score is the sum of log(rate at its parent's depth x sibling^rank) down its path.
    Returns {path of sibling ranks: query index}, best first from 1."""
    def odds(depth, rank):
        return max(math.log(max(rates[min(depth, len(rates) - 1)] * sibling ** rank, 1e-300)), -1e4)

    level = [((r,), odds(0, r)) for r in range(min(topk, k))]
    grown = list(level)
    for depth in range(1, levels):
        fed = sorted(level, key=lambda node: -node[1])[:topk]
        level = [(path + (r,), score + odds(depth, r)) for path, score in fed for r in range(topk)]
        grown += level
    best = sorted(grown, key=lambda node: -node[1])[:k]
    return {path: i + 1 for i, (path, _) in enumerate(best)}


def walk_tree(tree: dict[tuple, int], rates, sibling: float, topk: int, rng) -> list[int]:
    """Simulated acceptance's walk (`tree.simulated_choice`): at a node of depth m the target's
    token is its r-th child with probability rates[m] x sibling^r; the walk goes on while that
    child is in the tree. Returns the query indices of the accepted nodes."""
    path, accepted = (), []
    while True:
        u, total, rank = rng.random(), 0.0, None
        for r in range(topk):
            total += rates[min(len(path), len(rates) - 1)] * sibling ** r
            if u < total:
                rank = r
                break
        if rank is None or path + (rank,) not in tree:
            return accepted
        path += (rank,)
        accepted.append(tree[path])


class Client:
    def __init__(self, index: int, args, acceptance: SimulatedAcceptance):
        self.index, self.args, self.acceptance, self.sent = index, args, acceptance, 0

    def next_request(self) -> tuple[Request, list[float], "Client"]:
        seed = self.index * 100003 + self.sent
        self.sent += 1
        req = Request(f"{self.index}-{self.sent}", None, list(range(self.args.input_len)),
                      SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True), seed, ())
        req.status = Status.RUNNING
        return req, self.acceptance.rates(seed, self.args.rates_len), self


class Told(AcceptanceModel):
    """Acceptance estimates that are each request's true rates (the "oracle" mode): set
    beside goodput, what learning them costs it."""

    def __init__(self, max_draft_len: int):
        super().__init__(max_draft_len)
        self.truth: dict[Request, list[float]] = {}

    def estimates(self, rows):
        by_row = {self.row[req]: rates for req, rates in self.truth.items()}
        return np.array([by_row[r] for r in rows])


def simulate(policy, args, acceptance: SimulatedAcceptance, concurrency: int, seed: int) -> dict:
    """Steps of the closed loop as the engine runs them: decodes (with the policy's drafts)
    first, then waiting prompts in chunks up to the step's token budget; a request decodes
    from the step after its prompt's last chunk."""
    rng = random.Random(seed)  # the stagger below, then each step's accept/reject draws
    pauses = random.Random(seed + 1)  # which steps the host pauses in: the same ones for every mode
    first = [Client(i, args, acceptance).next_request() for i in range(concurrency)]
    # Requests in all (the matrix's count: --requests-per-client a client, at least --min-requests).
    sent, total = concurrency, math.inf
    if args.requests_per_client:
        total = max(args.min_requests, round(args.requests_per_client * concurrency))
    decoding, waiting = [], []  # waiting: requests still feeding their prompts, in order of arrival
    if args.burst:  # every client's first prompt at once, as `tidal bench matrix` sends them
        waiting = first
    else:  # the clients' first requests at staggered points, as in a steady state
        decoding = first
        for req, _, _ in decoding:
            req.token_ids.extend([0] * (1 + rng.randrange(args.output_len - 1)))
            req.num_computed = req.num_absorbed = req.num_tokens - 1
    told = isinstance(policy, Goodput) and isinstance(policy.acceptance, Told)
    if isinstance(policy, Goodput):
        policy.demand = lambda limit: min(sum(r.num_tokens - r.num_computed for r, _, _ in waiting), limit)
        policy.queued = lambda: [r for r, _, _ in waiting]
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
            estimate = policy.acceptance.gains(policy.acceptance.rows(reqs), args.k)
            want = sum(estimate[i, :k].sum() for i, k in enumerate(ks))
        accepted, paths = [], []
        for k, (_, rates, _) in zip(ks, decoding):
            if args.topk > 1:
                nodes = walk_tree(grow_tree(tuple(rates), acceptance.sibling, args.topk, args.spec.draft_depth(k), k),
                                  rates, acceptance.sibling, args.topk, rng) if k else []
                paths.append([0] + nodes + [0] * (args.k - len(nodes)))
                accepted.append(len(nodes))
                continue
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
        # A drafting request's drafter first absorbs what it missed (its prompt, K = 0 steps)
        # beyond the K + 1 tokens every proposal feeds.
        catch_up = sum(max(r.num_computed - r.num_absorbed - args.k - 1, 0) for r, k in zip(reqs, ks) if k)
        ms = args.cost(len(reqs), sum(ks), max(ks, default=0), sum(k > 0 for k in ks), sum(chunks), catch_up)
        if args.pause_every and pauses.random() < 1 / args.pause_every:
            ms += args.pause_ms
        if reqs:
            fed = [req for req, _, _ in waiting[:len(chunks)]]
            done = [req.num_computed + n == req.num_tokens for req, n in zip(fed, chunks)]
            plan = StepPlan(reqs + fed, [1] * len(reqs) + chunks, list(ks) + [0] * len(fed), ks.note)
            result = StepResult(torch.zeros(len(plan.requests), 1 + max(ks), dtype=torch.int64),
                                torch.tensor([1 + n for n in accepted] + [int(d) for d in done]),
                                paths=torch.tensor(paths + [[0] * (1 + args.k)] * len(fed)) if args.topk > 1 else None)
            policy.observe(plan, result, ms / 1e3, catch_up_ms(catch_up) / 1e3 if catch_up else None)
        made = 0
        for (req, _, client), n, k in zip(decoding, accepted, ks):
            req.token_ids.extend([0] * (1 + n))
            req.num_computed = req.num_tokens - 1
            if k:  # the drafter saw every token up to the drafts
                req.num_absorbed = req.num_computed
            made += 1 + n
            if req.num_tokens - req.num_prompt_tokens >= args.output_len:  # its EOS, or its max_tokens
                req.status = Status.FINISHED
                if sent < total:
                    waiting.append(client.next_request())
                    sent += 1
        decoding = [entry for entry in decoding if not entry[0].finished]
        for (req, rates, client), n in zip(list(waiting), chunks):
            req.num_computed += n
            if req.num_computed == req.num_tokens:  # its first token: it decodes from the next step
                req.token_ids.append(0)
                req.num_computed = req.num_tokens - 1  # the drafter has yet to absorb the prompt
                made += 1
                waiting.remove((req, rates, client))
                decoding.append((req, rates, client))
        if step >= args.warmup:
            seconds += ms / 1e3
            tokens += made
            if isinstance(policy, Goodput) and reqs:
                expected += want
                got += sum(accepted)
        if sent == total:
            break  # the last request is sent: the load is whole no longer
    row = {"mode": "oracle" if told else getattr(policy, "label", policy.name),
           "concurrency": concurrency, "tokens_per_s": tokens / seconds, "steps_counted": step + 1 - args.warmup}
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
    p.add_argument("--max-tokens", type=int,
                   help="the requests' max_tokens (default --output-len); where more, they stop at "
                        "--output-len as at an EOS the engine does not foresee")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (trees: num_draft_tokens)")
    p.add_argument("--topk", type=int, default=1, help="trees of drafts, topk wide (1: chains)")
    p.add_argument("--depth", type=int, help="a tree's num_speculative_tokens (default --k)")
    p.add_argument("--token-budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--modes", default="none,fixed:1,fixed:2,fixed:4,goodput,oracle")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--requests-per-client", type=float,
                   help="the clients send this many requests a client (at least --min-requests in all), and "
                        "a mode's figure counts the steps from the start until the last one is sent, as "
                        "`tidal bench matrix` counts while the load is whole (with --burst and --warmup 0, "
                        "the matrix's protocol; --steps caps it)")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--burst", action="store_true",
                   help="the clients' first prompts all at once (as the matrix sends them), not staggered")
    p.add_argument("--seed", default="0",
                   help="the draws' seed; several (comma-separated) run every cell once each, and the "
                        "table ends with goodput's share of the best other mode at its lowest and median")
    p.add_argument("--pause-every", type=float, default=0,
                   help="the host pauses in one step of this many, at random (0: never)")
    p.add_argument("--pause-ms", type=float, default=250.0, help="how long a pause adds to its step")
    p.add_argument("--profile-pass-scale", type=float, default=1.0,
                   help="goodput's profile prices each drafter pass at this multiple of the truth "
                        "(online corrections must find the rest)")
    p.add_argument("--cost-model", choices=sorted(COSTS), default="h200_8b",
                   help="the device's step times: a Llama-3.1-8B or a Qwen3-30B-A3B shape, each on an H200")
    p.add_argument("--json")
    p.add_argument("--decision-log", help="append every policy's line per step here (as the engine's decision_log)")
    args = p.parse_args()
    args.max_tokens = args.max_tokens or args.output_len
    if args.max_tokens < args.output_len:
        p.error("--max-tokens: at least --output-len")
    log = open(args.decision_log, "a", buffering=1) if args.decision_log else None
    acceptance = SimulatedAcceptance.parse(json.loads(args.acceptance))
    if args.topk > 1 and "oracle" in args.modes.split(","):
        p.error("--modes: oracle tells goodput a chain's rates; with --topk > 1 leave it out")
    depth = args.depth or args.k
    args.spec = SpecConfig("draft_model", depth, model="(simulated)", topk=args.topk, num_draft_tokens=args.k,
                           simulate_acceptance=acceptance)
    args.rates_len = depth if args.topk > 1 else args.k
    truth = COSTS[args.cost_model]
    args.cost = lambda b, drafts, max_draft, *rest: truth(b, drafts, max_draft, *rest,
                                                          passes=args.spec.draft_depth(max_draft), topk=args.topk)
    rows, shares, seeds = [], {}, [int(x) for x in args.seed.split(",")]
    for seed, c in itertools.product(seeds, [int(x) for x in args.concurrency.split(",")]):
        cell = {}
        for mode in args.modes.split(","):
            if mode == "none":
                policy = Off()
            elif mode.startswith("fixed:"):
                policy = Fixed(int(mode.split(":")[1]))
            else:
                policy = Goodput(price_list(args.cost, args.spec, max(256, c), args.profile_pass_scale), args.k,
                                 token_budget=args.token_budget)
                policy.acceptance.marginal = args.topk > 1
                if mode == "oracle":
                    policy.acceptance = Told(args.k)
            policy.log = log
            row = simulate(policy, args, acceptance, c, seed)
            row["seed"] = seed
            rows.append(row)
            cell[row["mode"]] = row
        others = [r["tokens_per_s"] for m, r in cell.items() if m not in ("goodput", "oracle")]
        g = cell.get("goodput")
        extra = ""
        if g and others:
            best = max(others)
            shares.setdefault(c, []).append(g["tokens_per_s"] / best)
            extra = (f"  goodput/best {g['tokens_per_s'] / best:.3f}  drafts expected {g['expected_draft_tokens']:.0f}"
                     f" got {g['accepted_draft_tokens']:.0f}")
        print(f"seed {seed}  c={c:4d}  " + "  ".join(f"{m} {r['tokens_per_s']:7.0f}" for m, r in cell.items()) + extra, flush=True)
    for c, share in shares.items() if len(seeds) > 1 else ():
        print(f"c={c:4d}  goodput/best over {len(share)} seeds: lowest {min(share):.3f}, median {np.median(share):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("cost", "spec")}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
