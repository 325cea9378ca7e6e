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
from tidal.parallel import TensorParallel
from tidal.profiling import cached_costs, cost_key, measure_costs, plan_pages
from tidal.processing import EngineOutput
from tidal.request import Request
from tidal.runner import ModelRunner, PendingStep
from tidal.scheduler import Scheduler, pages_for
from tidal.speculative import Speculation
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
        spec = config.speculative_config
        self.speculation = Speculation(spec) if spec else None
        max_draft_len = self.speculation.max_draft_len if spec else 0
        # The other ranks of a model split over several start first: they build their slices
        # while this process, rank 0, builds its own.
        self.tp = (TensorParallel.start(config, self.model_config, self.max_model_len, max_draft_len)
                   if config.tensor_parallel_size > 1 else None)
        try:
            capture_s = self._start_runner(max_draft_len)
        except BaseException:
            self.shutdown()
            raise
        self.pool = PagePool(self.runner.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config, self.max_model_len, self.speculation)
        self.in_flight: PendingStep | None = None  # a step queued on the device, not yet committed
        self.last_step: PendingStep | None = None  # the last one committed, while steps follow each other
        self.num_steps = 0
        self.num_steps_ahead = 0                   # steps queued behind the one before (async scheduling)
        self.num_generated_tokens = 0
        compile_watch.serving()
        logger.info(self.describe())
        logger.info("engine start-up took %.1f s (graph capture and kernel warm-up %.1f s)",
                    time.perf_counter() - started, capture_s)

    def _start_runner(self, max_draft_len: int) -> float:
        """Build the runner and the drafter, size the KV cache, capture graphs, build kernels
        and price steps. Returns the seconds graphs and kernels took."""
        config, spec = self.config, self.config.speculative_config
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, max_draft_len, self.tp)
        if self.runner.device.type == "cuda":
            compile_watch.start_up()
        proposer = self.speculation.attach(self.runner, self.model_config) if spec else None
        self.runner.allocate_cache(config.num_pages or plan_pages(self.runner, proposer))
        if proposer:
            proposer.allocate_cache()
        capacity = self.runner.num_pages - 1  # page 0 is never handed out
        if pages_for(self.max_model_len + self.runner.max_draft_len, config.page_size) > capacity:
            raise ValueError(
                f"the KV cache has {capacity} pages of {config.page_size} tokens, fewer than one request of "
                f"max_model_len {self.max_model_len} needs; give it more memory (--gpu-memory-utilization on cuda, "
                "--kv-cache-memory-gb on cpu, or --num-pages) or lower --max-model-len")
        capture_started = time.perf_counter()
        self.runner.capture_graphs()
        self.runner.warmup()
        if proposer:
            proposer.warmup()
        capture_s = time.perf_counter() - capture_started
        if spec and self.speculation.profiles_costs:
            self.speculation.cost_model = cached_costs(cost_key(self.runner, proposer), lambda: measure_costs(
                self.runner, proposer, config.max_num_seqs, spec.max_draft_len, self.max_model_len,
                spec.profile_seconds))
            logger.info("step costs: %s", self.speculation.cost_model.source)
        return capture_s

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any; the engine runs no step after it."""
        if self.tp is not None:
            self.tp.stop()

    def describe(self) -> str:
        """What was loaded, in one line (logged at start-up)."""
        c = self.config
        return (f"model {c.model} ({self.model_config.architecture}, {str(self.runner.dtype).removeprefix('torch.')}, "
                f"{self.runner.device}, {'eager' if self.runner.graphs is None else 'CUDA graphs'}"
                f"{f', {c.tensor_parallel_size} tensor-parallel ranks' if self.tp else ''}); "
                f"KV cache {self.pool.capacity} pages of {c.page_size} tokens; max_model_len {self.max_model_len}; "
                f"max_num_seqs {c.max_num_seqs}; max_num_batched_tokens {c.max_num_batched_tokens}; "
                f"speculation: {self.speculation.describe() if self.speculation else 'none'}")

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

        Async scheduling: while a step runs on the device, the next one is planned, drafted
        for and queued behind it where its outcome cannot change that plan
        (`Scheduler.schedule`); the host then commits this step while the device runs the
        next. Meanwhile the policy learns from the step before."""
        step = self.in_flight or self._launch(self.scheduler.schedule())
        if step is None:
            return []
        self._observe_last()
        self.in_flight = self._launch(self.scheduler.schedule(step.plan), after=step)
        self.num_steps_ahead += self.in_flight is not None
        result = step.result()
        step.record_result(result, self.last_step)
        ended = [req.finished for req in step.plan.requests]  # before this step (their rows are dropped)
        self.scheduler.commit(step.plan, result, self.in_flight.plan if self.in_flight else None)
        self.num_steps += 1
        outputs = []
        for req, n, ended_before in zip(step.plan.requests, result.accept_lens.tolist(), ended):
            self.num_generated_tokens += 0 if ended_before else n
            if not ended_before and (req.finished or (n and (req.stream or req.params.stop))):
                outputs.append(self._output(req))  # (stop strings are found in the text)
        self.last_step = step
        if not self.has_unfinished():
            self._observe_last()  # no step follows to hide it behind
            self.last_step = None
        return outputs

    def _observe_last(self) -> None:
        """Tell the policy what the last step cost and accepted, once."""
        if self.last_step is not None and self.last_step.observation is not None:
            self.scheduler.policy.observe(*self.last_step.observation)
            self.last_step.observation = None

    def _launch(self, plan: StepPlan | None, after: PendingStep | None = None) -> PendingStep | None:
        """Propose for the rows that draft, then queue the step on the device (behind
        `after`, still in flight, when the plan was made ahead of it)."""
        if plan is None or not plan.requests:
            return None
        started = time.perf_counter()
        ahead = after.ahead_for(plan.requests) if after else None
        drafts = None
        rows = [i for i, k in enumerate(plan.draft_lens) if k > 0]
        if rows:
            drafts = self.speculation.proposer.propose(plan, rows, ahead)
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
