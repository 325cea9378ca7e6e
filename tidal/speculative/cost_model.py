"""What a step costs, in seconds, as a function of the K chosen for it.

    step_time = target(B, width) + context_cost * (context - B * context_ref) + proposer(B_d, K_max)
                + catch_up(tokens)

- target: a grid over batch size B and width (query tokens per request), measured at
  start-up on the real device and interpolated. Without CUDA graphs the width is the
  mean, 1 + sum(K) / B; with graphs every row is padded to the widest, 1 + max(K). When
  prompt tokens share the step (T tokens in all), it costs

      max(target, token_price * T) + prompt_fixed[K]

  at least what its tokens cost in a compute-bound step (the decode grid alone would price
  2,000 prompt tokens as nothing), and on top a fixed cost per longest draft K (a longer
  host launch, hidden only where a step in flight runs before it; a K not yet seen beside
  a prompt costs what the longest shorter one seen does).
- context: attention reads every token of every request's context; `context_ref` is the
  context per request the grid was measured at.
- proposer: a fixed cost plus one per draft step (draft models run one forward per
  position), over the B_d requests that draft.
- catch-up: a drafter with a cache of its own absorbs, before drafting, the tokens it
  missed (K = 0 steps, or a whole prompt). Up to K + 1 per request is part of every
  proposal; beyond that it runs a longer pass (a fixed cost) over the extra tokens (a cost
  per token). After 100 steps at K = 0, 250 requests resuming drafting absorb 25,000
  tokens: several plain steps' worth.

Each observed decode step corrects the prediction toward what the step really took, in
two parts: first a level per batch size, shared by every width (the engine's own
overheads, a busier machine: these move all shapes alike), then what is left over to the
grid cells around the step's shape (what the profile got wrong about that shape). Plain
steps set the level; drafting steps set a second one, their overheads beyond it (the
proposer's host work, which a busy host may not hide behind the step before). K = 0's
price thus stays what plain steps are seen to take however long the policy drafts; were
a few slow drafting steps to raise it, K = 0 would look dear and, never tried again, stay
so. Each is a running mean at first, then an exponential average; the level's faster than
the cells', and one step moves a cell by at most a fifth of its prediction. A spell of
slow steps (a pause, another tenant) thus raises every width's price, not just that of
the width it ran at, which would otherwise look dear once the spell is over and, no
longer chosen, never be seen at its true price again. A lone step far slower than the
model usually misses by is a pause, not a price: it counts as a few typical misses.
A cell's observations weigh less with every decode step, not with each of its own: a
width run only now and then (explored, beside the one chosen) takes the price it was last
seen at, where an average over its own sightings would keep most of a profile's figure for
hundreds of steps and hold a width priced too dear out of the choice. For the same reason
every width of a chain up to K = 4 is a grid point: steps at a width between two points
would move both neighbours with their own error.
With no profile the grid starts at zero and is learned the same way: an unseen width looks
as cheap as the plain step, so the policy tries it once and from then on knows its price.
A step that carries prompt tokens corrects only the prompt terms, all of them at once (a
Kalman filter, `LinearFit`): its error moves the terms its price is made of (the fixed
cost of its K, and the price of the branch of the max that set it) in proportion to how
uncertain each is, so that steps of many sizes tell the fixed cost from the price per
token. A term no step has used for a while regains its uncertainty and is soon relearned
once used; the price of its drafter's catch-up, if any, is taken as it stands: at load
nearly every step with prompt tokens carries one (a request that has just finished its
prompt), and were such steps to teach the catch-up, none would teach the prompt terms. A
decode step whose drafter catches up corrects only the price of catching up (a scale on the
profiled one).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

PROFILE_WIDTHS = (1, 2, 3, 4, 5, 9, 17)


def bracket(x: float, points: np.ndarray) -> tuple[int, int, float]:
    """Neighbouring grid indices of x and the weight of the upper one (clamped at the ends)."""
    hi = int(np.searchsorted(points, x))
    if hi == 0:
        return 0, 0, 0.0
    if hi == len(points):
        return hi - 1, hi - 1, 0.0
    lo = hi - 1
    return lo, hi, float((x - points[lo]) / (points[hi] - points[lo]))


class CostModel:
    def __init__(self, batch_sizes, widths, grid=None, *, padded: bool = False, context_ref: float = 0.0,
                 context_cost: float = 0.0, draft_fixed=None, draft_step=None, catch_up_fixed: float = 0.0,
                 catch_up_token: float = 0.0, draft_passes=None, correct_online: bool = True, rate: float = 0.05,
                 level_rate: float = 0.25, cell_step: float = 0.2, source: str = "given"):
        self.batch_sizes = np.asarray(batch_sizes, dtype=float)
        self.widths = np.asarray(widths, dtype=float)
        shape = (len(self.batch_sizes), len(self.widths))
        self.grid = np.zeros(shape) if grid is None else np.array(grid, dtype=float)
        # Observations behind each cell, fading by `rate` a decode step; a measured cell counts as one.
        self.weight = np.zeros(shape) if grid is None else np.ones(shape)
        self.known = np.full(shape, grid is not None)  # profiled, or observed since
        # Corrections per batch size, learned from plain steps [0] (every step pays it) and from
        # drafting steps [1] (what they take beyond that), and their observations.
        self.level = np.zeros((2, shape[0]))
        self.level_weight = np.zeros((2, shape[0]))
        # The prompt terms (in the module docstring), as one fit: prompt_fixed per longest
        # draft K (0 .. the widest width - 1), then the price of a thousand tokens of a
        # compute-bound step, at first the largest shape's. Each is as uncertain as a step is long.
        self.num_ks = int(self.widths[-1])
        price = 1e3 * self.grid[-1, -1] / (self.batch_sizes[-1] * self.widths[-1])
        self.prompt = LinearFit(np.append(np.zeros(self.num_ks), price), std=max(float(self.grid.max()), 0.01))
        self.prompt_seen = np.zeros(self.num_ks, dtype=bool)  # a K's fixed cost learned from a step of its own
        self.padded = padded
        self.context_ref = context_ref
        self.context_cost = context_cost
        zeros = np.zeros(len(self.batch_sizes))
        self.draft_fixed = zeros if draft_fixed is None else np.asarray(draft_fixed, dtype=float)
        self.draft_step = zeros if draft_step is None else np.asarray(draft_step, dtype=float)
        # Drafter passes of a request drafting K, per K (`SpecConfig.draft_depth`; None: K,
        # a chain's): a tree's drafting is priced by its depth, its verification by its nodes.
        self.draft_passes = None if draft_passes is None else np.asarray(draft_passes, dtype=float)
        self.catch_up_fixed = catch_up_fixed
        self.catch_up_token = catch_up_token
        self.catch_up_scale = np.ones(1)  # observed / profiled catch-up time
        self.catch_up_weight = np.ones(1)
        self.correct_online = correct_online
        self.error = 0.0        # mean absolute relative error of the decode steps' predictions (exponential average)
        self.num_decodes = 0    # decode steps observed
        self.num_observed = 0
        self.rate = rate              # how fast the grid's cells follow what is left after the level
        self.cell_step = cell_step    # the most one step's error moves a cell, as a share of the prediction
        self.level_rate = level_rate  # how fast the level follows the errors: faster, so that a spell
                                      # of slow steps moves every shape and not the one it was seen at
        self.pause_misses = 4.0       # a step slower than predicted by more than this many typical misses is a pause
        self.source = source

    def to_dict(self) -> dict:
        """The measured model as constructor arguments (before online corrections)."""
        return {"batch_sizes": self.batch_sizes.tolist(), "widths": self.widths.tolist(), "grid": self.grid.tolist(),
                "padded": self.padded, "context_ref": self.context_ref, "context_cost": self.context_cost,
                "draft_fixed": self.draft_fixed.tolist(), "draft_step": self.draft_step.tolist(),
                "draft_passes": None if self.draft_passes is None else self.draft_passes.tolist(),
                "catch_up_fixed": self.catch_up_fixed, "catch_up_token": self.catch_up_token, "source": self.source}

    @classmethod
    def from_function(cls, fn: Callable[[int, int], float], batch_sizes, widths, **kwargs) -> "CostModel":
        """A grid filled from fn(batch size, width) seconds (tests, simulations)."""
        grid = [[fn(b, w) for w in widths] for b in batch_sizes]
        return cls(batch_sizes, widths, grid, **kwargs)

    def _width(self, batch, num_drafts, max_draft):
        return 1 + max_draft if self.padded else 1 + num_drafts / batch

    def _target(self, batch, num_drafts, max_draft):
        """The target's forward for a decode step of this shape: the grid, the level of every
        step and, for a drafting step, the drafting steps' level on top."""
        lo, hi, f = bracket(batch, self.batch_sizes)
        row = (1 - f) * self.grid[lo] + f * self.grid[hi]
        level = (1 - f) * self.level[:, lo] + f * self.level[:, hi]
        return (np.interp(self._width(batch, num_drafts, max_draft), self.widths, row)
                + level[0] + np.where(np.asarray(num_drafts) > 0, level[1], 0.0))

    def step_time(self, batch: int, num_drafts, max_draft, num_drafting, context: float, prefill=0, catch_up=0):
        """Seconds for a step of `batch` decoding requests with `num_drafts` drafts in all, the
        longest `max_draft`, drafted by `num_drafting` requests whose drafter has `catch_up`
        tokens to absorb beyond K + 1 per request; `context` is the sum of the decoding
        requests' lengths before this step, and `prefill` prompt tokens share the step. Array
        arguments give one time per candidate."""
        num_drafts = np.asarray(num_drafts, dtype=float)
        max_draft = np.asarray(max_draft, dtype=float)
        prefill = np.asarray(prefill, dtype=float)
        target = self._target(batch, num_drafts, max_draft)
        if prefill.any():
            target = np.where(prefill > 0, np.maximum(target, self.token_cost() * (batch + num_drafts + prefill))
                              + self.prompt_fixed_of(max_draft), target)
        attention = self.context_cost * (context + num_drafts - batch * self.context_ref)
        passes = max_draft if self.draft_passes is None else \
            self.draft_passes[np.clip(max_draft.astype(int), 0, len(self.draft_passes) - 1)]
        drafting = (np.interp(num_drafting, self.batch_sizes, self.draft_fixed)
                    + passes * np.interp(num_drafting, self.batch_sizes, self.draft_step))
        drafting = np.where(np.asarray(num_drafting) > 0, drafting, 0.0)
        return np.maximum(target + attention + drafting + self.catch_up_time(catch_up), 1e-6)

    def catch_up_time(self, tokens):
        """Seconds for the drafter to absorb `tokens` beyond K + 1 per request: a longer pass
        than the usual proposal (on the GPU an eager one, past the captured widths) and
        its tokens."""
        tokens = np.asarray(tokens, dtype=float)
        if not tokens.any():
            return 0.0
        return np.where(tokens > 0, self.catch_up_scale[0] * (self.catch_up_fixed + self.catch_up_token * tokens), 0.0)

    @property
    def prompt_fixed(self) -> np.ndarray:
        """What a step with prompt tokens costs on top, per longest draft K, as learned."""
        return self.prompt.mean[:self.num_ks]

    def prompt_fixed_of(self, max_draft):
        """prompt_fixed at each longest K; a K not yet seen beside a prompt costs what the
        longest shorter one seen does: priced at nothing, a lone draft would look like a way
        to save a prompt step's fixed cost."""
        seen = np.maximum.accumulate(np.where(self.prompt_seen, np.arange(self.num_ks), -1))
        fixed = np.where(seen >= 0, self.prompt_fixed[np.maximum(seen, 0)], 0.0)
        return fixed[np.minimum(max_draft, self.num_ks - 1).astype(int)]

    def token_cost(self) -> float:
        """Seconds per token of a compute-bound step."""
        return float(self.prompt.mean[-1]) / 1e3

    def observe(self, batch: int, num_drafts: int, max_draft: int, num_drafting: int, context: float,
                seconds: float, prefill: int = 0, catch_up: int = 0) -> float:
        """Correct the model by this step's prediction error; returns the prediction."""
        predicted = float(self.step_time(batch, num_drafts, max_draft, num_drafting, context, prefill, catch_up))
        if not self.correct_online:
            return predicted  # a model given as the truth (tests, simulations): it has no error
        self.num_observed += 1
        error = seconds - predicted
        if catch_up and not prefill:
            profiled = float(self.catch_up_time(catch_up)) / self.catch_up_scale[0]
            if profiled > 0:
                self._learn(self.catch_up_scale, self.catch_up_weight, ((0, 1.0),),
                            max(min(error, predicted) / profiled, -self.catch_up_scale[0]))
            return predicted
        if prefill:
            # The terms this step's price is made of: its K's fixed cost (from the price it
            # was given, if not yet seen) and, where its tokens' floor set the max, their
            # price. A term that set nothing would take the error and move no prediction, and
            # the error would stay.
            k = min(int(max_draft), self.num_ks - 1)
            if not self.prompt_seen[k]:
                self.prompt.mean[k] = self.prompt_fixed_of(k)
                self.prompt_seen[k] = True
            tokens = batch + num_drafts + prefill
            terms = np.zeros(len(self.prompt.mean))
            terms[k] = 1.0
            if self.token_cost() * tokens > float(self._target(batch, num_drafts, max_draft)):
                terms[-1] = tokens / 1e3
            self.prompt.update(terms, min(error, predicted), predicted)
            return predicted
        # The error is a decode step's only: what the policy weighs is how decode steps of one
        # K differ from those of another, and a step with prompts or a catch-up (whose time
        # swings with what arrived) says nothing about that.
        miss = abs(predicted - seconds) / seconds
        typical = self.error if self.num_decodes else 1.0
        self.error = miss if self.num_decodes == 0 else 0.95 * self.error + 0.05 * miss
        self.num_decodes += 1
        self.weight *= 1 - self.rate
        b0, b1, f = bracket(batch, self.batch_sizes)
        w0, w1, g = bracket(self._width(batch, num_drafts, max_draft), self.widths)
        kind = int(num_drafts > 0)
        measured = self.known[b0, w0] and self.known[b1, w1]
        if measured or (self.level_weight[kind, b0] > 0 and self.level_weight[kind, b1] > 0):
            # A step far slower than the model usually misses by is a pause (the host, the
            # machine), not the price of its shape: it counts as `pause_misses` typical
            # misses at most (or 10%, if more). Were it the drafting steps' price, K = 0 would
            # look cheaper from then on and, drafting no longer tried, stay so. A real change
            # is in every step; it raises the typical miss, and with it the bound.
            error = min(error, predicted * min(1.0, max(0.1, self.pause_misses * typical)))
        error -= self._learn(self.level, self.level_weight, (((kind, b0), 1 - f), ((kind, b1), f)), error,
                             self.level_rate)
        cells = (((b0, w0), (1 - f) * (1 - g)), ((b0, w1), (1 - f) * g), ((b1, w0), f * (1 - g)), ((b1, w1), f * g))
        if measured:
            error = float(np.clip(error, -self.cell_step * predicted, self.cell_step * predicted))
        self._learn(self.grid, self.weight, cells, error)
        for index, w in cells:
            self.known[index] |= w > 0
        return predicted

    def _learn(self, values, weights, targets, error, rate=None) -> float:
        """Move the interpolated targets toward `error`; returns how far the prediction moved."""
        moved = 0.0
        for index, w in targets:
            if w > 0:
                weights[index] += w
                step = w * max(1 / weights[index], self.rate if rate is None else rate)
                values[index] += step * error
                moved += w * step * error
        return moved


