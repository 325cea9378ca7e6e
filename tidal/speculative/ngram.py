"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens. No model, no state, deterministic (q is one-hot)."""

from __future__ import annotations

import torch

from tidal.batch import to_device
from tidal.step import Drafts, StepPlan


class NgramProposer:
    bytes_per_page = 0
    drafts_ahead = False  # it reads each request's tokens on the host

    def __init__(self, min_n: int, max_n: int, device: torch.device):
        self.min_n = min_n
        self.max_n = max_n
        self.device = device

    def allocate_cache(self) -> None:
        pass

    def warmup(self) -> None:
        pass

    def propose(self, plan: StepPlan, rows: list[int], ahead: None = None) -> Drafts:
        found = [[] for _ in plan.requests]
        for i in rows:
            found[i] = self.lookup(plan.requests[i].token_ids, plan.draft_lens[i])
        width = max(plan.draft_lens)
        tokens = to_device([f + [0] * (width - len(f)) for f in found], torch.int64, self.device)
        return Drafts(tokens, [len(f) for f in found])

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            # Latest earlier match first: recent context predicts best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []
