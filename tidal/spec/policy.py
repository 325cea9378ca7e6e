"""Speculation policies: how many tokens each decoding request drafts this step.

A policy sees the requests that are ready to decode (already admitted, with KV for all
but their last token) and the most each may draft (bounded by max_tokens, max_model_len
and the configured K). It returns one K_i per request; 0 means a plain decode for it.
After the step it is told what the step cost and what verification accepted.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Callable, Protocol

import numpy as np

from tidal.config import SpecConfig
from tidal.request import Request
from tidal.spec.acceptance import AcceptanceModel
from tidal.spec.cost_model import CostModel, grid_axes, profile
from tidal.step import StepPlan, StepResult


class SpecPolicy(Protocol):
    name: str

    def choose(self, requests: list[Request], limits: list[int], num_waiting: int) -> list[int]:
        ...

    def observe(self, plan: StepPlan, result: StepResult, step_time: float) -> None:
        """What the step cost (seconds, proposer included) and what it accepted."""
        ...

    def stats(self) -> dict:
        ...


class NoFeedback:
    def observe(self, plan, result, step_time):
        pass

    def stats(self) -> dict:
        return {"name": self.name}


class Off(NoFeedback):
    """Never drafts: every step is the plain decode path."""

    name = "off"

    def choose(self, requests, limits, num_waiting):
        return [0] * len(requests)


class Fixed(NoFeedback):
    """The same K for every request, as engines without a policy do."""

    name = "fixed"

    def __init__(self, k: int):
        self.k = k

    def choose(self, requests, limits, num_waiting):
        return [min(self.k, limit) for limit in limits]


class Table(NoFeedback):
    """K by the number of decoding requests, from a user table (as other engines do): the
    entry of the largest batch size <= B applies, the first entry below it."""

    name = "table"

    def __init__(self, table: tuple[tuple[int, int], ...]):
        self.batch_sizes = [b for b, _ in table]
        self.ks = [k for _, k in table]

    def choose(self, requests, limits, num_waiting):
        k = self.ks[max(bisect_right(self.batch_sizes, len(requests)) - 1, 0)]
        return [min(k, limit) for limit in limits]


class Goodput:
    """Per step, the K_i that maximise expected committed tokens per second of the step
    (DESIGN.md, "Choosing K: the goodput policy").

    The expected tokens of request i at K are 1 + sum_{j<=K} prod_{m<=j} a_i(m), from the
    acceptance model; the step's time comes from the cost model and depends on everyone's
    K at once. Two families of candidates are scored and the best wins:
      - the n drafts most likely to be accepted, over all requests, for every n (optimal
        when the cost follows the number of tokens; requests that accept more get a
        longer K);
      - the same K for every request (what pays when CUDA graphs pad each row to the
        widest one).
    K = 0 for everyone is the first candidate of the first family. The previous decision
    is kept unless the new one is better by `hysteresis`, and a request that has not
    drafted for `probe_interval` steps drafts one token now and then, so that its
    acceptance estimate does not stay stale where it was left: when the drafter runs
    anyway, or every `probe_interval` steps, stretched where a probe step costs more than
    `probe_overhead` of a plain one (under CUDA graphs at high load it widens every row).
    """

    name = "goodput"

    def __init__(self, cost: CostModel, max_draft_len: int, *, token_budget: int = 2048, pool=None,
                 demand: Callable[[int], int] | None = None, hysteresis: float = 0.03,
                 probe_interval: int = 32, max_probes: int = 4, probe_overhead: float = 0.5,
                 decision_log: str | None = None):
        self.cost = cost
        self.acceptance = AcceptanceModel(max_draft_len)
        self.token_budget = token_budget
        self.pool = pool          # KV headroom: drafts never take pages a preemption would have to free
        self.demand = demand      # demand(limit): prompt tokens that want this step's budget, counted up to limit
        self.hysteresis = hysteresis
        self.probe_interval = probe_interval
        self.max_probes = max_probes
        self.probe_overhead = probe_overhead  # a probe step this much dearer than a plain one stretches the interval
        self.log = open(decision_log, "a", buffering=1) if decision_log else None
        self.previous: dict[Request, int] = {}   # last decision before probes (for hysteresis)
        self.requested: dict[Request, int] = {}  # this step's decision with probes (what observe compares to)
        self.steps_since_drafting = 0
        self.decision: dict = {}
        self.num_decisions = self.num_held = self.num_probes = self.num_timed = 0
        self.predicted = self.observed = self.error = 0.0

    # -- deciding --------------------------------------------------------------------------

    def choose(self, requests, limits, num_waiting):
        self.num_decisions += 1
        if self.num_decisions % 64 == 0:
            self.acceptance.release_finished()
        b = len(requests)
        limit = np.asarray(limits, dtype=np.int64)
        rows = self.acceptance.rows(requests)
        self.acceptance.age[rows] += 1
        context = sum(r.num_tokens for r in requests)
        cap = self._draft_cap(b)
        ks, rate, held = np.zeros(b, dtype=np.int64), 0.0, False
        if cap > 0 and limit.max() > 0:
            gain = np.cumprod(self.acceptance.estimates(rows)[:, :limit.max()], axis=1)
            gain[np.arange(gain.shape[1]) >= limit[:, None]] = 0.0
            charge = self._displacement(cap)

            def seconds(n, longest, drafting):
                return self.cost.step_time(b, n, longest, drafting, context) + charge(n)

            ks, rate = self._search(gain, limit, seconds, cap)
            previous = np.minimum([self.previous.get(r, k) for r, k in zip(requests, ks.tolist())], limit)
            if not np.array_equal(previous, ks) and previous.sum() <= cap:
                kept = self._rate(gain, previous, seconds)
                if rate < kept * (1 + self.hysteresis):
                    ks, rate, held = previous, kept, True
        self.previous = dict(zip(requests, ks.tolist()))
        # Probes cost drafts, a drafter run and (with CUDA graphs) a wider step for everyone:
        # the dearer that is, the rarer they come, so that they take about
        # probe_overhead / probe_interval of the time (a drafting step carries them for free).
        interval = self.probe_interval
        if not ks.any():
            n = min(self.max_probes, int(np.count_nonzero(self.acceptance.age[rows] >= interval)))
            extra = self.cost.step_time(b, n, 1, n, context) / self.cost.step_time(b, 0, 0, 0, context) - 1
            interval *= max(1.0, float(extra) / self.probe_overhead)
        ks, probes = self._probe(ks, limit, rows, cap, interval)
        self.requested = dict(zip(requests, ks.tolist()))
        self.steps_since_drafting = 0 if ks.any() else self.steps_since_drafting + 1
        self.num_held += held
        self.num_probes += len(probes)
        self.decision = {"step": self.num_decisions, "batch": b, "waiting": num_waiting, "k": ks.tolist(),
                         "probes": probes, "held": held, "tokens_per_s": rate}
        return ks.tolist()

    @staticmethod
    def _search(gain, limit, seconds, cap):
        """Best (K per request, tokens per second) over both candidate families."""
        b, width = gain.shape
        # The n likeliest drafts: order by gain, position-major so that a tie keeps a
        # request's earlier position first (each request's drafts stay a prefix).
        flat = gain.T.ravel()
        order = np.argsort(-flat, kind="stable")[:min(cap, np.count_nonzero(flat))]
        pos = order // b
        tokens = b + np.concatenate([[0.0], np.cumsum(flat[order])])
        longest = np.concatenate([[0], np.maximum.accumulate(pos + 1)])
        drafting = np.concatenate([[0], np.cumsum(pos == 0)])
        rates = tokens / seconds(np.arange(len(order) + 1), longest, drafting)
        n = int(np.argmax(rates))
        ks, rate = np.bincount(order[:n] % b, minlength=b), float(rates[n])
        # The same K = w for every request that may draft it.
        w = np.arange(1, width + 1)
        uniform = np.minimum(limit[:, None], w)
        total = uniform.sum(axis=0)
        rates = (b + np.cumsum(gain, axis=1).sum(axis=0)) / seconds(total, w, np.count_nonzero(limit))
        rates[total > cap] = 0.0
        j = int(np.argmax(rates))
        if rates[j] > rate:
            ks, rate = uniform[:, j], float(rates[j])
        return ks, rate

    @staticmethod
    def _rate(gain, ks, seconds) -> float:
        tokens = len(ks) + gain[np.arange(gain.shape[1]) < ks[:, None]].sum()
        return float(tokens / seconds(ks.sum(), ks.max(), np.count_nonzero(ks)))

    def _draft_cap(self, b: int) -> int:
        """Drafts that fit the step's token budget and the free KV slots."""
        cap = self.token_budget - b
        if self.pool is not None:
            cap = min(cap, self.pool.num_free * self.pool.page_size - b)
        return max(cap, 0)

    def _displacement(self, cap: int) -> Callable:
        """Extra seconds for n drafts: a draft that takes budget a prompt wants pushes a
        token of prefill to a later step, priced at what a token costs in a full step."""
        spare = cap - (self.demand(cap) if self.demand else 0)
        per_token = self.cost.token_cost()
        return lambda n: per_token * np.maximum(np.asarray(n) - spare, 0)

    def _probe(self, ks, limit, rows, cap, interval):
        """Let the requests that have not drafted for longest draft one token, when the
        drafter runs anyway this step or has not run for `interval` steps."""
        stale = (ks == 0) & (limit > 0) & (self.acceptance.age[rows] >= interval)
        room = min(self.max_probes, cap - int(ks.sum()))
        if room <= 0 or not stale.any() or not (ks.any() or self.steps_since_drafting >= interval):
            return ks, []
        candidates = np.flatnonzero(stale)
        chosen = candidates[np.argsort(-self.acceptance.age[rows[candidates]], kind="stable")[:room]]
        ks = ks.copy()
        ks[chosen] = 1
        return ks, chosen.tolist()

    # -- learning --------------------------------------------------------------------------

    def observe(self, plan, result, step_time):
        reqs = plan.requests
        accepted = result.accept_lens.tolist()
        drafting = [i for i, r in enumerate(reqs) if self.requested.get(r, 0) > 0]
        if drafting:
            # A draft the proposer could not make counts as rejected: asking for it bought nothing.
            self.acceptance.update(self.acceptance.rows([reqs[i] for i in drafting]),
                                   np.array([self.requested[reqs[i]] for i in drafting]),
                                   np.array([accepted[i] - 1 for i in drafting]))
        predicted = None
        if all(n == 1 for n in plan.num_new_tokens):  # only decode shapes are on the cost grid
            ks = plan.draft_lens
            context = sum(r.num_computed + 1 for r in reqs)
            predicted = self.cost.observe(len(reqs), sum(ks), max(ks), sum(k > 0 for k in ks), context, step_time)
            miss = abs(predicted - step_time) / step_time
            self.error = miss if self.num_timed == 0 else 0.95 * self.error + 0.05 * miss
            self.predicted, self.observed = predicted, step_time
            self.num_timed += 1
        if self.log and self.decision:
            self.decision.update(predicted_s=predicted, observed_s=step_time, drafted=list(plan.draft_lens),
                                 accepted=[n - 1 for n in accepted])
            self.log.write(json.dumps(self.decision) + "\n")
        self.requested, self.decision = {}, {}  # a step without a decision learns no acceptance

    def stats(self) -> dict:
        return {
            "name": self.name,
            "cost_model": self.cost.source,
            "num_decisions": self.num_decisions,
            "num_held": self.num_held,
            "num_probes": self.num_probes,
            "step_time": {"predicted_s": self.predicted, "observed_s": self.observed,
                          "mean_abs_rel_error": self.error, "num_observed": self.num_timed},
            "acceptance_per_position": self.acceptance.server().tolist(),
        }



def make_policy(spec: SpecConfig, *, runner=None, proposer=None, pool=None, demand=None,
                max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int = 0,
                cost_model: CostModel | None = None) -> SpecPolicy:
    """The policy `spec` names. Goodput measures its cost model on `runner` and `proposer`
    at start-up unless one is given or `spec.cost_model` is "online"."""
    k = spec.num_speculative_tokens
    if spec.policy == "off":
        return Off()
    if spec.policy == "fixed":
        return Fixed(k)
    if spec.policy == "table":
        return Table(spec.table)
    if cost_model is None and spec.cost_model == "profile":
        cost_model = profile(runner, proposer, max_num_seqs, k, max_model_len, spec.profile_seconds)
    elif cost_model is None:
        cost_model = CostModel(*grid_axes(max_num_seqs, k), source="online")
    return Goodput(cost_model, k, token_budget=max_num_batched_tokens, pool=pool, demand=demand,
                   decision_log=spec.decision_log)
