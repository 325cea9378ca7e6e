"""Online acceptance estimates: the chance that draft position m of a request is accepted,
given that positions 1 .. m-1 were.

Each request keeps decayed counts per position (a request's text drifts, so old steps
weigh less), shrunk toward a server-wide estimate with Beta-style pseudo-counts: a new
request starts at what the server sees, and its own evidence takes over as it drafts. The
server-wide estimate of position m is itself shrunk toward that of position m-1, so a
position nobody has drafted yet is not a blind guess.

State lives in arrays with one row per live request, so the policy reads and updates a
whole batch with a few array operations.
"""

from __future__ import annotations

import numpy as np

from tidal.request import Request


class AcceptanceModel:
    def __init__(self, max_draft_len: int, initial: float = 0.5, strength: float = 4.0,
                 decay: float = 0.95, server_decay: float = 0.995):
        self.max_draft_len = max_draft_len
        self.initial = initial            # server estimate of position 1 before any evidence
        self.strength = strength          # pseudo-trials behind each prior
        self.decay = decay                # per drafting step of a request
        self.server_decay = server_decay  # per step with any drafting
        self.server_accepted = np.zeros(max_draft_len)
        self.server_tried = np.zeros(max_draft_len)
        self.accepted = np.zeros((0, max_draft_len))
        self.tried = np.zeros((0, max_draft_len))
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
        for req in [req for req in self.row if req.finished]:
            self.free.append(self.row.pop(req))

    def _new_row(self, req: Request) -> int:
        if not self.free:
            n = len(self.age)
            grow = max(n, 16)
            self.accepted = np.concatenate([self.accepted, np.zeros((grow, self.max_draft_len))])
            self.tried = np.concatenate([self.tried, np.zeros((grow, self.max_draft_len))])
            self.age = np.concatenate([self.age, np.zeros(grow, dtype=np.int64)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        r = self.row[req] = self.free.pop()
        self.accepted[r] = self.tried[r] = self.age[r] = 0
        return r

    def server(self) -> np.ndarray:
        """Server-wide conditional acceptance per position."""
        out = np.empty(self.max_draft_len)
        prior = self.initial
        for m in range(self.max_draft_len):
            prior = (self.server_accepted[m] + self.strength * prior) / (self.server_tried[m] + self.strength)
            out[m] = prior
        return out

    def estimates(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), max_draft_len] conditional acceptance per request and position."""
        prior = self.strength * self.server()
        return (self.accepted[rows] + prior) / (self.tried[rows] + self.strength)

    def update(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Row i drafted `drafted[i]` >= 1 tokens, of which the first `accepted[i]` were
        accepted: positions up to accepted[i] + 1 were tried, the first accepted[i] passed."""
        positions = np.arange(self.max_draft_len)
        passed = positions < accepted[:, None]
        tried = positions < np.minimum(accepted + 1, drafted)[:, None]
        self.accepted[rows] = self.accepted[rows] * self.decay + passed
        self.tried[rows] = self.tried[rows] * self.decay + tried
        self.age[rows] = 0
        self.server_accepted = self.server_accepted * self.server_decay + passed.sum(axis=0)
        self.server_tried = self.server_tried * self.server_decay + tried.sum(axis=0)