class LinearFit:
    """A linear model's coefficients, followed by a Kalman filter: an observation moves each
    coefficient it involves in proportion to how uncertain it is, so that observations of
    many shapes tell the coefficients apart. A coefficient no observation involves drifts
    back toward its prior uncertainty (a random walk, never past the prior), so that one
    not used for a while is soon relearned."""

    def __init__(self, mean, std: float, noise: float = 0.05, drift: float = 0.02):
        self.mean = np.array(mean, dtype=float)
        self.prior = np.full(len(self.mean), float(std) ** 2)
        self.cov = np.diag(self.prior)
        self.noise = noise  # an observation's spread, as a share of its prediction
        self.drift = drift * drift * self.prior  # the variance each coefficient regains an observation

    def update(self, terms: np.ndarray, error: float, predicted: float) -> None:
        """One observation `error` above `predicted`, whose prediction is terms @ mean + a known part."""
        spread = self.cov @ terms
        gain = spread / (terms @ spread + (self.noise * predicted) ** 2)
        self.mean += gain * error
        self.cov -= np.outer(gain, spread)
        variance = np.diag(self.cov)
        self.cov[np.diag_indices_from(self.cov)] += np.where(variance < self.prior, self.drift, 0.0)


# -- the grid a start-up profile measures (`tidal.profiling`) --------------------------------

