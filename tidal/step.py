"""The one contract between scheduler and runner, for plain and speculative steps alike.

A plain decode step is `draft_lens = 0`, `W = 1`, `accept_lens = 1`; a prefill chunk that
does not reach the end of its prompt commits nothing (`accept_lens = 0`). The scheduler
commits every row the same way: `token_ids[i, :accept_lens[i]]`; what was drafted is the
plan's `draft_lens`, and the drafts themselves reach the runner as `Drafts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tidal.request import Request

if TYPE_CHECKING:  # (tidal.speculative imports this module)
    from tidal.speculative.tree import Tree


@dataclass
class StepPlan:
    requests: list[Request]
    num_new_tokens: list[int]   # tokens of the request's own sequence fed this step (prefill chunk, or 1)
    draft_lens: list[int]       # K_i >= 0 draft tokens to verify after them (0 = plain)
    choice: object = None       # the policy's note on the choice of these K (Choice.note), for its observe

    def samples(self, i: int) -> bool:
        """Whether row i reaches the end of its known tokens, so the step produces tokens for it."""
        req = self.requests[i]
        return req.num_computed + self.num_new_tokens[i] == req.num_tokens

    @property
    def max_draft_len(self) -> int:
        return max(self.draft_lens, default=0)

    @property
    def samples_every_row(self) -> bool:
        """Every row reaches the end of its known tokens (a decode, or a prompt's last chunk):
        each commits 1 to 1 + K_i tokens, so the next step can be planned before this one's
        tokens are known."""
        return all(self.samples(i) for i in range(len(self.requests)))


@dataclass
class StepResult:
    token_ids: torch.Tensor     # [B, W] int64 on the host; row i valid up to accept_lens[i]
    accept_lens: torch.Tensor   # [B] int64 on the host: tokens to commit (0 for a partial prefill chunk)
    # Per row, one {token id: logprob} dict per position (None for rows that did not ask);
    # None when no request asked.
    logprobs: list[list[dict[int, float]] | None] | None = None
    # Trees of drafts: per row, the query index of the accepted node at each depth (0: the
    # root; `tree.accept_tree`); None for chains.
    paths: torch.Tensor | None = None


@dataclass
class Drafts:
    """What a proposer drafted for a plan's rows. The tokens stay on the device: the step
    that verifies them is queued behind the drafter without the host waiting for it."""

    tokens: torch.Tensor           # [B, Kmax] int64 on the runner's device; row i valid up to lens[i]
    lens: list[int]                # drafts per row of the plan (0 for a row that does not draft)
    catch_up: Span | None = None    # the drafter absorbing what it missed, where it had to
    tree: Tree | None = None        # trees: each node's parent [B, Kmax], with depths and ancestors; None: chains


class Span:
    """The time of the work queued on `device` from its making to `stop()`: between two CUDA
    events, or by the wall clock on a CPU, whose work runs as it is queued. It tells a step's
    parts apart (a drafter's catch-up from the rest of its step, in the decision log). Read
    `seconds` once the work is done."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.begun = time.perf_counter()

    def stop(self) -> Span:
        if self.events is not None:
            self.events[1].record()
        else:
            self.wall = time.perf_counter() - self.begun
        return self

    @property
    def seconds(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) / 1000 if self.events is not None else self.wall


@dataclass
class Ahead:
    """What a step planned while the one before was still in flight takes from that one,
    per row of its own plan. The host plans as if every draft there were accepted (so pages
    and positions are taken for the most a row can commit); the device knows how many were."""

    computed: list[int]      # tokens the step before computes for the row, if every draft is accepted
    commits: list[int]       # tokens it commits for the row, if every draft is accepted (1 + K)
    tokens: torch.Tensor     # [n, W] on the device: the tokens it commits, valid up to the accepted count
    last: torch.Tensor       # [n] on the device: the last of them, which the row feeds next
    rejected: torch.Tensor | None  # [n] on the device: commits less those really committed (None: no drafts)
    carried: int             # rows [0, carried) are the step before's; the rest are prompts admitted
                             # beside them, which take nothing from it (zeros above)
