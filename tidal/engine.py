"""The engine core: `EngineCore.step()` is schedule -> propose -> run and verify -> commit ->
outputs, on token ids alone (prompts in and text out are `tidal.processing`'s)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time

from tidal.compiles import watch as compile_watch
from tidal.config import EngineConfig
from tidal.kv_cache import PagePool
from tidal.models.config import ModelConfig
from tidal.profiling import cached_costs, cost_key, measure_costs, plan_pages
from tidal.processing import EngineOutput
from tidal.request import Request
from tidal.runner import ModelRunner, PendingStep
from tidal.scheduler import Scheduler, pages_for
from tidal.speculative import build_proposer
from tidal.speculative.policy import make_policy
from tidal.step import StepPlan

logger = logging.getLogger(__name__)


_frozen = 0  # serving loops under way (`frozen_heap`)


@contextlib.contextmanager
def frozen_heap():
    """While serving, keep the objects that already exist (the engine's, its libraries')
    out of the garbage collector's scans. A full collection walks every tracked object,
    hundreds of thousands after an 8B engine's start-up (docs/design.md): a stall in
    whatever step it lands in. Everything thaws when the last loop ends, so an engine
    dropped afterwards is collected as usual (frozen objects never are)."""
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


class EngineCore:
    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} is more than the model's context of {limit} "
                             "tokens (max_position_embeddings in its config.json)")
        self.max_model_len = config.max_model_len or limit
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        if self.runner.device.type == "cuda":
            compile_watch.start_up()
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
        capture_started = time.perf_counter()
        self.runner.capture_graphs()
        self.runner.warmup()
        if self.proposer:
            self.proposer.warmup()
        capture_s = time.perf_counter() - capture_started
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
        self.in_flight: PendingStep | None = None  # a step queued on the device, not yet committed
        self.planned: StepPlan | None = None       # a drafting step planned ahead, to launch next
        self.last_ready: float | None = None       # when the last step's tokens came back (None: idle since)
        self.last_step: PendingStep | None = None  # and that step
        self.unobserved: tuple | None = None       # the last step, for the policy to learn from during the next
        self.num_steps = 0
        self.num_steps_ahead = 0                   # steps queued behind the one before (async scheduling)
        self.num_generated_tokens = 0
        compile_watch.serving()
        logger.info(self.describe())
        logger.info("engine start-up took %.1f s (graph capture and kernel warm-up %.1f s)",
                    time.perf_counter() - started, capture_s)

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

    def add_request(self, req: Request) -> None:
        """Queue a request made by `InputProcessor.make_request`; it joins the running batch
        at the next step it fits in."""
        self.scheduler.add(req)

    def finish(self, request_id: str, reason: str = "abort", stop_reason: str | None = None) -> EngineOutput | None:
        """End a request now (an abort, or a stop string its text reached), freeing its
        pages; its last output, or None if it is not running."""
        req = self.scheduler.find(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, reason, stop_reason)
        return self._output(req)

    def request_ids(self) -> list[str]:
        """The requests running or waiting."""
        return [req.request_id for req in itertools.chain(self.scheduler.running, self.scheduler.waiting)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One forward step. Returns an output (the tokens committed since the request's
        last one) for every request that finished, and for every streaming one (or one with
        stop strings, which the front finds in its text) that committed tokens.

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
        # What the step added to the time line: on the device from the last step's end, so
        # that a step launched late (a prompt step's longer host work) pays for it, not the
        # step it was launched behind; else the wall time since the last step's tokens came
        # back (or since this one began, after an idle spell).
        seconds = step.seconds_after(self.last_step) if self.last_ready is not None else None
        self.unobserved = (step.plan, result, now - (self.last_ready or step.started) if seconds is None else seconds,
                           step.catch_up and step.catch_up.seconds)
        self.last_step = step
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
        step.catch_up = drafts and drafts.catch_up
        return step

    def _output(self, req: Request) -> EngineOutput:
        """The request's tokens since its last output; at its end, why it ended and its metrics."""
        new = req.output_token_ids[req.num_sent:]
        logprobs = req.logprobs[req.num_sent:req.num_sent + len(new)] if req.logprobs is not None else None
        req.num_sent += len(new)
        if not req.finished:
            return EngineOutput(req.request_id, new, logprobs)
        metrics = {"num_prompt_tokens": req.num_prompt_tokens, "num_cached_prompt_tokens": req.num_cached_prompt_tokens,
                   "num_preemptions": req.num_preemptions, "arrival_time": req.arrival_time,
                   "first_token_time": req.first_token_time, "finish_time": req.finish_time, "spec": req.spec.as_dict()}
        return EngineOutput(req.request_id, new, logprobs, req.finish_reason, req.stop_reason, metrics)

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
            "kernel_compiles_while_serving": compile_watch.count,
            "spec": self.scheduler.spec.as_dict(),
            "policy": {**self.scheduler.policy.stats(), "draft_len_counts": list(self.scheduler.draft_len_counts)},
        }
