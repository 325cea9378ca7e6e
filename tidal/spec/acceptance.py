"""Online acceptance estimates: the chance that draft position m of a request is accepted,
given that positions 1 .. m-1 were.

Each request keeps decayed counts per position (a request's text drifts, so old steps
weigh less), shrunk toward a server-wide estimate with Beta-style pseudo-counts: a new
request starts at what the server sees, and its own evidence takes over as it drafts.

The server-wide estimate is the acceptance of a typical request, the prior for one that
has not drafted yet. Requests vote, not trials: each request's rate counts with weight
n / (n + strength) for its n trials, the live requests' and those of the last `memory`
finished ones (fading per request that finishes). Pooled trials would let the few requests
that drafted most speak for everyone: two that drafted alone at one client, hundreds of
trials each, would outweigh a hundred requests probed once each at the load that
followed, where nobody drafts but the probes. Position m is shrunk toward position m-1,
the server's toward the server's and a request's toward its own (`estimates`), so a
position nobody has drafted yet is not a blind guess.

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
        # Finished requests' votes: accepted / (n + strength) and n / (n + strength) per position.
        self.past_accepted = np.zeros(max_draft_len)
        self.past_weight = np.zeros(max_draft_len)
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

    def release_finished(self) -> None:
        """Free finished requests' rows; their votes join the server's memory."""
        done = np.array([self.row.pop(req) for req in [req for req in self.row if req.finished]], dtype=np.int64)
        if not len(done):
            return
        accepted, weight = self._votes(done)
        fade = (1 - 1 / self.memory) ** len(done)
        self.past_accepted = self.past_accepted * fade + accepted
        self.past_weight = self.past_weight * fade + weight
        self.live[done] = False
        self.free.extend(done.tolist())

    def _votes(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' votes per position: rate times weight, and weight (n / (n + strength))."""
        denominator = self.tried[rows] + self.strength
        return (self.accepted[rows] / denominator).sum(axis=0), (self.tried[rows] / denominator).sum(axis=0)

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

    def server(self) -> np.ndarray:
        """Server-wide conditional acceptance per position: the typical request's."""
        accepted, weight = self._votes(np.flatnonzero(self.live))
        accepted, weight = accepted + self.past_accepted, weight + self.past_weight
        vote = 1 / (1 + self.strength)  # what the prior counts for: one trial's vote
        out = np.empty(self.max_draft_len)
        prior = self.initial
        for m in range(self.max_draft_len):
            prior = (accepted[m] + vote * prior) / (weight[m] + vote)
            out[m] = prior
        return out

    def estimates(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), max_draft_len] conditional acceptance per request and position.

        Position 1 is shrunk toward the server's. Position m is shrunk toward the request's
        own m-1, its odds moved as the typical request's move from m-1 to m: how well a
        request's drafts hold up depends on the request (its text, its sampling), and how
        they fall off with depth on the drafter."""
        server = np.clip(self.server(), 1e-3, 1 - 1e-3)
        odds_step = server[1:] / (1 - server[1:]) * (1 - server[:-1]) / server[:-1]
        out = np.empty((len(rows), self.max_draft_len))
        prior = server[0]
        for m in range(self.max_draft_len):
            if m:
                odds = out[:, m - 1] / (1 - out[:, m - 1]) * odds_step[m - 1]
                prior = odds / (1 + odds)
            out[:, m] = (self.accepted[rows, m] + self.strength * prior) / (self.tried[rows, m] + self.strength)
        return out

    def update(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Row i drafted `drafted[i]` >= 1 tokens, of which the first `accepted[i]` were
        accepted: positions up to accepted[i] + 1 were tried, the first accepted[i] passed."""
        positions = np.arange(self.max_draft_len)
        passed = positions < accepted[:, None]
        tried = positions < np.minimum(accepted + 1, drafted)[:, None]
        self.accepted[rows] = self.accepted[rows] * self.decay + passed
        self.tried[rows] = self.tried[rows] * self.decay + tried
        self.age[rows] = 0
