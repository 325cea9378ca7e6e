"""The engine's front: prompts in, text out, around an engine core that sees only token ids.

`InputProcessor` validates and tokenizes a prompt into a `Request`; `OutputProcessor` turns
the core's `EngineOutput`s (token ids committed since a request's last output) into
`RequestOutput`s: it detokenizes, finds stop strings (a request that reaches one is ended in
the core by the caller) and keeps each request's tokens. In `LLM` they run in the engine's
process; behind `tidal serve` in the API process, so that none of this host work delays
the core's steps.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

from tidal.config import SamplingParams, SimulatedAcceptance, SpecConfig
from tidal.request import CompletionOutput, Request, RequestOutput
from tidal.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | Sequence[int]
INT64_MAX = 2**63 - 1


class EngineOutput(NamedTuple):
    """What a step tells about one request: the tokens it committed since the request's
    last output (and their logprobs, if asked for), and once it has ended, why, with its
    metrics. (A tuple: it crosses from the core's process in every step's message.)"""

    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: dict | None = None  # at the end: prompt tokens, cache hits, preemptions, times, speculation


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, spec: SpecConfig | None,
                 seed: int, is_running: Callable[[str], bool] = lambda request_id: False):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.spec = spec
        self.seeds = random.Random(seed)
        self.ids = itertools.count()
        self.is_running = is_running

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     stream: bool = False, simulate_acceptance=None) -> Request:
        """Validate and tokenize; raises ValueError naming the problem. A streaming request
        gets an output from every step that commits its tokens; any other one only its
        final output (detokenizing every request every step is the largest host cost of a
        big batch). `simulate_acceptance` (benchmarks only, on an engine that simulates
        acceptance) replaces the engine's for this request, so one server can serve
        workloads of different acceptance. A seed is drawn for a request without one."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt: empty prompt")
        self.check_prompt_len(len(ids), exact=True)  # before reading every id of a list too long
        if text is None and not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} are more than "
                             f"max_model_len {self.max_model_len}")
        request_id = request_id if request_id is not None else str(next(self.ids))
        if self.is_running(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        simulated = self.spec.simulate_acceptance if self.spec else None
        if simulate_acceptance is not None:
            if simulated is None:
                raise ValueError("simulate_acceptance: this engine does not simulate acceptance (benchmarks start it "
                                 "with speculative_config.simulate_acceptance)")
            given = SimulatedAcceptance.parse(simulate_acceptance, "simulate_acceptance")
            # (a request that names no sibling factor keeps the server's)
            named = isinstance(simulate_acceptance, dict) and "sibling" in simulate_acceptance
            simulated = given if named else replace(given, sibling=simulated.sibling)
            simulated.check_tree(self.spec.topk, "simulate_acceptance")
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        req = Request(request_id, text, ids, params, seed, self.tokenizer.eos_token_ids, stream)
        if simulated is not None:
            req.simulated_acceptance = simulated.rates(seed, self.spec.num_speculative_tokens)
            if self.spec.topk > 1:  # (trees: the sibling factor rides last, `verify`)
                req.simulated_acceptance.append(simulated.sibling)
        return req

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids. A text that cannot be a prompt (a lone surrogate is no
        Unicode), or whose characters alone are more tokens than the context holds, is
        refused before the tokenizer spends time on it."""
        check_text(text, "prompt")
        self.check_prompt_len(len(text) // self.tokenizer.max_token_chars, exact=False)
        return self.tokenizer.encode(text)

    def check_prompt_len(self, num_tokens: int, exact: bool) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt: {num_tokens} tokens{'' if exact else ' or more'}, but max_model_len is "
                             f"{self.max_model_len} (the prompt and at least one generated token must fit)")


def check_text(text: str, name: str) -> None:
    """A ValueError naming `name` if `text` is not valid Unicode (JSON can carry a lone
    surrogate, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: invalid Unicode at character {e.start} ({text[e.start]!r}: a lone "
                         "surrogate)") from None


@dataclass
class _Output:
    """What the front keeps of a request it is serving."""

    request: Request
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    every_step: bool = False  # detokenized as its tokens come (streaming, or stop strings to find)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Output] = {}

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = _Output(
            req, req.token_ids[:req.num_prompt_tokens], IncrementalDetokenizer(self.tokenizer, req.token_ids, req.params.stop,
                                        req.params.include_stop_str_in_output),
            logprobs=[] if req.params.logprobs is not None else None,
            every_step=req.stream or bool(req.params.stop))

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """RequestOutputs for the core's outputs (streaming and stop-string requests at every
        step, the others when they end), and (request id, stop string) for each request whose
        text reached a stop string now: the caller ends it in the core, whose last output
        for it (with finish reason "stop" and the metrics) ends it here. Tokens the core
        committed past the stop string are not the request's."""
        results, stopped = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            detok, finished = state.detokenizer, out.finish_reason is not None
            delta = ""
            if not detok.stopped:
                state.token_ids += out.token_ids
                if state.logprobs is not None and out.logprobs:
                    state.logprobs += out.logprobs
                if state.every_step or finished:
                    delta = detok.add(out.token_ids)
                if detok.stopped and not finished:
                    stopped.append((out.request_id, detok.stop_str))
            if finished:
                delta += detok.flush()
                del self.requests[out.request_id]
            elif not state.every_step:
                continue
            results.append(RequestOutput(
                out.request_id, state.request.prompt, state.prompt_ids,
                [CompletionOutput(0, detok.released_text, delta, list(state.token_ids), out.finish_reason,
                                  out.stop_reason, state.logprobs)],
                finished, out.metrics or {}))
        return results, stopped