def grid_axes(max_batch: int, max_draft_len: int) -> tuple[list[int], list[int]]:
    """Batch sizes 1, 2, 4 .. max_batch; widths 1, 2, 3, 4, 5, 9, 17 up to 1 + max_draft_len."""
    batch_sizes = sorted({min(2 ** i, max_batch) for i in range(max_batch.bit_length() + 1)})
    widths = sorted({w for w in PROFILE_WIDTHS if w <= max_draft_len} | {1, max_draft_len + 1})
    return batch_sizes, widths


def fill_by_tokens(table: np.ndarray, rows: list[int], cols: list[int], rows_add: bool = False) -> np.ndarray:
    """Give each unmeasured cell the least of the upper bounds the measured cells put on it.
    Any cell it contains, scaled up by tokens: a step costs at most in proportion to its
    tokens (its weights are read once however many there are). With `rows_add` (the target's
    forward, which pays for its tokens, each row adding only its context's reads), also any
    cell of as many rows or more, scaled up by tokens where it has fewer: a wide step at a
    large batch that the profile's budget cut is priced by the narrower steps of more rows
    measured before it, not by its own narrower steps scaled as if compute-bound."""
    measured = np.isfinite(table)
    filled = table.copy()
    for i, j in zip(*np.nonzero(~measured)):
        tokens = rows[i] * cols[j]
        filled[i, j] = min(table[a, c] * max(1.0, tokens / (rows[a] * cols[c]))
                           for a, c in zip(*np.nonzero(measured))
                           if (a <= i and c <= j) or (rows_add and a >= i))
    return filled


def monotone(table: np.ndarray) -> np.ndarray:
    """No shape costs more than a larger one: timing noise only ever adds time."""
    table = np.minimum.accumulate(table[::-1], axis=0)[::-1]
    return np.minimum.accumulate(table[:, ::-1], axis=1)[:, ::-1]
