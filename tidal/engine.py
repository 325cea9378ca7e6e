"""LLMEngine.step(): schedule -> propose -> run and verify -> commit -> outputs; and the
offline `LLM` API in vLLM's shape."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import random
import time
from dataclasses import fields
from typing import Sequence

from tqdm import tqdm

from tidal.config import EngineConfig, SamplingParams, SimulatedAcceptance, SpecConfig
from tidal.kv_cache import PagePool
from tidal.models.config import ModelConfig
from tidal.profiling import cached_costs, cost_key, measure_costs, plan_pages
from tidal.request import CompletionOutput, Request, RequestOutput, SpecStats
from tidal.runner import ModelRunner, PendingStep
from tidal.scheduler import Scheduler, pages_for
from tidal.spec import build_proposer
from tidal.spec.policy import make_policy
from tidal.step import StepPlan
from tidal.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | Sequence[int]

logger = logging.getLogger(__name__)


_frozen = 0  # serving loops under way (`frozen_heap`)


@contextlib.contextmanager
def frozen_heap():
    """While serving, keep the objects that already exist (the engine's, its libraries')
    out of the garbage collector's scans. A full collection walks every tracked object:
    ~450,000 after an 8B engine's start-up, 210 ms on the H200 host (run60); with a tiny
    model on a 2-core CPU, 148 ms, and 1.5 ms frozen mid-serving (`full_collection.py` in
    benchmarks/results/2026-12-01-cpu). It is a stall in whatever step it lands in. Everything thaws when the last loop ends, so an engine dropped afterwards is
    collected as usual (frozen objects never are)."""
    global _frozen
    if _frozen == 0:
        gc.freeze()
    _frozen += 1
    try:
        yield
    finally:
        _frozen -= 1
        if _frozen == 0:
            gc.unfreeze()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} is more than the model's context of {limit} "
                             "tokens (max_position_embeddings in its config.json)")
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        spec = config.speculative_config
        self.proposer = build_proposer(spec, self.runner, self.model_config) if spec else None
        self.runner.allocate_cache(config.num_pages or plan_pages(self.runner, self.proposer))
        if self.proposer:
            self.proposer.allocate_cache()
        capacity = self.runner.num_pages - 1  # page 0 is never handed out
        if pages_for(self.max_model_len + (spec.num_speculative_tokens if spec else 0), config.page_size) > capacity:
            raise ValueError(
                f"the KV cache has {capacity} pages of {config.page_size} tokens, fewer than one request of "
                f"max_model_len {self.max_model_len} needs; give it more memory (--gpu-memory-utilization on cuda, "
                "--kv-cache-memory-gb on cpu, or --num-pages) or lower --max-model-len")
        self.runner.capture_graphs()
        self.runner.warmup()
        if self.proposer:
            self.proposer.warmup()
        self.pool = PagePool(self.runner.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            max_draft_len=spec.num_speculative_tokens if spec else 0)
        if spec:
            costs = None
            if spec.policy == "goodput" and spec.cost_model == "profile":
                costs = cached_costs(cost_key(self.runner, self.proposer), lambda: measure_costs(
                    self.runner, self.proposer, config.max_num_seqs, spec.num_speculative_tokens, self.max_model_len,
                    spec.profile_seconds))
            self.scheduler.policy = make_policy(
                spec, pool=self.pool, demand=self.scheduler.prefill_demand, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, cost_model=costs)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.seeds = random.Random(config.seed)
        self.ids = itertools.count()
        self.in_flight: PendingStep | None = None  # a step queued on the device, not yet committed
        self.planned: StepPlan | None = None       # a drafting step planned ahead, to launch next
        self.last_ready: float | None = None       # when the last step's tokens came back (None: idle since)
        self.unobserved: tuple | None = None       # the last step, for the policy to learn from during the next
        self.num_steps = 0
        self.num_steps_ahead = 0                   # steps queued behind the one before (async scheduling)
        self.num_generated_tokens = 0
        logger.info(self.describe())

    def describe(self) -> str:
        """What was loaded, in one line (logged at start-up)."""
        c, spec = self.config, self.config.speculative_config
        speculation = "none" if spec is None else (
            f"{spec.method}{f' ({spec.model})' if spec.model else ''}, K <= {spec.num_speculative_tokens}, "
            f"policy {spec.policy}" + (f", SIMULATED acceptance {spec.simulate_acceptance.describe()}"
                                       if spec.simulate_acceptance is not None else ""))
        return (f"model {c.model} ({self.model_config.architecture}, {str(self.runner.dtype).removeprefix('torch.')}, "
                f"{self.runner.device}, {'eager' if self.runner.graphs is None else 'CUDA graphs'}); "
                f"KV cache {self.pool.capacity} pages of {c.page_size} tokens; max_model_len {self.max_model_len}; "
                f"max_num_seqs {c.max_num_seqs}; max_num_batched_tokens {c.max_num_batched_tokens}; "
                f"speculation: {speculation}")

    # -- requests ------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     stream: bool = False, simulate_acceptance=None) -> Request:
        """Validate and tokenize; raises ValueError naming the problem, touching no state.
        A streaming request gets an output from every step that commits its tokens; any
        other one only its final output (detokenizing every request every step is the
        largest host cost of a big batch). `simulate_acceptance` (benchmarks only, on an
        engine that simulates acceptance) replaces the engine's for this request, so one
        server can serve workloads of different acceptance."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt: empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(the prompt and at least one generated token must fit)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} are more than "
                             f"max_model_len {self.max_model_len}")
        request_id = request_id if request_id is not None else str(next(self.ids))
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        spec = self.config.speculative_config
        simulated = spec.simulate_acceptance if spec else None
        if simulate_acceptance is not None:
            if simulated is None:
                raise ValueError("simulate_acceptance: this engine does not simulate acceptance (benchmarks start it "
                                 "with speculative_config.simulate_acceptance)")
            simulated = SimulatedAcceptance.parse(simulate_acceptance, "simulate_acceptance")
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        req = Request(request_id, text, ids, params, seed, self.tokenizer.eos_token_ids, stream)
        if simulated is not None:
            req.simulated_acceptance = simulated.rates(seed, spec.num_speculative_tokens)
        return req

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.token_ids, req.params.stop, req.params.include_stop_str_in_output)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self._finish_output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward step. Returns an output (with the text delta) for every request
        that finished, and for every streaming one that committed tokens.

        Async scheduling: while a step whose rows all sample runs on the device (decodes,
        verifications, prompts' last chunks), the next step is planned, drafted for and
        queued behind it. Its rows feed the tokens this one commits, straight from the
        device; they are planned as if every draft were accepted and moved back on the
        device by those rejected (`Ahead`). The host then commits this step while the device
        runs the next one. A proposer that reads tokens on the host (n-gram) cannot draft
        ahead: its drafting steps wait for the tokens before them."""
        step = self.in_flight or self._launch(self._next_plan())
        self.in_flight = None
        if step is None:
            return []
        self._observe_last()  # while the device runs this step: learn from the last, plan the next
        ahead = None
        drafts_ahead = self.proposer is None or self.proposer.drafts_ahead
        can_plan_ahead = step.plan.samples_every_row and (drafts_ahead or not step.plan.max_draft_len)
        if self.config.async_scheduling and can_plan_ahead:
            ahead = self.scheduler.schedule_ahead(step.plan)
        if ahead is None:
            self.scheduler.choose_ahead(step.plan)
        elif drafts_ahead or ahead.max_draft_len == 0:
            self.in_flight = self._launch(ahead, after=step)
            self.num_steps_ahead += 1
        else:
            self.planned = ahead
        result = step.result()
        now = time.perf_counter()
        # What the step added to the wall time, host work between steps included (the last
        # step's tokens came back at last_ready while the engine was busy).
        self.unobserved = (step.plan, result, now - (self.last_ready or step.started))
        ended = [req.finished for req in step.plan.requests]  # before this step (their rows are dropped)
        self.scheduler.commit(step.plan, result, self.in_flight.plan if self.in_flight else None)
        self.num_steps += 1
        outputs = []
        accept_lens = result.accept_lens.tolist()
        for req, n, ended_before in zip(step.plan.requests, accept_lens, ended):
            if ended_before or (n == 0 and not req.finished):
                continue
            self.num_generated_tokens += n
            if req.finished or req.stream or req.params.stop:  # stop strings are found in the text
                outputs.append(self._output(req))
        self.last_ready = now if self.has_unfinished() else None
        if self.last_ready is None:
            self._observe_last()  # no step follows to hide it behind
        return outputs

    def _observe_last(self) -> None:
        if self.unobserved is not None:
            self.scheduler.policy.observe(*self.unobserved)
            self.unobserved = None

    def _next_plan(self) -> StepPlan:
        plan, self.planned = self.planned, None
        return plan.unfinished() if plan is not None else self.scheduler.schedule()

    def _launch(self, plan: StepPlan, after: PendingStep | None = None) -> PendingStep | None:
        """Propose for the rows that draft, then queue the step on the device (behind
        `after`, still in flight, when the plan was made ahead of it)."""
        if not plan.requests:
            return None
        started = time.perf_counter()
        ahead = after.ahead_for(plan.requests) if after else None
        drafts = None
        rows = [i for i, k in enumerate(plan.draft_lens) if k > 0]
        if rows:
            drafts = self.proposer.propose(plan, rows, ahead)
            plan.draft_lens = drafts.lens
        step = self.runner.launch(plan, drafts, ahead)
        step.started = started
        return step

    def _output(self, req: Request) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        delta = detok.add(req.token_ids[req.num_prompt_tokens + detok.num_tokens:])
        if detok.stopped and not req.finished:
            self.scheduler.finish(req, "stop", detok.stop_str)
        if req.finished:
            return self._finish_output(req, delta)
        return self._make_output(req, detok, delta)

    def _finish_output(self, req: Request, delta: str = "") -> RequestOutput:
        detok = self.detokenizers.pop(req.request_id)
        self.requests.pop(req.request_id, None)
        return self._make_output(req, detok, delta + detok.flush())

    def _make_output(self, req: Request, detok: IncrementalDetokenizer, delta: str) -> RequestOutput:
        completion = CompletionOutput(0, detok.released_text, delta, req.output_token_ids, req.finish_reason,
                                      req.stop_reason, req.logprobs)
        metrics = {
            "num_prompt_tokens": req.num_prompt_tokens,
            "num_cached_prompt_tokens": req.num_cached_prompt_tokens,
            "num_preemptions": req.num_preemptions,
            "arrival_time": req.arrival_time,
            "first_token_time": req.first_token_time,
            "finish_time": req.finish_time,
        }
        if req.finished:
            metrics["spec"] = req.spec.as_dict()
        return RequestOutput(req.request_id, req.prompt, req.token_ids[:req.num_prompt_tokens], [completion],
                             req.finished, metrics)

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_pages": self.pool.capacity,
            "num_free_pages": self.pool.num_free,
            "prefix_cache_hit_pages": self.pool.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_steps_ahead": self.num_steps_ahead,
            "num_generated_tokens": self.num_generated_tokens,
            "spec": self.scheduler.spec.as_dict(),
            "policy": {**self.scheduler.policy.stats(), "draft_len_counts": list(self.scheduler.draft_len_counts)},
        }


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

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        generated = self.engine.num_generated_tokens
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm or len(requests) < 2)
        start = time.monotonic()
        with frozen_heap():
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                elapsed = max(time.monotonic() - start, 1e-9)
                bar.set_postfix(tok_s=f"{(self.engine.num_generated_tokens - generated) / elapsed:.0f}", refresh=False)
        bar.close()
        return [done[r.request_id] for r in requests]
