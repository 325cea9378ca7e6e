"""A request's state while the engine serves it, and what the user gets back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tidal.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """What speculation did for one request (or, summed, for the server)."""

    num_steps: int = 0           # steps in which this request drafted (K >= 1)
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [m] = drafts accepted at position m
    drafted_per_position: list[int] = field(default_factory=list)   # [m] = drafts proposed at position m

    def record(self, draft_len: int, accepted: int) -> None:
        if draft_len == 0:
            return
        self.num_steps += 1
        self.num_drafted += draft_len
        self.num_accepted += accepted
        grow = draft_len - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for m in range(draft_len):
            self.drafted_per_position[m] += 1
            self.accepted_per_position[m] += m < accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per drafting step (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
        }


@dataclass
class CompletionOutput:
    index: int
    text: str                          # all text so far
    delta: str                         # the text this step added (what a stream sends)
    token_ids: list[int]
    finish_reason: str | None          # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled token first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, eos_token_ids: tuple[int, ...], stream: bool = False):
        self.request_id = request_id
        self.stream = stream                       # wants an output from every step, not just the last
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.token_ids = list(prompt_token_ids)   # prompt then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed = 0                      # leading tokens whose KV is in the cache
        self.num_absorbed = 0                      # leading tokens in the drafter's KV (<= num_computed)
        self.num_sent = 0                          # output tokens already in an EngineOutput
        self.pages: list[int] = []
        self.page_keys: list[int] = []             # prefix-cache key chain of the full pages
        self.num_cached_prompt_tokens = 0          # prompt tokens served by the prefix cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids.update(params.stop_token_ids)
        self.spec = SpecStats()
        self.simulated_acceptance: list[float] | None = None  # benchmarks only: rate per draft position
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, max_model_len: int) -> bool:
        """Commit one token; returns True when it ends the request."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if token in self.stop_ids:
            self.finish("stop", stop_reason=token if token in self.params.stop_token_ids else None)
            return True
        if len(self.token_ids) >= min(self.num_prompt_tokens + self.params.max_tokens, max_model_len):
            self.finish("length")
            return True
        return False

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
