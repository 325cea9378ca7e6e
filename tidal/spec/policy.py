"""Speculation policies: how many tokens each decoding request drafts this step.

A policy sees the requests that are ready to decode (already admitted, with KV for all
but their last token) and the most each may draft (bounded by max_tokens, max_model_len
and the configured K). It returns one K_i per request; 0 means a plain decode for it.
"""

from __future__ import annotations

from typing import Protocol

from tidal.request import Request
from tidal.step import StepPlan, StepResult


class SpecPolicy(Protocol):
    name: str

    def choose(self, requests: list[Request], limits: list[int], num_waiting: int) -> list[int]:
        ...

    def observe(self, plan: StepPlan, result: StepResult, step_time: float) -> None:
        """What the step cost (seconds, proposer included) and what it accepted."""
        ...


class NoFeedback:
    def observe(self, plan, result, step_time):
        pass


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


def make_policy(name: str, k: int) -> SpecPolicy:
    if name == "off":
        return Off()
    if name == "fixed":
        return Fixed(k)
    raise NotImplementedError(f"speculative_config.policy {name!r} is not implemented yet")
