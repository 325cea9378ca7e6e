"""Continuous batching: which requests run each step, how many tokens each feeds, and how
the step's results are committed.

Policy only, no tensors. Running requests go first (decodes and unfinished prefill
chunks, in arrival order), then waiting requests are admitted first come first served
while the token budget, `max_num_seqs` and free pages allow. When pages run out, the most
recently arrived running request is preempted: its pages are freed and it is recomputed
later from its prompt and output so far.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Iterator

from tidal.config import EngineConfig
from tidal.kv_cache import PagePool
from tidal.request import Request, SpecStats, Status
from tidal.speculative import Speculation
from tidal.speculative.policy import Off, SpecPolicy
from tidal.step import StepPlan, StepResult


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, pool: PagePool, config: EngineConfig, max_model_len: int,
                 speculation: Speculation | None = None):
        self.pool = pool
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.plans_ahead = config.async_scheduling  # plan a step while the one before runs
        self.max_draft_len = speculation.max_draft_len if speculation else 0
        # Slots past its root a row drafting K keeps (`SpecConfig.draft_slots`: a tree's growth
        # may feed more nodes than it verifies), nondecreasing in K.
        self.draft_slots = [speculation.config.draft_slots(k) if speculation else 0
                            for k in range(self.max_draft_len + 1)]
        self.drafts_ahead = speculation is None or speculation.proposer.drafts_ahead
        self.policy: SpecPolicy = (speculation.make_policy(self.prefill_demand, self.queued, config)
                                  if speculation else Off())
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.spec = SpecStats()       # server-wide acceptance statistics
        self.draft_len_counts = [0] * (self.max_draft_len + 1)  # decoding rows per chosen K
        self.chosen: tuple[dict[str, int], object] | None = None  # K (and note) chosen while the last step ran
        self.num_preemptions = 0
        self.feeding: dict[Request, int] = {}  # prompt tokens the step in flight feeds, while choosing after it

    # -- admission -----------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        """The running or waiting request of this id."""
        return next((req for req in itertools.chain(self.running, self.waiting) if req.request_id == request_id), None)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request outside a commit (abort, or a stop string found in its text)."""
        (self.running if req.status is Status.RUNNING else self.waiting).remove(req)
        self._release(req)
        req.finish(reason, stop_reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ------------------------------------------------------------------------

    def schedule(self, in_flight: StepPlan | None = None) -> StepPlan | None:
        """The next step's plan. Running requests come first, in arrival order: each row's
        own tokens (a decode, or its prompt's next chunk), preempting the most recently
        arrived running request when pages run out; then waiting prompts that fit whole,
        then the drafts the policy chose (within free pages only: a draft never preempts),
        then a chunk of the next waiting prompt.

        With `in_flight`, a step still on the device, the plan is made while it runs (async
        scheduling): each of its rows as if its tokens were in the request's state and every
        draft accepted, so its pages cover the most the row can commit; the device moves the
        row back by the drafts rejected (`Ahead`). Requests that surely end in that step, or
        might run past `max_model_len`, are left out; one that ends otherwise has its row
        computed and dropped at commit. Where the step's outcome could change the plan (it
        has a row that does not sample, pages would have to be taken back, the first waiting
        prompt would be chunked) there is no plan (None); the policy's K are chosen all the
        same, while the device runs, and the plan made after the commit takes them."""
        after = self._after(in_flight) if in_flight is not None else {}
        draft_lens, note = self._choose(in_flight, after)
        if in_flight is None:
            rows, prompt_tokens = [(r, r.num_computed, r.num_tokens) for r in self.running], None
        else:
            ahead = self._rows_ahead(in_flight, after, draft_lens)
            if ahead is None:
                self.chosen = (draft_lens, note) if draft_lens else None  # (none chosen: the plan chooses)
                return None
            rows, prompt_tokens = ahead
        ps = self.pool.page_size
        budget, free = self.max_num_batched_tokens, self.pool.num_free  # (free: read again after a preemption)
        requests, num_new_tokens, ends = [], [], []
        for req, start, known in rows:
            if budget == 0 or req.status is not Status.RUNNING:  # (preempted for an earlier row)
                break
            num_new = min(known - start, budget)
            need = pages_for(start + num_new, ps) - len(req.pages)
            if need > 0:  # (most rows' next token fits in their last page)
                while need > free and self.running[-1] is not req:
                    self._preempt(self.running.pop())
                    free = self.pool.num_free
                if need > free:
                    self.running.pop()
                    self._preempt(req)
                    free = self.pool.num_free
                    break
                req.pages += self.pool.allocate(need)
                free -= need
            requests.append(req)
            num_new_tokens.append(num_new)
            ends.append(start + num_new)
            budget -= num_new
        ks = [0] * len(requests)
        if draft_lens:  # in the budget that waiting prompts fitting whole leave, and in free pages
            if prompt_tokens is None:
                prompt_tokens = self._whole_prompts(budget) or 0
            room = budget - prompt_tokens
            widest = self._widest(len(requests))
            for i, (req, end) in enumerate(zip(requests, ends)):
                k = min(draft_lens.get(req.request_id, 0), room, widest)
                need = pages_for(end + self.draft_slots[k], ps) - len(req.pages) if k else 0
                if k and need <= free:
                    if need > 0:
                        req.pages += self.pool.allocate(need)
                        free -= need
                    ks[i] = k
                    room -= k
                    budget -= k
        plan = StepPlan(requests, num_new_tokens, ks, note)
        self._admit(plan, budget, whole=in_flight is not None)
        self._fit_width(plan)
        return plan

    def _widest(self, rows: int) -> int:
        """The longest K a step of `rows` rows may draft. Every row that samples takes logits at
        the step's width, 1 + its longest K (verification lays rows out [rows, width]), so
        rows x width stays within the token budget, the most the memory plan measured
        (`profiling.verify_rows`); every row counts, as any may sample. Never negative: a row
        takes a token of the budget."""
        return self.max_num_batched_tokens // max(rows, 1) - 1

    def _fit_width(self, plan: StepPlan) -> None:
        """Drafts are given no more than `_widest` of the rows planned before them; prompts
        admitted after them cut the longest K to the plan's (a tree's best nodes are the
        longer tree's best; the pages of slots no longer used go back at commit)."""
        widest = self._widest(len(plan.requests))
        if max(plan.draft_lens, default=0) > widest:
            plan.draft_lens[:] = [min(k, widest) for k in plan.draft_lens]

    def _after(self, in_flight: StepPlan) -> dict[Request, int]:
        """The requests that surely run on after the step `in_flight`, each with the most
        tokens it commits there (1 + K): those whose rows sample (a decode, or a prompt's last
        chunk) and that are not at their max_tokens then, nor possibly past max_model_len.
        Empty where nothing reads it: no K to choose, and no plan made ahead."""
        if not (self.max_draft_len or self.plans_ahead):
            return {}
        max_len = self.max_model_len
        return {r: 1 + k for r, n, k in zip(in_flight.requests, in_flight.num_new_tokens, in_flight.draft_lens)
                if r.num_computed + n == r.num_tokens  # (it samples)
                and r.num_output_tokens + 1 < r.params.max_tokens and r.num_tokens + 1 + k < max_len}

    def _rows_ahead(self, in_flight: StepPlan, after: dict[Request, int],
                    draft_lens: dict[str, int]) -> tuple[list[tuple[Request, int, int]], int] | None:
        """The rows of a plan made while `in_flight` runs: (request, where its next token
        goes, tokens it knows then), as if every draft there were accepted; and the tokens of
        the waiting prompts that fit whole beside them (`_whole_prompts`). None where that
        step's outcome could change the plan, or the planner must not plan ahead of it
        (async scheduling off; a proposer that drafts from tokens on the host)."""
        if not (self.plans_ahead and in_flight.samples_every_row):
            return None
        if not self.drafts_ahead and (in_flight.max_draft_len or any(draft_lens.values())):
            return None
        rows = [(r, n, k) for r, n, k in zip(in_flight.requests, in_flight.num_new_tokens, in_flight.draft_lens)
                if not r.finished]
        if [r for r, _, _ in rows] != self.running:  # (requests compare by identity)
            return None
        rows = [(r, r.num_computed + n + k, r.num_tokens + 1 + k) for r, n, k in rows if r in after]
        if not rows:
            return None
        whole = self._whole_prompts(self.max_num_batched_tokens - len(rows))
        if whole is None:
            return None
        ps = self.pool.page_size
        if sum(max(pages_for(start + 1, ps) - len(r.pages), 0) for r, start, _ in rows) > self.pool.num_free:
            return None
        return rows, whole

    def _admissible(self) -> Iterator[Request]:
        """Waiting requests, first come first served, up to the first that the free seats and
        pages cannot hold."""
        free = self.pool.num_free
        for req in itertools.islice(self.waiting, max(self.max_num_seqs - len(self.running), 0)):
            free -= pages_for(req.num_tokens, self.pool.page_size)
            if free < 0:
                return
            yield req

    def _feeding(self) -> Iterator[tuple[Request, int]]:
        """Running requests still feeding their prompts, and the tokens each has left to feed
        (a chunk the step in flight feeds counted as fed)."""
        for req in self.running:
            computed = req.num_computed + self.feeding.get(req, 0)
            if computed < req.num_tokens - 1:
                yield req, req.num_tokens - computed

    def _whole_prompts(self, budget: int) -> int | None:
        """Tokens of the waiting requests, first come first served, whose whole prompts fit in
        `budget`, the free seats and the free pages; None if the first that has a seat and
        pages does not fit whole in `budget` (it would be chunked). A prompt the pages cannot
        hold waits: it takes no budget from drafts."""
        tokens = 0
        for req in self._admissible():
            if tokens + req.num_tokens > budget:
                return None if tokens == 0 else tokens
            tokens += req.num_tokens
        return tokens

    def _admit(self, plan: StepPlan, budget: int, whole: bool = False) -> None:
        """Admit waiting requests into `plan`, first come first served, within `budget` tokens
        and the free pages; stop at the first that does not fit. With `whole`, only a request
        whose whole prompt fits (so that the step samples every row)."""
        ps = self.pool.page_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.pages:
                # Keep at least one token to compute: its logits give the next token.
                req.pages, req.page_keys = self.pool.match_prefix(req.token_ids, req.num_tokens - 1)
                req.num_computed = len(req.pages) * ps
                if req.num_output_tokens == 0:
                    req.num_cached_prompt_tokens = req.num_computed
            num_new = min(req.num_tokens - req.num_computed, budget)
            need = pages_for(req.num_computed + num_new, ps) - len(req.pages)
            if need > self.pool.num_free or (whole and req.num_computed + num_new < req.num_tokens):
                self._release(req)
                req.num_computed = 0
                break
            req.pages += self.pool.allocate(need) if need > 0 else []
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.requests.append(req)
            plan.num_new_tokens.append(num_new)
            plan.draft_lens.append(0)
            budget -= num_new

    def _choose(self, in_flight: StepPlan | None, after: dict[Request, int]) -> tuple[dict[str, int], object]:
        """K per decoding request (by id), from the policy, and its note on the choice; once
        a step: with `in_flight`, for the step after it, counting what it may commit as
        committed (`after`) and its prompt chunks as fed (for `prefill_demand`); without, the
        K chosen while the step before ran, if any. A prompt whose last chunk is in flight
        starts at K = 0: its state does not show yet what its drafter would have to absorb."""
        if in_flight is None and self.chosen is not None:
            chosen, self.chosen = self.chosen, None
            return chosen
        if not self.max_draft_len:
            return {}, None
        fed, in_plan = {}, ()
        if in_flight is not None:  # (a row fed one token is a decode, or a prompt's last token)
            fed = {r: n for r, n in zip(in_flight.requests, in_flight.num_new_tokens) if n > 1}
            in_plan = set(in_flight.requests)
        # Decoding: a decode in flight whose request runs on after it, or a running request
        # not in that step that decodes.
        decoding = [r for r in self.running if r in after and r not in fed
                    or r not in in_plan and r.num_computed == r.num_tokens - 1]
        if not decoding:
            return {}, None
        pending = [after.get(r, 0) for r in decoding]
        # A request can commit at most K + 1 tokens; drafting past its end is waste. Its
        # drafts' slots stay within max_model_len.
        limits = [max(0, min(r.params.max_tokens - r.num_output_tokens - n - 1,
                             bisect_right(self.draft_slots, self.max_model_len - r.num_tokens - n - 1) - 1))
                  for r, n in zip(decoding, pending)]
        # Draft slots without a page a preemption would free: the free pages, and what each
        # request's own pages hold past its next token (its drafts fill its last page first).
        ps = self.pool.page_size
        kv_room = self.pool.num_free * ps + sum(len(r.pages) * ps - r.num_tokens - n for r, n in zip(decoding, pending))
        self.feeding = fed
        try:
            chosen = self.policy.choose(decoding, limits, len(self.waiting), kv_room)
        finally:
            self.feeding = {}
        ks = [max(0, min(k, limit)) for k, limit in zip(chosen, limits)]
        for k in ks:
            self.draft_len_counts[k] += 1
        return {r.request_id: k for r, k in zip(decoding, ks)}, chosen.note

    def prefill_demand(self, limit: int) -> int:
        """Prompt tokens that running and admissible waiting requests (`_whole_prompts`: a
        prompt the free pages cannot hold is not) still have to feed (what draft tokens would
        take budget from), counted up to `limit`. A chunk the step in flight feeds is not:
        counted, it would price the next step's drafts beside a prompt that step does not
        carry."""
        total = 0
        for _, left in self._feeding():
            total += left
            if total >= limit:
                return total
        waiting = self._whole_prompts(limit - total)
        return limit if waiting is None else total + waiting

    def queued(self) -> list[Request]:
        """Requests that will decode once their prompts are fed: running ones still feeding
        them, then waiting ones the free seats and pages hold. A prompt the pages cannot hold
        is not: it waits for pages, not for the budget."""
        return [req for req, _ in self._feeding()] + list(self._admissible())

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed = req.num_absorbed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.pages)
        req.pages = []
        req.page_keys = []

    # -- committing ----------------------------------------------------------------------

    def commit(self, plan: StepPlan, result: StepResult, in_flight: StepPlan | None = None) -> list[Request]:
        """Append each row's accepted tokens; returns the requests that finished.
        `in_flight` is a step planned ahead of this one, already on the device."""
        ahead = set(in_flight.requests) if in_flight is not None and any(plan.draft_lens) else ()
        ps = self.pool.page_size
        finished = []
        rows = zip(plan.requests, plan.num_new_tokens, plan.draft_lens,
                   result.token_ids.tolist(), result.accept_lens.tolist())
        for i, (req, num_new, k, tokens, n) in enumerate(rows):
            if req.finished:  # ended while this step was in flight (async scheduling)
                continue
            req.num_computed += num_new + max(n - 1, 0)
            if k:
                req.num_absorbed = min(req.num_absorbed, req.num_computed)
                req.spec.record(k, n - 1)
                self.spec.record(k, n - 1)
            logprobs = result.logprobs[i] if result.logprobs is not None and req.logprobs is not None else None
            ended = False
            for j in range(n):
                if logprobs is not None:
                    req.logprobs.append(logprobs[j])
                if req.append_token(tokens[j], self.max_model_len):
                    ended = True
                    break
            if ended:
                self.running.remove(req)
                self._release(req)
                finished.append(req)
                continue
            # Pages that held only rejected drafts go back to the pool, unless the step in
            # flight uses them (that step's own commit frees what it leaves).
            if k and req not in ahead:
                keep = pages_for(req.num_computed, ps)
                self.pool.free(req.pages[keep:])
                del req.pages[keep:]
            # register keys the pages full of computed tokens that have no key yet; most
            # steps fill none, and then there is nothing to call it for.
            if len(req.page_keys) < req.num_computed // ps:
                self.pool.register(req.pages, req.page_keys, req.token_ids, req.num_computed)
        return finished
