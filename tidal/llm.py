"""The engine in one process: `LLMEngine` (prompts in, text out, around the engine core) and
the offline `LLM` API in vLLM's shape."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Sequence

from tqdm import tqdm

from tidal.config import EngineConfig, SamplingParams, SpecConfig
from tidal.engine import EngineCore, frozen_heap
from tidal.processing import EngineOutput, InputProcessor, OutputProcessor, Prompt
from tidal.request import Request, RequestOutput
from tidal.tokenizer import Tokenizer


class LLMEngine:
    """`InputProcessor` -> `EngineCore` -> `OutputProcessor`, stepped by the caller."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.outputs = OutputProcessor(self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.core.max_model_len, self.core.model_config.vocab_size,
                                     config.speculative_config, config.seed, self.outputs.requests.__contains__)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     stream: bool = False, simulate_acceptance=None) -> Request:
        return self.inputs.make_request(prompt, params, request_id, stream, simulate_acceptance)

    def add_request(self, req: Request) -> None:
        self.outputs.add(req)
        self.core.add_request(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.core.finish(request_id)
        return self._process([out])[0] if out is not None else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step of the core: an output for every request that finished, and for every
        streaming one that committed tokens."""
        return self._process(self.core.step())

    def _process(self, outputs: list[EngineOutput]) -> list[RequestOutput]:
        results, stopped = self.outputs.process(outputs)
        if stopped:  # ended by their text: the core ends them too, and their last outputs follow
            ends, _ = self.outputs.process([self.core.finish(rid, "stop", s) for rid, s in stopped])
            done = {out.request_id for out in ends}
            results = [out for out in results if out.request_id not in done] + ends
        return results

    def stats(self) -> dict:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class LLM:
    """Offline inference: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str, speculative_config: dict | SpecConfig | None = None, **kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"LLM: unknown arguments {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, speculative_config=speculative_config, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Validate every prompt before any is queued: a bad one leaves the engine untouched.
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for req in requests:
            self.engine.add_request(req)
        return self._run(requests, use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (their processes); nothing to do
        for an engine of one rank."""
        self.engine.shutdown()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        core = self.engine.core
        generated = core.num_generated_tokens
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm or len(requests) < 2)
        start = time.monotonic()
        with frozen_heap():
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                elapsed = max(time.monotonic() - start, 1e-9)
                bar.set_postfix(tok_s=f"{(core.num_generated_tokens - generated) / elapsed:.0f}", refresh=False)
        bar.close()
        return [done[r.request_id] for r in requests]
