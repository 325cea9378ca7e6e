"""The proposer protocol: a drafter plugged into the step, never a second path.

`propose` is called only in steps where some request has K_i > 0, and only for those
rows. It returns at most K_i tokens per row (fewer when it has nothing to say; the
scheduler's reservation is then partly unused and released at commit), and the drafter's
distributions [B, Kmax, V] if it sampled them, or None for a deterministic drafter.

A proposer with a KV cache of its own records in `request.num_absorbed` how many of the
request's tokens that cache holds, and catches up over the ones it missed (K = 0 steps)
when drafting resumes. The scheduler keeps `num_absorbed <= num_computed` (at commit, and
0 at preemption), so drafter KV for rejected tokens is never trusted.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tidal.step import StepPlan


class Proposer(Protocol):
    bytes_per_page: int  # KV bytes the proposer keeps per target page (0 if stateless)

    def allocate_cache(self) -> None:
        """Allocate its cache once the runner has sized the page pool."""
        ...

    def propose(self, plan: StepPlan, rows: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        ...
