"""Speculation policies: how many tokens each decoding request drafts this step.

A policy sees the requests that are ready to decode (already admitted, with KV for all
but their last token) and the most each may draft (bounded by max_tokens, max_model_len
and the configured K). It returns one K_i per request; 0 means a plain decode for it.
After the step it is told what the step cost and what verification accepted.
"""

from __future__ import annotations

import copy
import itertools
import json
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from tidal.config import SpecConfig
from tidal.request import Request
from tidal.speculative.acceptance import AcceptanceModel
from tidal.speculative.cost_model import CostModel, grid_axes
from tidal.step import StepPlan, StepResult


class SpecPolicy(Protocol):
    name: str

    def choose(self, requests: list[Request], limits: list[int], num_waiting: int,
               kv_room: int | None = None) -> Choice:
        """K per request within its limit. `kv_room`: the draft slots the KV cache holds
        without taking a page a preemption would have to free (None: no bound); the
        scheduler places drafts within free pages whatever a policy asks."""
        ...

    def observe(self, plan: StepPlan, result: StepResult, step_time: float,
                catch_up_time: float | None = None) -> None:
        """What the step cost (seconds it added to the time line, host work included), the
        part of it its drafter spent catching up (None where it did not; for the log), and
        what it accepted."""
        ...

    def stats(self) -> dict:
        ...


class Choice(list):
    """K per request, and the policy's note on how it chose them: the scheduler carries the
    note on the plan made from the choice (StepPlan.choice), and observe gets it back with
    that plan, however many steps were chosen in between (async scheduling chooses the next
    step's K before this step's outcome is seen)."""

    def __init__(self, draft_lens, note=None):
        super().__init__(draft_lens)
        self.note = note


def step_line(plan: StepPlan, result: StepResult, step_time: float, catch_up_time: float | None) -> dict:
    """What every policy's log line says of a step: its rows, the tokens it fed (more than
    its rows where prompt chunks share it), its seconds (and its drafter's catch-up's), and
    what each row drafted and had accepted."""
    return {"rows": len(plan.requests), "new_tokens": sum(plan.num_new_tokens), "observed_s": step_time,
            "catch_up_s": catch_up_time, "drafted": list(plan.draft_lens),
            "accepted": [n - 1 for n in result.accept_lens.tolist()]}


class NoFeedback:
    """A policy that learns nothing from its steps; with a log, it writes one line per
    step (as goodput does, so that modes can be compared step by step)."""

    log = None
    num_logged = 0

    def observe(self, plan, result, step_time, catch_up_time=None):
        if self.log:
            self.num_logged += 1
            self.log.write(json.dumps({"policy": self.label, "step": self.num_logged,
                                       **step_line(plan, result, step_time, catch_up_time)}) + "\n")

    @property
    def label(self) -> str:
        return self.name

    def stats(self) -> dict:
        return {"name": self.name}


class Off(NoFeedback):
    """Never drafts: every step is the plain decode path."""

    name = "off"

    def choose(self, requests, limits, num_waiting, kv_room=None):
        return Choice([0] * len(requests))


class Fixed(NoFeedback):
    """The same K for every request, as engines without a policy do."""

    name = "fixed"

    def __init__(self, k: int):
        self.k = k

    @property
    def label(self) -> str:
        return f"fixed:{self.k}"

    def choose(self, requests, limits, num_waiting, kv_room=None):
        return Choice([min(self.k, limit) for limit in limits])


class Table(NoFeedback):
    """K by the number of decoding requests, from a user table (as other engines do): the
    entry of the largest batch size <= B applies, the first entry below it."""

    name = "table"

    def __init__(self, table: tuple[tuple[int, int], ...]):
        self.batch_sizes = [b for b, _ in table]
        self.ks = [k for _, k in table]

    def choose(self, requests, limits, num_waiting, kv_room=None):
        k = self.ks[max(bisect_right(self.batch_sizes, len(requests)) - 1, 0)]
        return Choice([min(k, limit) for limit in limits])


@dataclass
class Decision:
    """What goodput's observe needs back about a choice (its Choice.note)."""

    requested: dict[Request, int]  # K per decoding request, probes included (what verification is compared to)
    catch_up: int                  # tokens past K + 1 per request the drafter absorbs in the step
    log: dict                      # the decision log's line


class Goodput:
    """Per step, the K_i that maximise expected committed tokens per second of the step.
    docs/design.md ("The goodput policy" and its subsection "How goodput decides") has the
    reasoning at length and the measurements behind it.

    A request's expected tokens at K come from its acceptance estimates; the step's seconds
    come from the cost model and depend on everyone's K at once. Two families of candidates
    are scored, the best winning: the n drafts most likely to be accepted over all requests,
    for every n (best where cost follows tokens; n = 0 is K = 0 for everyone), and one K for
    every request (best where CUDA graphs pad each row to the widest). Prompt tokens that
    share the step are computed anyway, so beside them a candidate scores the tokens it makes
    beyond what the best decode-only rate would buy in its seconds (Dinkelbach). A drafter's
    catch-up over the tokens it missed pays for every token its request has left, so each
    token expected this step bears 1 / (tokens left) of its price (all of it while prompts
    wait: the batch is still growing).

    Prompts share the token budget, and a loop of requests keeps bringing them: a request
    of P prompt and O output tokens brings, on average, P / O prompt tokens a step for each
    token it makes (its successor's prompt in a closed loop; as many by Little's law in an
    open one). Every request that will decode (decoding now, or queued for a seat with pages
    to hold it) so needs at least 1 + P / O budget tokens a step. Where that need passes
    the budget while prompts wait, requests queue and are admitted only as fast as the
    budget feeds their prompts; each makes its O tokens anyway, so a draft buys no tokens
    and spends more budget per token than a plain decode: no request drafts. Below that
    need, drafting beside waiting prompts is left to the prices (a burst of prompts binds
    the budget too, but drains, and drafting beside it makes tokens sooner).

    Drafts' own time is priced `draft_premium` above the cost model's figure, and at least
    the model's recent error on a decode step: drafting costs more than its steps show and
    the estimates are noisy, so a near tie goes to K = 0, whose price is exact. `hysteresis`
    keeps the previous decision unless a new one is clearly better, never a draft that K = 0
    now beats, so that noise does not move K. A request at K = 0 drafts one token now and
    then (a probe) so that its estimate does not stay where it was left. A K = 0 decision
    stands while its inputs do, so that plain steps do not pay the decision's host time. Now
    and then a width beside the choice runs for a step (exploration), since a width not run
    keeps a stale price and a price too high is never seen to be.
    """

    name = "goodput"

    def __init__(self, cost: CostModel, max_draft_len: int, *, token_budget: int = 2048,
                 draft_slots: list[int] | None = None, demand: Callable[[int], int] | None = None,
                 queued: Callable[[], list[Request]] | None = None,
                 hysteresis: float = 0.03, draft_premium: float = 0.1,
                 probe_interval: int = 32, max_probes: int = 4, probe_overhead: float = 0.5,
                 explore_interval: int = 32, explore_margin: float = 0.15):
        self.cost = cost
        self.acceptance = AcceptanceModel(max_draft_len)
        self.token_budget = token_budget
        # KV slots a request drafting K keeps, per K (`SpecConfig.draft_slots`; None: K, a chain's).
        self.slots = np.arange(max_draft_len + 1) if draft_slots is None else np.asarray(draft_slots)
        self.demand = demand      # demand(limit): prompt tokens that want this step's budget, counted up to limit
        self.queued = queued      # queued(): requests that will decode once their prompts are fed
        self.hysteresis = hysteresis
        self.draft_premium = draft_premium
        self.probe_interval = probe_interval
        self.max_probes = max_probes
        self.probe_overhead = probe_overhead  # a probe that costs this much of a step comes every probe_interval steps
        self.explore_interval = explore_interval  # 0: never run a width for its price
        self.explore_margin = explore_margin
        self.log = None  # the decision log, a line per step (make_policy opens it)
        self.previous: dict[Request, int] = {}   # last decision before probes (for hysteresis)
        self.steps_since_drafting = 0
        # A K = 0 decision stands, while its inputs stay, until this decision number (see choose).
        self.plain: tuple[list[Request], list[int], int, int, dict] | None = None
        self.num_decisions = self.num_held = self.num_probes = self.num_explored = self.num_reused = 0
        self.predicted = self.observed = 0.0
        self.outputs = np.zeros(2)  # finished requests' output tokens and count, fading (`_learn_outputs`)

    # -- deciding --------------------------------------------------------------------------

    def choose(self, requests, limits, num_waiting, kv_room=None):
        self.num_decisions += 1
        if self.num_decisions % 64 == 0:
            self._learn_outputs(self.acceptance.release_finished())
        rows = self.acceptance.rows(requests)
        self.acceptance.age[rows] += 1
        room = max(self.token_budget - len(requests), 0)
        demand = min(self.demand(room), room) if self.demand else 0
        need = self._loop_need(requests) if demand else 0.0
        cap = _Room(room if need <= self.token_budget else 0, np.inf if kv_room is None else max(kv_room, 0),
                    self.slots)
        standing = self._standing_plain(requests, limits, demand, cap, num_waiting)
        if standing is not None:
            return standing
        limit = np.asarray(limits, dtype=np.int64)
        ks, probes, wait, catch_up = np.zeros(len(requests), dtype=np.int64), [], self.probe_interval, 0
        pick = _Pick(ks, ks)
        if cap.open and limit.max() > 0:  # else no draft fits (budget, KV, limits): nothing to price
            prices = _Prices(self, requests, rows, limit, room, demand)
            pick = self._pick(prices, requests, limit, cap)
            ks = pick.ks
            # No probes while prompts wait for the budget: the batch is still growing, and
            # what a probe would learn is worth most once the load has settled.
            if not demand:
                ks, probes, wait = self._probe(pick.ks, limit, rows, cap, prices)
            catch_up = int(prices.backlog[ks > 0].sum())
        self.previous = dict(zip(requests, pick.decided.tolist()))
        self.steps_since_drafting = 0 if ks.any() else self.steps_since_drafting + 1
        self.num_held += pick.held
        self.num_explored += pick.explored
        self.num_probes += len(probes)
        log = {"step": self.num_decisions, "batch": len(requests), "waiting": num_waiting, "k": ks.tolist(),
               "probes": probes, "held": pick.held, "explored": pick.explored, "tokens_per_s": pick.rate,
               "plain_tokens_per_s": pick.plain_rate, "best_drafting": pick.best_drafting, "catch_up": catch_up,
               "catch_up_scale": float(self.cost.catch_up_scale[0]), "cap": cap.drafts, "loop_need": need,
               "kv_room": kv_room, "demand": demand}
        if not ks.any() and not demand:
            self.plain = (list(requests), list(limits), cap, self.num_decisions + min(wait, self.probe_interval), log)
        return Choice(ks.tolist(), Decision(dict(zip(requests, ks.tolist())), catch_up, log))

    def _loop_need(self, requests) -> float:
        """Budget tokens a step the loop needs at K = 0 (class docstring), counted until they
        pass the budget: 1 + P / O for every request queued to decode or decoding, P the
        prompt tokens it feeds (not those the prefix cache served it, as far as known: a
        waiting request's hits show once it is admitted) and O the output tokens it will make:
        its max_tokens, or the mean output of the requests that finished where that is less
        (requests that stop at EOS, or that left max_tokens at the context's length), but
        never less than it has made."""
        mean, need = self._mean_output(), 0.0
        for r in itertools.chain(self.queued() if self.queued else (), requests):  # the queued bring the most
            need += 1 + (r.num_prompt_tokens - r.num_cached_prompt_tokens) / min(
                r.params.max_tokens, max(mean, len(r.token_ids) - r.num_prompt_tokens + 1))
            if need > self.token_budget:
                break
        return need

    def _mean_output(self) -> float:
        return self.outputs[0] / self.outputs[1] if self.outputs[1] else np.inf

    def _learn_outputs(self, finished: list[Request]) -> None:
        """Count the output tokens of requests that finished, the older fading as the
        acceptance model's server estimate does (a server's traffic changes)."""
        for req in finished:
            self.outputs = self.outputs * (1 - 1 / self.acceptance.memory) + (req.num_output_tokens, 1)

    def _standing_plain(self, requests, limits, demand, cap, num_waiting) -> Choice | None:
        """The last K = 0 decision again while what it was made from stays (the same requests
        and limits, no prompt waiting, no more room for drafts) and no probe could be due: the
        estimates move only when requests draft, so it would come out the same, and a CPU pays
        the decision's host time on every plain step. None, forgetting it, once anything has
        changed."""
        if self.plain is None:
            return None
        same, same_limits, same_cap, until, log = self.plain
        if (not demand and self.num_decisions < until and same == requests and same_limits == limits
                and cap.within(same_cap)):
            self.steps_since_drafting += 1
            self.num_reused += 1
            return Choice([0] * len(requests), Decision(dict.fromkeys(requests, 0), 0, {
                **log, "step": self.num_decisions, "waiting": num_waiting, "reused": True}))
        self.plain = None
        return None

    def _pick(self, prices: _Prices, requests, limit, cap) -> _Pick:
        """The candidate that scores best, or the previous decision where it is nearly as
        good; now and then a width beside it instead, run for its price."""
        tokens, shapes, ks_of = prices.candidates(limit, cap)
        alone = prices.seconds(*shapes)
        rates = tokens / alone
        best = float(rates.max())  # tokens per second of the best step without prefill
        plain_rate = float(rates[0])  # K = 0 for everyone
        best_drafting = None
        if self.log and len(rates) > 1:  # the best that drafts, in parts (to explain a K = 0)
            best_drafting = prices.best_drafting(tokens, shapes, rates, ks_of, limit)
        scores = prices.score(tokens, shapes, alone, best)
        j = int(np.argmax(scores))
        ks, rate, held = ks_of(j), float(rates[j]), False
        kept = self._held(prices, requests, limit, cap, ks, best, scores[j], scores[0])
        if kept is not None:
            (ks, rate), held = kept, True
        explore = self._width_to_explore(prices, limit, ks, rate, rates)
        if explore is None:
            return _Pick(ks, ks, rate, plain_rate, best_drafting, held)
        # What hysteresis holds on to is the decision, not a width run for its price: an
        # explored width stays only if its price, once seen, makes it the decision.
        return _Pick(ks_of(explore), ks, float(rates[explore]), plain_rate, best_drafting, held=False, explored=True)

    def _held(self, prices: _Prices, requests, limit, cap, ks, best, score, plain_score):
        """The previous decision (within this step's limits) and its rate, where its score is
        within `hysteresis` of `score`, the best one's, so that noise in the estimates does
        not move K; else None. Never a draft that scores below K = 0 (`plain_score`): a move
        to the plain step, whose price is exact, is never held back, and a spell of
        rejections ends drafting at once."""
        previous = np.minimum([self.previous.get(r, k) for r, k in zip(requests, ks.tolist())], limit)
        if np.array_equal(previous, ks) or not cap.fits(previous):
            return None
        tokens, *shape = prices.shape(previous)
        alone = float(prices.seconds(*shape))
        held_score = prices.score(tokens, shape, alone, best)
        if held_score + self.hysteresis * best * alone >= score and (not previous.any() or held_score > plain_score):
            return previous, tokens / alone
        return None

    def _width_to_explore(self, prices: _Prices, limit, ks, rate, rates):
        """The candidate to run instead of `ks` for a step, every `explore_interval` decisions
        while every request drafts and no prompt waits: a uniform K one below or one above
        `ks`'s longest (in turn), if priced within `explore_margin` of `rate`. A width not run
        keeps the price it was last seen at, and the widths beside the choice are where a
        stale price would change it. None where none is due or near enough."""
        if not (self.explore_interval and self.num_decisions % self.explore_interval == 0 and not prices.demand
                and ks.any() and np.array_equal(ks > 0, limit > 0)):
            return None
        # The uniform candidates come last, K = 1 .. width; the neighbours of the
        # choice's longest K take turns.
        longest, width = int(ks.max()), prices.gain.shape[1]
        turn = (self.num_decisions // self.explore_interval) % 2
        for w in (longest - 1, longest + 1) if turn else (longest + 1, longest - 1):
            j = len(rates) - width + w - 1
            if 1 <= w <= width and rates[j] >= (1 - self.explore_margin) * rate:
                return j
        return None

    def _probe(self, ks, limit, rows, cap, prices: _Prices):
        """Let the requests at K = 0 that have gone longest without drafting draft one token,
        so that their acceptance estimates do not stay stale where they were left, when the
        drafter runs anyway this step or has not run for `interval` steps.

        A probe is priced at the time it adds beyond what its expected tokens are worth at
        the step's rate: a draft, the drafter's catch-up over what the request missed and
        (with CUDA graphs) a wider step for everyone, against the tokens it may win. The
        interval is `probe_interval` for a probe that costs `probe_overhead` of a step, and
        in proportion otherwise, so that probes take about probe_overhead / probe_interval
        of the time: a request whose estimate almost pays is probed often (a run of
        rejections cannot park it at K = 0 for good), one with a long history at high load
        rarely. Where nobody drafts, probes alone bring evidence, and a probe is also worth
        what it may teach: were the typical acceptance at the top of what the evidence allows
        (two standard errors above its estimate), the best uniform K would beat K = 0 by a
        share `stake` of its rate, and probes take that share of the time more, until enough
        trials show which side of K = 0 the acceptance lies (a few unlucky first drafts would
        otherwise leave K = 0 for as long as probes at the cost-based pace take to undo them).
        Returns the K with the probes, the rows probed, and how many decisions from
        now a probe could come at the earliest, all else staying."""
        age = self.acceptance.age[rows]
        idle = np.flatnonzero((ks == 0) & (limit > 0))
        room = min(self.max_probes, cap.left(ks))
        if room <= 0 or not len(idle):
            return ks, [], self.probe_interval
        chosen = idle[np.argsort(-age[idle], kind="stable")[:room]]
        probed = ks.copy()
        probed[chosen] = 1
        (seconds, probe_seconds), (tokens, probe_tokens) = prices.worth(np.stack([ks, probed]))
        interval = self.probe_interval * (probe_seconds / seconds - probe_tokens / tokens) / self.probe_overhead
        if not ks.any():  # nobody drafts: only probes bring evidence
            share = self.probe_overhead / self.probe_interval
            stake = prices.lifted(self.acceptance, rows, limit, 2 * self.acceptance.doubt()).stake(limit, cap)
            interval *= share / (share + stake)
        # Decisions until one could probe (ages and steps_since_drafting grow by one a decision).
        wait = max(1, int(np.ceil(interval - min(age[idle].max(), self.steps_since_drafting))))
        chosen = chosen[age[chosen] >= interval]
        if not len(chosen) or not (ks.any() or self.steps_since_drafting >= interval):
            return ks, [], wait
        probed = ks.copy()
        probed[chosen] = 1
        return probed, chosen.tolist(), wait

    # -- learning --------------------------------------------------------------------------

    def observe(self, plan, result, step_time, catch_up_time=None):
        decision = plan.choice
        reqs = plan.requests
        decoding = [i for i, r in enumerate(reqs) if decision is not None and r in decision.requested]
        if not decoding:  # a step without decodes learns nothing
            return
        requested = decision.requested
        accepted = result.accept_lens.tolist()
        drafting = [i for i, r in enumerate(reqs) if requested.get(r, 0) > 0]
        if drafting:
            # A draft the proposer could not make counts as rejected: asking for it bought nothing.
            rows = self.acceptance.rows([reqs[i] for i in drafting])
            drafted = np.array([requested[reqs[i]] for i in drafting])
            if result.paths is None:
                self.acceptance.update(rows, drafted, np.array([accepted[i] - 1 for i in drafting]))
            else:
                self.acceptance.update_nodes(rows, drafted, nodes_hit(result.paths[drafting].numpy(),
                                                                      self.acceptance.max_draft_len))
        ks = [plan.draft_lens[i] for i in decoding]
        prefill = sum(plan.num_new_tokens) - len(decoding)
        context = sum(reqs[i].num_computed + 1 for i in decoding)
        predicted = self.cost.observe(len(decoding), sum(ks), max(ks), sum(k > 0 for k in ks), context,
                                      step_time, prefill, decision.catch_up)
        self.predicted, self.observed = predicted, step_time
        if self.log:
            decision.log.update(policy=self.name, prefill=prefill, predicted_s=predicted,
                                **step_line(plan, result, step_time, catch_up_time))
            self.log.write(json.dumps(decision.log) + "\n")

    def stats(self) -> dict:
        return {
            "name": self.name,
            "cost_model": self.cost.source,
            "token_s": self.cost.token_cost(),
            "prompt_fixed_s": self.cost.prompt_fixed.tolist(),  # per longest draft K
            "catch_up_s": {"fixed": self.cost.catch_up_fixed, "per_token": self.cost.catch_up_token,
                           "scale": float(self.cost.catch_up_scale[0])},
            "num_decisions": self.num_decisions,
            "num_held": self.num_held,
            "num_explored": self.num_explored,
            "num_probes": self.num_probes,
            "num_reused": self.num_reused,
            "step_time": {"predicted_s": self.predicted, "observed_s": self.observed,
                          "mean_abs_rel_error": self.cost.error, "num_observed": self.cost.num_observed},
            "acceptance_per_position": self.acceptance.server().tolist(),
            "loop_output_len": float(self._mean_output()) if self.outputs[1] else None,
        }


@dataclass(frozen=True)
class _Room:
    """What a step's drafts may take: `drafts` tokens of its budget and `slots` of KV, a
    request drafting K keeping per_k[K] slots (a tree's growth keeps more than K)."""

    drafts: int
    slots: float
    per_k: np.ndarray

    @property
    def open(self) -> bool:
        """Room for one draft (a K of 1 keeps one slot)."""
        return self.drafts >= 1 and self.slots >= 1

    def fits(self, ks) -> bool:
        return int(ks.sum()) <= self.drafts and self.per_k[ks].sum() <= self.slots

    def left(self, ks) -> int:
        """Drafts of one token (one slot each) that still fit beside `ks`."""
        return int(min(self.drafts - int(ks.sum()), self.slots - self.per_k[ks].sum()))

    def within(self, other: _Room) -> bool:
        return self.drafts <= other.drafts and self.slots <= other.slots


@dataclass
class _Pick:
    """What a goodput decision picked before probes, and how (for its log line)."""

    ks: np.ndarray
    decided: np.ndarray  # what hysteresis holds on to: ks, unless ks is a width explored
    rate: float = 0.0  # expected tokens per second of ks
    plain_rate: float = 0.0  # of K = 0 for everyone
    best_drafting: dict | None = None
    held: bool = False
    explored: bool = False


class _Prices:
    """One goodput decision's prices: every candidate is priced against the same step (the
    decodes' context, the budget their drafts share with prompt tokens, the plain step's
    price) and the same acceptance estimates, so they are worked out once."""

    def __init__(self, policy: Goodput, requests, rows, limit, room: int, demand: int):
        self.cost, self.draft_premium = policy.cost, policy.draft_premium
        self.b, self.demand = len(requests), demand
        length, prompt, missed, most = np.array([(len(r.token_ids), r.num_prompt_tokens, r.num_computed - r.num_absorbed,
                                                  r.params.max_tokens) for r in requests]).T
        self.context = int(length.sum())
        left = most - (length - prompt)  # tokens the request may still produce
        self.backlog = np.maximum(missed - policy.acceptance.max_draft_len - 1, 0)  # past what a verify step leaves
        self.gain = _gains(policy.acceptance, rows, limit)
        self.plain_step = float(self.cost.step_time(self.b, 0, 0, 0, self.context))  # the decodes' plain step
        # What each request brings to the step if it drafts: itself, its catch-up, and the
        # share of that charged now, for its own token here and `per_token` for each draft's.
        if demand < room:
            self.per_token = self.backlog / np.maximum(left, 1)
            charged = self.per_token
        else:  # the batch is still growing: in full
            self.per_token, charged = np.zeros(self.b), self.backlog
        self.brings = np.stack([np.ones(self.b), self.backlog, charged], axis=1)

    def candidates(self, limit, cap: _Room):
        """Both families of candidates, within `cap`: their expected tokens, their step's shape
        (drafts, the longest, what the drafting requests bring, `per_token` of their catch-up
        charged per expected token on top) and ks_of(j), the K per request of the j-th."""
        gain, brings, per_token = self.gain, self.brings, self.per_token
        b, width = gain.shape
        # The n likeliest drafts: order by gain, position-major so that a tie keeps a
        # request's earlier position first (each request's drafts stay a prefix).
        flat = gain.T.ravel()
        order = np.argsort(-flat, kind="stable")[:min(cap.drafts, np.count_nonzero(flat))]
        # A request's draft at position p takes per_k[p + 1] - per_k[p] more KV slots.
        used = np.cumsum(np.diff(cap.per_k)[order // b])
        order = order[:np.searchsorted(used, cap.slots, side="right")]
        pos, row = order // b, order % b
        tokens = b + np.concatenate([[0.0], np.cumsum(flat[order])])
        longest = np.concatenate([[0], np.maximum.accumulate(pos + 1)])
        each = np.where((pos == 0)[:, None], brings[row], 0.0)
        each[:, 2] += per_token[row] * flat[order]
        drafting = np.concatenate([np.zeros((1, brings.shape[1])), np.cumsum(each, axis=0)])
        alike, (total, w, bring), same_k = self.uniform(limit, cap)

        def ks_of(j):
            return np.bincount(row[:j], minlength=b) if j <= len(order) else same_k[:, j - len(order) - 1]

        shapes = (np.concatenate([np.arange(len(order) + 1), total]), np.concatenate([longest, w]),
                  np.concatenate([drafting, bring]))
        return np.concatenate([tokens, alike]), shapes, ks_of

    def uniform(self, limit, cap: _Room):
        """The same K = w for every request that may draft it, w = 1 .. width, within `cap`:
        expected tokens (-inf where it does not fit), step shapes, and K per request (a
        column per w)."""
        gain, brings, per_token = self.gain, self.brings, self.per_token
        b, width = gain.shape
        w = np.arange(1, width + 1)
        ks = np.minimum(limit[:, None], w)
        total = ks.sum(axis=0)
        made = np.cumsum(gain, axis=1)  # expected tokens beyond the first at K = 1 .. width
        fits = (total <= cap.drafts) & (cap.per_k[ks].sum(axis=0) <= cap.slots)
        alike = np.where(fits, b + made.sum(axis=0), -np.inf)
        bring = np.tile(brings[limit > 0].sum(axis=0), (width, 1))
        bring[:, 2] += per_token[limit > 0] @ made[limit > 0]
        return alike, (total, w, bring), ks

    def shape(self, ks):
        """Expected tokens and step shape of one K per request."""
        made = (self.gain * (np.arange(self.gain.shape[1]) < ks[:, None])).sum(axis=1)
        bring = self.brings[ks > 0].sum(axis=0)
        bring[2] += self.per_token[ks > 0] @ made[ks > 0]
        return float(len(ks) + made.sum()), int(ks.sum()), int(ks.max()), bring

    def parts(self, n, longest, drafting, prompt=0):
        """A candidate's seconds in parts: its step with the `prompt` tokens that want the
        budget (a draft that takes a prompt token's place pushes it to a later step, which it
        costs as much as it would here); the tax on its drafts; and the share of its catch-up
        charged now."""
        count, catch_up, charged = drafting[..., 0], drafting[..., 1], drafting[..., 2]
        step = self.cost.step_time(self.b, n, longest, count, self.context, prompt)
        # The drafts' own time (none where online corrections left a wider cell cheaper),
        # taxed by `draft_premium`, and at least by what the cost model misses of a plain
        # step: a draft must win by more than the prices' own error.
        plain = self.cost.step_time(self.b, 0, 0, 0, self.context, prompt) if prompt else self.plain_step
        drafts = np.maximum(step - plain, 0.0)
        tax = np.where(n > 0, np.maximum(self.draft_premium * drafts, self.cost.error * self.plain_step), 0.0)
        return step, tax, self.cost.catch_up_time(catch_up) * charged / np.maximum(catch_up, 1)

    def seconds(self, n, longest, drafting, prompt=0):
        return sum(self.parts(n, longest, drafting, prompt))

    def score(self, tokens, shape, alone, best):
        """Tokens beyond what the `best` rate would buy in the candidate's seconds with the
        prefill (Dinkelbach): without prefill the best rate scores 0 and wins; with it, a
        draft pays where it buys tokens cheaper than that rate."""
        return tokens - best * (self.seconds(*shape, self.demand) if self.demand else alone)

    def best_drafting(self, tokens, shapes, rates, ks_of, limit) -> dict:
        """The best candidate that drafts, priced in parts: for the log, to explain a K = 0."""
        d = 1 + int(np.argmax(rates[1:]))
        n, longest, drafting = shapes
        step, tax, charge = (float(x) for x in self.parts(n[d], longest[d], drafting[d]))
        return {"tokens_per_s": float(rates[d]), "k": ks_of(d).tolist(), "tokens": float(tokens[d]),
                "step_s": step, "tax_s": tax, "catch_up_s": charge, "plain_s": float(self.plain_step),
                "acceptance_1": float(self.gain[limit > 0, 0].mean())}

    def lifted(self, acceptance: AcceptanceModel, rows, limit, lift: float) -> _Prices:
        """These prices with the typical request's acceptance at position 1 `lift` higher."""
        prices = copy.copy(self)
        prices.gain = _gains(acceptance, rows, limit, lift)
        return prices

    def stake(self, limit, cap: _Room) -> float:
        """How much more a second the best uniform K makes than K = 0 for everyone, as a share
        of it: what a server-wide rise in acceptance would buy (the likeliest drafts' family,
        which sorts every draft of the batch, is left out: it would double a decision's cost)."""
        tokens, shape, _ = self.uniform(limit, cap)
        return max(float((tokens / self.seconds(*shape)).max()) * self.plain_step / self.b - 1, 0.0)

    def worth(self, ks):
        """For each row of ks (K per request): seconds of the step (probes come only where no
        prompt wants the step), catch-up in full and taxed by the prices' error as drafts
        are, and its expected tokens."""
        n = ks.sum(axis=1)
        seconds = self.cost.step_time(self.b, n, ks.max(axis=1), np.count_nonzero(ks, axis=1), self.context,
                                      catch_up=(ks > 0) @ self.backlog)
        drafted = np.arange(self.gain.shape[1]) < ks[:, :, None]
        return (seconds + np.where(n > 0, self.cost.error * self.plain_step, 0.0),
                self.b + (self.gain * drafted).sum(axis=(1, 2)))


def _gains(acceptance: AcceptanceModel, rows, limit, lift: float = 0.0) -> np.ndarray:
    """Each request's expected tokens per further draft (`AcceptanceModel.gains`), none past
    its limit."""
    gain = acceptance.gains(rows, limit.max(), lift)
    gain[np.arange(gain.shape[1]) >= limit[:, None]] = 0.0
    return gain


def nodes_hit(paths: np.ndarray, num_nodes: int) -> np.ndarray:
    """[rows, num_nodes] bool: whether each row's (m + 1)-th best node, query index m + 1, is
    on its accepted path (`StepResult.paths`)."""
    hits = np.zeros((len(paths), num_nodes + 1), dtype=bool)
    hits[np.arange(len(paths))[:, None], paths] = True
    return hits[:, 1:]


def make_policy(spec: SpecConfig, *, demand=None, queued=None, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 2048, cost_model: CostModel | None = None) -> SpecPolicy:
    """The policy `spec` names. Goodput prices steps with `cost_model` (measured at start-up,
    `tidal.profiling`), or learns the prices from the steps alone when none is given."""
    k = spec.max_draft_len
    if spec.policy == "off":
        policy = Off()
    elif spec.policy == "fixed":
        policy = Fixed(k)
    elif spec.policy == "table":
        policy = Table(spec.table)
    else:
        policy = Goodput(cost_model or CostModel(*grid_axes(max_num_seqs, k), source="online",
                                                 draft_passes=[spec.draft_depth(n) for n in range(k + 1)]), k,
                         token_budget=max_num_batched_tokens, demand=demand, queued=queued,
                         draft_slots=[spec.draft_slots(n) for n in range(k + 1)])
        policy.acceptance.marginal = spec.topk > 1
    policy.log = open(spec.decision_log, "a", buffering=1) if spec.decision_log else None
    return policy
