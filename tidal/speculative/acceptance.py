"""Online acceptance estimates: the chance that draft position m of a request is accepted,
given that positions 1 .. m-1 were; for trees of drafts, the chance that a request's m-th
best node is on the accepted path (`update_nodes`, `marginal`).

Each request keeps decayed counts per position (a request's text drifts, so old steps
weigh less), shrunk toward a server-wide estimate with Beta-style pseudo-counts: a new
request starts at what the server sees, and its own evidence takes over as it drafts.

The server-wide estimate is the acceptance of a typical request, the prior for one that
has not drafted yet. Requests vote, not trials: each request's rate counts with weight
n / (n + strength) for its n trials, the live requests' and those of the last `memory`
finished ones (fading per request that finishes). Pooled trials would let the few requests
that drafted most speak for everyone: two that drafted alone at one client, hundreds of
trials each, would outweigh a hundred requests probed once each at the load that
followed, where nobody drafts but the probes. A request's position m is shrunk toward its
own position m-1, scaled by how the drafter's acceptance falls with depth (`_walk`), so a
position it has not drafted yet is not a blind guess.

State lives in arrays with one row per live request, so the policy reads and updates a
whole batch with a few array operations.
"""

from __future__ import annotations

import numpy as np

from tidal.request import Request


class AcceptanceModel:
    def __init__(self, max_draft_len: int, initial: float = 0.5, strength: float = 4.0,
                 decay: float = 0.95, memory: int = 64):
        self.max_draft_len = max_draft_len
        self.initial = initial    # server estimate of position 1 before any evidence, worth one trial's vote
        self.strength = strength  # pseudo-trials behind a request's prior
        self.decay = decay        # per drafting step of a request
        self.memory = memory      # finished requests the server estimate remembers (fading)
        # Trees: position m is the m-th best node, and its estimate the chance that it is
        # accepted at all (a node's chance does not wait on the node before it).
        self.marginal = False
        # Finished requests' `_votes`, and their accepts per position with those their own
        # estimate one position back gave (`_walk`), fading per request that finishes.
        self.past_votes = np.zeros(2)
        self.past_trials = 0.0  # their trials at position 1 (`doubt`)
        self.past_depth = np.zeros((2, max_draft_len))
        self.accepted = np.zeros((0, max_draft_len))
        self.tried = np.zeros((0, max_draft_len))
        self.live = np.zeros(0, dtype=bool)
        self.age = np.zeros(0, dtype=np.int64)  # steps since the row's estimate last changed
        self.row: dict[Request, int] = {}
        self.free: list[int] = []

    def rows(self, requests: list[Request]) -> np.ndarray:
        """Row per request; a new request gets a fresh row (all prior)."""
        rows = [self.row.get(req) for req in requests]
        if None in rows:
            rows = [self.row[req] if req in self.row else self._new_row(req) for req in requests]
        return np.array(rows, dtype=np.int64)

    def release_finished(self) -> list[Request]:
        """Free finished requests' rows; their votes and depth counts join the server's memory.
        Returns those requests."""
        finished = [req for req in self.row if req.finished]
        done = np.array([self.row.pop(req) for req in finished], dtype=np.int64)
        if not len(done):
            return finished
        live = np.flatnonzero(self.live)
        out, _ = self._walk(live)
        previous = out[np.searchsorted(live, done)][:, :-1]  # their estimates one position back
        fade = (1 - 1 / self.memory) ** len(done)
        self.past_votes = self.past_votes * fade + self._votes(done)
        self.past_trials = self.past_trials * fade + float(self.tried[done, 0].sum())
        self.past_depth *= fade
        self.past_depth[0, 1:] += self.accepted[done, 1:].sum(axis=0)
        self.past_depth[1, 1:] += (self.tried[done, 1:] * previous).sum(axis=0)
        self.live[done] = False
        self.free.extend(done.tolist())
        return finished

    def _votes(self, rows: np.ndarray) -> tuple[float, float]:
        """The rows' votes at position 1: rate times weight, and weight (n / (n + strength))."""
        denominator = self.tried[rows, 0] + self.strength
        return float((self.accepted[rows, 0] / denominator).sum()), float((self.tried[rows, 0] / denominator).sum())

    def _new_row(self, req: Request) -> int:
        if not self.free:
            n = len(self.age)
            grow = max(n, 16)
            self.accepted = np.concatenate([self.accepted, np.zeros((grow, self.max_draft_len))])
            self.tried = np.concatenate([self.tried, np.zeros((grow, self.max_draft_len))])
            self.age = np.concatenate([self.age, np.zeros(grow, dtype=np.int64)])
            self.live = np.concatenate([self.live, np.zeros(grow, dtype=bool)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        r = self.row[req] = self.free.pop()
        self.accepted[r] = self.tried[r] = self.age[r] = 0
        self.live[r] = True
        return r

    def doubt(self) -> float:
        """One standard error of the typical request's acceptance at position 1, from the
        trials behind it (the live requests' and the remembered finished ones', as if they
        were one sample): how far the estimate may be off while evidence is thin (the first
        steps, or probes alone)."""
        live = np.flatnonzero(self.live)
        p = self._first(live)
        return float(np.sqrt(p * (1 - p) / (self.tried[live, 0].sum() + self.past_trials + 1)))

    def server(self) -> np.ndarray:
        """Server-wide conditional acceptance per position: the typical request's."""
        live = np.flatnonzero(self.live)
        _, depth = self._walk(live)
        return np.minimum(self._first(live) * np.cumprod(depth), 1 - 1e-3)

    def _first(self, live: np.ndarray) -> float:
        """The typical request's acceptance at position 1 (`live`: the live rows)."""
        accepted, weight = self._votes(live)
        vote = 1 / (1 + self.strength)  # what the initial guess counts for: one trial's vote
        return (accepted + self.past_votes[0] + vote * self.initial) / (weight + self.past_votes[1] + vote)

    def estimates(self, rows: np.ndarray, lift: float = 0.0) -> np.ndarray:
        """[len(rows), max_draft_len] conditional acceptance per request and position (the
        rows are live: `rows` made them so); `lift` raises the typical request's first."""
        live = np.flatnonzero(self.live)
        out, _ = self._walk(live, lift)
        return out[np.searchsorted(live, rows)]

    def _walk(self, live: np.ndarray, lift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Every live request's estimates, position by position, and the drafter's fall-off
        with depth (acceptance at m over acceptance at m-1; 1 at position 1).

        Position 1 is shrunk toward the typical request's. Position m is shrunk toward the
        request's own m-1 times the fall-off: how well a request's drafts hold up depends on
        the request (its text, its sampling), how they fall off with depth on the drafter.
        The fall-off compares each request with itself: the accepts seen at m over those its
        own estimate at m-1 gives on the same trials. Compared across requests, acceptance
        would rise with depth wherever requests differ, since only those that accept well
        reach deep positions often."""
        accepted, tried = self.accepted[live], self.tried[live]
        out = np.empty_like(accepted)
        depth = np.ones(self.max_draft_len)
        prior = min(self._first(live) + lift, 1 - 1e-3)
        for m in range(self.max_draft_len):
            if m:
                seen = accepted[:, m].sum() + self.past_depth[0, m]
                expected = (tried[:, m] * out[:, m - 1]).sum() + self.past_depth[1, m]
                depth[m] = (seen + self.strength) / (expected + self.strength)  # no fall-off, worth `strength` trials
                prior = np.minimum(out[:, m - 1] * depth[m], 1 - 1e-3)
            out[:, m] = (accepted[:, m] + self.strength * prior) / (tried[:, m] + self.strength)
        return out, depth

    def gains(self, rows: np.ndarray, limit: int, lift: float = 0.0) -> np.ndarray:
        """[len(rows), limit] expected tokens each further draft adds: a chain's m-th draft
        counts if every one before it is accepted, a tree's m-th node if it is."""
        estimates = self.estimates(rows, lift)[:, :limit]
        return estimates.copy() if self.marginal else np.cumprod(estimates, axis=1)

    def update_nodes(self, rows: np.ndarray, drafted: np.ndarray, hits: np.ndarray) -> None:
        """Trees: row i verified its best `drafted[i]` nodes, and hits[i, m] says whether its
        (m + 1)-th best was on the accepted path."""
        tried = np.arange(self.max_draft_len) < drafted[:, None]
        self.accepted[rows] = self.accepted[rows] * self.decay + (hits & tried)
        self.tried[rows] = self.tried[rows] * self.decay + tried
        self.age[rows] = 0

    def update(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Row i drafted `drafted[i]` >= 1 tokens, of which the first `accepted[i]` were
        accepted: positions up to accepted[i] + 1 were tried, the first accepted[i] passed."""
        positions = np.arange(self.max_draft_len)
        passed = positions < accepted[:, None]
        tried = positions < np.minimum(accepted + 1, drafted)[:, None]
        self.accepted[rows] = self.accepted[rows] * self.decay + passed
        self.tried[rows] = self.tried[rows] * self.decay + tried
        self.age[rows] = 0
