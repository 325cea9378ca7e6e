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
from collections import deque

from tidal.kv_cache import PagePool
from tidal.request import Request, SpecStats, Status
from tidal.speculative.policy import Off, SpecPolicy
from tidal.step import StepPlan, StepResult


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: SpecPolicy | None = None, max_draft_len: int = 0):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy or Off()
        self.max_draft_len = max_draft_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.spec = SpecStats()       # server-wide acceptance statistics
        self.draft_len_counts = [0] * (max_draft_len + 1)  # decoding rows per chosen K
        self.ahead: tuple[dict[str, int], object] | None = None  # draft lengths (and note) chosen while the last step ran
        self.num_preemptions = 0
        self.feeding: dict[Request, int] = {}  # tokens the step in flight feeds, while choosing ahead of it

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

    def schedule(self) -> StepPlan:
        plan = StepPlan([], [], [])
        budget = self.max_num_batched_tokens
        ps = self.pool.page_size

        # Running requests: a decode needs 1 token (+ drafts), a prefill continues its chunk.
        if self.ahead is not None:
            (draft_lens, plan.choice), self.ahead = self.ahead, None
        else:
            decoding = [r for r in self.running if r.num_computed == r.num_tokens - 1]
            draft_lens, plan.choice = self._draft_lens(decoding)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            k = min(draft_lens.get(req.request_id, 0), budget - num_new)
            need = pages_for(req.num_computed + num_new + k, ps) - len(req.pages)
            while need > self.pool.num_free and self.running[-1] is not req:
                self._preempt(self.running.pop())
            if need > self.pool.num_free:
                self.running.pop()
                self._preempt(req)
                break
            req.pages += self.pool.allocate(need) if need > 0 else []
            plan.requests.append(req)
            plan.num_new_tokens.append(num_new)
            plan.draft_lens.append(k)
            budget -= num_new + k
            i += 1

        self._admit(plan, budget)
        return plan

    def _whole_prompts(self, budget: int, seats: int) -> int | None:
        """Tokens of the waiting requests, first come first served, whose whole prompts fit in
        `budget` and `seats`; None if the first that has a seat does not fit whole."""
        tokens = 0
        for req in itertools.islice(self.waiting, max(seats, 0)):
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

    def choose_ahead(self, plan: StepPlan) -> None:
        """Let the policy choose the next step's draft lengths now, while `plan` runs on the
        device, so that its host time hides behind the device's; schedule() then uses them.
        Chosen for are the requests decoding now (less those this step surely ends) and any
        decoding one the step left out; a prompt that ends in this step starts at K = 0 (its
        state does not show yet what its drafter would have to absorb). Each row may commit
        up to 1 + K_i tokens now: limits are taken as if it did, so the choice stays within them."""
        if self.max_draft_len == 0:
            return
        in_plan = set(plan.requests)
        commits = {r: 1 + k for i, (r, n, k) in enumerate(zip(plan.requests, plan.num_new_tokens, plan.draft_lens))
                   if n == 1 and plan.samples(i)}
        decoding = [r for r in self.running
                    if (r in commits and r.num_output_tokens + 1 < r.params.max_tokens
                        and r.num_tokens + 1 < self.max_model_len)
                    or (r not in in_plan and r.num_computed == r.num_tokens - 1)]
        if decoding:
            self.ahead = self._draft_lens(decoding, [commits.get(r, 0) for r in decoding], plan)

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The next step's plan, made while `plan` (every running request, each committing
        1 to 1 + K_i tokens) is still on the device (async scheduling), or None where its
        outcome could change the next plan: pages would have to be taken back, or the first
        request waiting for a free seat does not fit whole (schedule() chunks it).

        Each request is planned as if this step's tokens were in its state, every draft
        accepted (its row's tokens computed, 1 + K_i more known): its pages cover that, and the
        device moves it back by the drafts rejected (`Ahead`). Those that surely end in this
        step (their length limits), or might run past `max_model_len`, are left out; one that
        ends otherwise (EOS, a stop string, an abort, accepted tokens reaching max_tokens) has
        its row computed and dropped at commit. Nothing is preempted, so no request loses
        pages a step in flight writes to. Requests whose prompt ends in this step do not
        draft yet (as in choose_ahead). Waiting requests whose whole prompt fits are admitted
        after the running ones (as in schedule): a prompt's step need not wait, device idle,
        for the host to plan it after the step before."""
        rows = [(r, n, 1 + k) for r, n, k in zip(plan.requests, plan.num_new_tokens, plan.draft_lens)
                if not r.finished]  # (request, tokens it feeds now, tokens it commits now at most)
        if [r for r, _, _ in rows] != self.running:  # (requests compare by identity)
            return None
        # Those that go on after this step (the others surely end in it, or might run past max_model_len).
        rows = [(r, n, c) for r, n, c in rows
                if r.num_output_tokens + 1 < r.params.max_tokens and r.num_tokens + c < self.max_model_len]
        if not rows:
            return None
        # Prompts waiting are admitted whole, before drafts take the budget; one that does
        # not fit whole at the head of the queue is chunked by schedule(), after the commit.
        reserved = self._whole_prompts(self.max_num_batched_tokens - len(rows), self.max_num_seqs - len(self.running))
        if reserved is None:
            return None
        ps = self.pool.page_size
        # Where each request's next token goes; pages each needs for it, and more for its drafts.
        ends = [r.num_computed + n + c for r, n, c in rows]
        needs = [max(pages_for(end, ps) - len(r.pages), 0) for (r, _, _), end in zip(rows, ends)]
        spare = self.pool.num_free - sum(needs)
        if spare < 0:
            return None
        reqs = [r for r, _, _ in rows]
        for req, need in zip(reqs, needs):  # every row's next token first, then the drafts that fit
            if need:
                req.pages += self.pool.allocate(need)
        budget = self.max_num_batched_tokens - len(reqs) - reserved
        ks, choice = [0] * len(reqs), None
        if self.max_draft_len:
            decoding = [r for r, n, _ in rows if n == 1]
            draft_lens, choice = self._draft_lens(decoding, [c for _, n, c in rows if n == 1], plan)
            for i, (req, end) in enumerate(zip(reqs, ends)):
                k = min(draft_lens.get(req.request_id, 0), budget)
                extra = max(pages_for(end + k, ps) - len(req.pages), 0) if k else 0
                if not k or extra > spare:
                    continue
                if extra:
                    req.pages += self.pool.allocate(extra)
                spare -= extra
                budget -= k
                ks[i] = k
        plan = StepPlan(reqs, [1] * len(reqs), ks, choice)
        self._admit(plan, budget + reserved, whole=True)
        return plan

    def _draft_lens(self, decoding: list[Request], pending: list[int] | None = None,
                    in_flight: StepPlan | None = None) -> tuple[dict[str, int], object]:
        """K per decoding request, from the policy, and the policy's note on its choice;
        `pending[i]` tokens not yet in request i's state count as committed, and so do the
        prompt chunks of the step `in_flight` (for the policy's `prefill_demand`)."""
        if not decoding or self.max_draft_len == 0:
            return {}, None
        pending = pending or [0] * len(decoding)
        # A request can commit at most K + 1 tokens; drafting past its end is waste.
        limits = [max(0, min(self.max_draft_len,
                             r.params.max_tokens - r.num_output_tokens - n - 1,
                             self.max_model_len - r.num_tokens - n - 1)) for r, n in zip(decoding, pending)]
        # (Only chunks of 2+ tokens: a row fed one token is a decode, or a prompt's last token.)
        fed = zip(in_flight.requests, in_flight.num_new_tokens) if in_flight else ()
        self.feeding = {r: n for r, n in fed if n > 1}
        try:
            chosen = self.policy.choose(decoding, limits, len(self.waiting))
        finally:
            self.feeding = {}
        ks = [max(0, min(k, limit)) for k, limit in zip(chosen, limits)]
        for k in ks:
            self.draft_len_counts[k] += 1
        return {r.request_id: k for r, k in zip(decoding, ks)}, chosen.note

    def prefill_demand(self, limit: int) -> int:
        """Prompt tokens that running and admissible waiting requests still have to feed
        (what draft tokens would take budget from), counted up to `limit`. A chunk the step
        in flight feeds is not: counted, it would price the next step's drafts beside a
        prompt that step does not carry."""
        total = 0
        admissible = itertools.islice(self.waiting, max(self.max_num_seqs - len(self.running), 0))
        for req in itertools.chain(self.running, admissible):
            computed = req.num_computed + self.feeding.get(req, 0)
            if computed < req.num_tokens - 1:
                total += req.num_tokens - computed
                if total >= limit:
                    break
        return total

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
