"""The proposer protocol: a drafter plugged into the step, never a second path.

`propose` is called only in steps where some request has K_i > 0, and only for those
rows. It returns `Drafts`: at most K_i tokens per row, on the device (fewer when it has
nothing to say: the pages reserved for the rest go back at commit if the row drafted any,
and otherwise stay for the request's next tokens). A sampling drafter draws each draft
with the noise the target's own draw at that position uses (`verify`), so no draft
distribution needs to reach verification.

A proposer with a KV cache of its own records in `request.num_absorbed` how many of the
request's tokens that cache holds, and catches up over the ones it missed (K = 0 steps)
when drafting resumes. The scheduler keeps `num_absorbed <= num_computed` (at commit, and
0 at preemption), so drafter KV for rejected tokens is never trusted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from tidal.batch import ForwardBatch, to_device, to_device_parts, with_device_tails
from tidal.graphs import CudaGraphs, forward_rows
from tidal.layers.sampler import STREAM_SAMPLE, greedy_tokens, race_top_k, sample_from_probs
from tidal.speculative.tree import Tree
from tidal.step import Ahead, Drafts, Span, StepPlan


class Proposer(Protocol):
    bytes_per_page: int  # KV bytes the proposer keeps per target page (0 if stateless)
    drafts_ahead: bool   # whether it can draft for a step planned while the one before is in flight

    def allocate_cache(self) -> None:
        """Allocate its cache once the runner has sized the page pool."""
        ...

    def warmup(self) -> None:
        """Compile what it runs (GPU kernels) before the first request."""
        ...

    def propose(self, plan: StepPlan, rows: list[int], ahead: Ahead | None = None) -> Drafts:
        """Drafts for plan rows `rows`; with `ahead`, the plan was made
        while the step before was in flight, and the rows' last tokens are on the device."""
        ...


class ChainDrafter(ABC):
    """The loop shared by model drafters: one batched extend that catches each request up
    (its last position's logits give draft 1), then one decode per further draft position.
    Draft tokens stay on the device: the host never waits for the drafter. Drafts chain on
    the device: each step writes its draft where the next one reads its input (`drafted`),
    so all the steps after the catch-up replay as one graph, greedy or sampled (`_pick`):
    a drafting step costs the host a few replays whatever its K.

    Planned ahead of a step in flight, a row is drafted for as if that step committed all
    its `commits` tokens (`pending` below): the catch-up feeds them from the device, and
    its logits are taken at the row's last real token; the draft steps start from where
    the row really is (`ForwardBatch.move_back`). Drafter KV written for tokens not
    committed lies past `num_absorbed` (the commit trims it), so it is never trusted."""

    drafts_ahead = True

    def __init__(self, runner, vocab_size: int, topk: int = 1, depth: int = 0, draft_vocab_size: int | None = None):
        self.runner = runner          # the target's ModelRunner (device, page size, pages)
        self.vocab_size = vocab_size  # the target's vocabulary (and the drafter's, unless given)
        # Trees (topk > 1, `_propose_tree`): tokens per expanded node, and draft steps deep.
        self.topk, self.depth = topk, depth
        self.absorb_tokens = runner.config.max_num_batched_tokens  # most tokens a forward absorbs (`_absorb`)
        max_seqs, k = runner.config.max_num_seqs, runner.max_draft_len
        # Per row, the position the draft steps stop before (`ForwardBatch.advance`); and per
        # draft position j, each row's greedy draft in target ids (the catch-up writes
        # drafted[0], draft step j writes drafted[j] and feeds drafted[j - 1]). The graphs
        # read and write both in place.
        self.limits = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
        self.drafted = torch.zeros(max(k, 1), max_seqs, dtype=torch.int64, device=runner.device)
        # Per row, what a sampled draft is drawn with (`_pick`): the request's temperature
        # and seed, and the output index of its draft 1.
        self.temperature = torch.zeros(max_seqs, dtype=torch.float32, device=runner.device)
        self.seeds = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
        self.counters = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
        self.draft_ids: torch.Tensor | None = None  # target id of each drafter id (None: the same)
        # By whether any row samples: the catch-up's graphs, and [s - 1] those of s chained
        # draft steps (chains) or [s] those of trees grown s draft steps deep (`_grow`).
        self.catch_up_graphs: dict[bool, CudaGraphs] = {}
        self.draft_graphs: dict[bool, list[CudaGraphs]] = {}
        if topk > 1:
            # Per row of a tree proposal, what `_grow` reads in place: the key index of its
            # first scratch slot, how deep and wide it grows, its page table, its catch-up's
            # logits, and its simulated acceptance (benchmarks: the rate per depth, then the
            # sibling factor, -1 without).
            self.tree_base = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
            self.tree_pages = torch.zeros(max_seqs, -(-runner.max_model_len // runner.page_size), dtype=torch.int32,
                                          device=runner.device)
            self.tree_depths = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
            self.tree_widths = torch.zeros(max_seqs, dtype=torch.int64, device=runner.device)
            self.tree_logits = torch.zeros(max_seqs, draft_vocab_size or vocab_size, device=runner.device)
            self.tree_simulated = torch.full((max_seqs, depth + 1), -1.0, device=runner.device)

    @abstractmethod
    def catch_up(self, reqs, starts: list[int], ends: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Tokens to feed at positions starts[i] .. ends[i] - 1 of row i (those past the
        request's known tokens are placeholders for tokens only the device knows yet), and
        the input state."""

    @abstractmethod
    def feed_width(self, k: int) -> int:
        """Most tokens a row's catch-up feeds while the row drafts k every step (its
        graphs' widest; what `_absorb` leaves for the drafting forward)."""

    @abstractmethod
    def catch_up_end(self, req, pending: int) -> int:
        """The position before which req's catch-up stops, with `pending` tokens beyond its
        state."""

    @abstractmethod
    def next_position(self, req, j: int, pending: int) -> int:
        """Position of the token fed at draft step j >= 1 (j = 0: the catch-up's last), with
        `pending` tokens beyond the request's state."""

    @abstractmethod
    def forward(self, batch: ForwardBatch, state: torch.Tensor | None):
        """Logits [rows, V_draft] at each row's last token, and its output state."""

    def state_width(self, catching_up: bool) -> int:
        """Width of the input state a forward takes (0: none)."""
        return 0

    def dummy_state(self, num_tokens: int, catching_up: bool) -> torch.Tensor | None:
        width = self.state_width(catching_up)
        return torch.zeros(num_tokens, width, dtype=self.runner.dtype, device=self.runner.device) if width else None

    @torch.inference_mode()
    def warmup(self) -> None:
        """Build the drafter's Triton kernels for eager catch-up shapes (greedy and sampled
        drafts, over a draft vocabulary of its own), then capture its graphs, at start-up."""
        runner = self.runner
        if runner.device.type != "cuda":
            return
        for batch in runner.warmup_batches(runner.config.max_num_batched_tokens):
            for sampled in (False, True):
                self._catch_up(batch, self.dummy_state(batch.num_tokens, True), sampled)
            self.forward(batch, self.dummy_state(batch.num_tokens, False))
        from tidal.layers import fused

        if self.draft_ids is not None:
            fused.build_argmax_variants(len(self.draft_ids), runner.device, self.draft_ids)
        if self.topk > 1:  # a tree's children, greedy and raced (`_children`; eager growths too)
            one = torch.zeros(1, dtype=torch.int64, device=runner.device)
            for race in (False, True):
                fused.race_top_k(self.tree_logits[:1], self.topk, self.temperature[:1] if race else None,
                                 one if race else None, self.draft_ids)
        torch.cuda.synchronize(runner.device)
        if not runner.config.enforce_eager:
            self.capture_graphs()

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """The catch-up's graphs and those of the draft steps after it (chained, or a tree's
        growth), greedy and sampled."""
        k = self.runner.max_draft_len
        # One memory pool for all; one set of inputs for the catch-ups, one for the chains.
        pool = catch_up_inputs = chain_inputs = None
        for sampled in (False, True):
            catch_up = self._graphs(lambda batch, state, sampled=sampled: self._catch_up(batch, state, sampled),
                                    self.feed_width(k), True, catch_up_inputs)
            pool = catch_up.capture(pool)
            self.catch_up_graphs[sampled] = catch_up
            catch_up_inputs = catch_up_inputs or catch_up
            # Graphs of s chained draft steps, s = 1 .. K - 1: one replay drafts to K. Trees:
            # graphs of trees grown s = 0 .. depth - 1 steps deep, each a row per fed node.
            chains: list[CudaGraphs] = []
            for steps in (range(self.depth - 1, -1, -1) if self.topk > 1 else range(k - 1, 0, -1)):
                # longest first: the others reuse its memory
                if self.topk > 1:
                    graphs = self._graphs(lambda batch, state, s=steps, sampled=sampled:
                                          self._grow(batch, state, s, sampled), 1, False, chain_inputs, self.topk)
                else:
                    graphs = self._graphs(lambda batch, state, s=steps, sampled=sampled:
                                          self._draft_steps(batch, state, s, sampled), 1, False, chain_inputs)
                pool = graphs.capture(pool)
                chain_inputs = chain_inputs or graphs
                chains.insert(0, graphs)
            self.draft_graphs[sampled] = chains

    def _graphs(self, forward, width: int, catching_up: bool, inputs_of: CudaGraphs | None = None,
                group: int = 1) -> CudaGraphs:
        """Graphs of the drafter's forwards, a row per request (`group` rows per request: a
        tree's fed nodes, each a one-token row)."""
        runner = self.runner
        return CudaGraphs(forward, runner.page_size, runner.max_model_len, runner.config.max_num_seqs * group, width,
                          runner.device, self.state_width(catching_up), runner.dtype, per_row=True,
                          inputs_of=inputs_of, trees=group > 1, group=group)

    def _catch_up(self, batch: ForwardBatch, state: torch.Tensor | None, sampled: bool):
        """The catch-up forward, writing each row's draft 1 to `drafted`."""
        logits, out = self.forward(batch, state)
        self._pick(logits, 0, sampled)
        return logits, out

    def _pick(self, logits: torch.Tensor, j: int, sampled: bool) -> None:
        """Each row's draft j + 1 into drafted[j]: the argmax, or, where `sampled`, for rows
        of a temperature above 0, a draw at that temperature raced against the noise the
        target's own draw at that output index uses (`verify`): where the two distributions
        agree, so do the two tokens. Verification alone applies top-k, top-p and min-p:
        the draft's distribution only sways how often it is accepted, never what is
        committed, and one without filters has the same shape at every step (a graph)."""
        n = logits.shape[0]
        out = self.drafted[j, :n]
        if not sampled:
            greedy_tokens(logits, self.draft_ids, out=out)
            return
        temperature = self.temperature[:n]
        probs = torch.softmax(logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None], dim=-1)
        if self.draft_ids is not None:
            probs = probs.new_zeros(n, self.vocab_size).index_copy_(1, self.draft_ids, probs)
        drawn = sample_from_probs(probs, self.seeds[:n], self.counters[:n] + j, STREAM_SAMPLE)
        torch.where(temperature > 0, drawn, greedy_tokens(logits, self.draft_ids), out=out)

    @abstractmethod
    def absorbed(self, req, k: int, pending: int) -> int:
        """Tokens of req whose drafter KV stays trustworthy after drafting k (with `pending`
        tokens beyond its state, if all are committed; the commit trims it if not)."""

    @torch.inference_mode()
    def propose(self, plan: StepPlan, rows: list[int], ahead: Ahead | None = None) -> Drafts:
        reqs = [plan.requests[i] for i in rows]
        ks = [plan.draft_lens[i] for i in rows]
        pending = [ahead.commits[i] for i in rows] if ahead else [0] * len(rows)
        device, num_rows = self.runner.device, len(reqs)
        st = self.runner.sampling_tensors(reqs)
        sampled = not st.all_greedy
        if self.topk > 1 and max(ks) > 1:
            return self._propose_tree(plan, rows, st, pending, ahead)
        # Per row, the position the draft steps stop before (for `_draft_steps`). Every entry
        # of `self.limits` is written: a graph's padding rows must find limit 0, or they would
        # move and store through page-table rows left from other steps.
        limits = [self.next_position(r, k, n) for r, k, n in zip(reqs, ks, pending)] if max(ks) > 1 else []
        padded = limits + [0] * (len(self.limits) - len(limits)) if limits else []
        counters, rows_t, limits_t = to_device_parts([[r.num_output_tokens + n for r, n in zip(reqs, pending)]
                                                      if sampled else [], rows, padded], torch.int64, device)
        subset = rows_t if num_rows < len(plan.requests) else None
        _, state, rejected, absorbing = self._catch_up_rows(reqs, pending, st, counters if sampled else None,
                                                             subset, ahead)
        if limits:
            self.limits.copy_(limits_t)
            if rejected is not None:
                self.limits[:num_rows].sub_(rejected)
            self._draft(reqs, pending, max(limits), [r.pages for r in reqs], state, rejected, max(ks) - 1, sampled)
        tokens = self.drafted[:max(ks), :num_rows].t().contiguous()
        for r, k, n in zip(reqs, ks, pending):
            r.num_absorbed = self.absorbed(r, k, n)
        lens = [0] * len(plan.requests)
        for i, k in zip(rows, ks):
            lens[i] = k
        if num_rows < len(plan.requests):
            tokens = torch.zeros(len(plan.requests), max(ks), dtype=torch.int64, device=device).index_copy_(
                0, rows_t, tokens)
        return Drafts(tokens, lens, absorbing)

    def _catch_up_rows(self, reqs, pending: list[int], st, counters, rows_t, ahead: Ahead | None):
        """What chains and trees both start from: each row's sampling state (`counters`, its
        output index, on the device; None where greedy), then the drafter's catch-up over
        what it missed, absorbed in budget-sized forwards (`_absorb`) but for the tail the
        last forward feeds (`_run`). `rows_t`: the plan rows of `reqs` on the device (None:
        all of them). Returns that forward's logits and state, the tokens of a step in
        flight that verification will reject, per row (None where none is in flight), and
        the span of the absorbing forwards."""
        sampled, b = counters is not None, len(reqs)
        rejected = None
        if ahead and ahead.rejected is not None:
            rejected = ahead.rejected if rows_t is None else ahead.rejected[rows_t]
        if sampled:
            self.temperature[:b].copy_(st.temperature)
            self.seeds[:b].copy_(st.seeds)
            self.counters[:b].copy_(counters if rejected is None else counters - rejected)
        # A commit still to come may have raised num_absorbed past num_computed, which is
        # where the drafter's trusted KV ends.
        starts = [min(r.num_absorbed, r.num_computed) for r in reqs]
        ends = [self.catch_up_end(r, n) for r, n in zip(reqs, pending)]
        starts, absorbing = self._absorb(reqs, starts, ends)
        feeds, state = self.catch_up(reqs, starts, ends)
        input_ids = None
        if ahead:
            input_ids = with_device_tails(feeds, pending, ahead.tokens if rows_t is None else ahead.tokens[rows_t])
        logits, state = self._run(feeds, starts, [r.pages for r in reqs], state, input_ids, rejected, sampled)
        return logits, state, rejected, absorbing

    def _absorb(self, reqs, starts: list[int], ends: list[int]) -> tuple[list[int], Span | None]:
        """Absorb all but the last `tail` positions of every row's catch-up in forwards of at
        most `absorb_tokens` (the step's token budget), so that no forward grows with what the drafter missed
        (a whole prompt, or many K = 0 steps, for hundreds of rows): a row that does not fit
        in one forward's room goes on in the next. Returns where each row's catch-up now
        starts, and the span of these forwards (None without any). What is left is at most
        `feed_width(K)` tokens a row, all the drafting forward feeds (a graph's width); the
        placeholders of a step in flight (at most K + 1 a row) are among them."""
        tail = self.feed_width(self.runner.max_draft_len)
        todo = deque((i, s, e - tail) for i, (s, e) in enumerate(zip(starts, ends)) if e - s > tail)
        if not todo:
            return starts, None
        starts, span = list(starts), Span(self.runner.device)
        while todo:
            rows, room = [], self.absorb_tokens
            while todo and room:
                i, s, stop = todo.popleft()
                n = min(stop - s, room)
                rows.append((i, s, s + n))
                room -= n
                if s + n < stop:
                    todo.appendleft((i, s + n, stop))
                    break
            sub = [reqs[i] for i, _, _ in rows]
            feeds, state = self.catch_up(sub, [s for _, s, _ in rows], [e for _, _, e in rows])
            self.forward(ForwardBatch.build(feeds, [s for _, s, _ in rows], [r.pages for r in sub],
                                            self.runner.page_size, self.runner.device), state)
            for i, _, e in rows:
                starts[i] = e
        return starts, span.stop()

    def _run(self, feeds, starts, pages, state, input_ids, rejected, sampled: bool):
        """One catch-up forward (`_catch_up`), replayed from a graph when one fits; returns
        its logits at each row's last real token and its output state. `input_ids` (on the device) replace the fed tokens; `rejected[i]`
        tokens at the end of row i are not real, so its draft comes from before them."""
        def before_rejected(batch: ForwardBatch) -> None:
            batch.last_index[:len(feeds)].sub_(rejected.to(torch.int32))

        (logits, state), _ = forward_rows(self.catch_up_graphs.get(sampled),
                                          lambda batch, state: self._catch_up(batch, state, sampled),
                                          feeds, starts, pages, self.runner.page_size, self.runner.device, state,
                                          input_ids, adjust=None if rejected is None else before_rejected)
        return logits, state

    def _draft(self, reqs, pending, max_limit, pages, state, rejected, steps: int, sampled: bool) -> None:
        """The `steps` one-token steps after the catch-up (`_draft_steps`). Their inputs are
        set once, at each row's last catch-up position; each step then moves every row on by
        one position (`ForwardBatch.advance`, up to its entry of `self.limits`, the largest
        being `max_limit`) on the device, inside the graph when one fits: the host only
        replays. A row past its own K stays put and stores nothing (its drafts there are not
        used)."""
        runner, n = self.runner, len(reqs)
        feeds, starts = [[0]] * n, [self.next_position(r, 0, p) for r, p in zip(reqs, pending)]
        chains = self.draft_graphs.get(sampled)
        if chains and chains[0].fits(n, 1):
            key = chains[0].load(feeds, starts, pages, 1, state, rejected=rejected)
            chains[steps - 1].replay(key, n, n)
            return
        batch = ForwardBatch.build(feeds, starts, pages, runner.page_size, runner.device)
        if rejected is not None:
            batch.move_back(rejected, runner.page_size)
        batch.max_seq_len = max_limit
        self._draft_steps(batch, state, steps, sampled)

    def _draft_steps(self, batch: ForwardBatch, state: torch.Tensor | None, steps: int, sampled: bool):
        """`steps` draft steps. Step j feeds each row's draft j - 1 (`drafted`, read in place),
        moves the row on by one position, runs the drafter there and writes its draft j
        (`_pick`); its output state is the next step's input. Returns the last logits."""
        n = batch.num_seqs
        for j in range(1, steps + 1):
            batch.advance(self.limits[:n], self.runner.page_size)
            logits, out = self.forward(replace(batch, input_ids=self.drafted[j - 1, :n]), state)
            if state is not None:
                state.copy_(out)
            self._pick(logits, j, sampled)
        return logits

    # -- trees -----------------------------------------------------------------------------

    def _propose_tree(self, plan: StepPlan, rows: list[int], st, pending: list[int], ahead: Ahead | None) -> Drafts:
        """Trees of drafts for plan rows `rows`, K_i nodes each, grown as EAGLE-2 grows them
        (`_grow`) after the catch-up, where some row drafts two or more (one node a row is a
        chain: no growth, no walk, no KV move). A row of K_i nodes grows min(topk, K_i) wide and
        min(depth, K_i) deep (`SpecConfig.draft_depth`): the drafter keeps the KV of the nodes
        it feeds in the slots past the row's root that the scheduler keeps for it
        (`SpecConfig.draft_slots`), for the step; the target's KV for the tree goes to the
        first K_i of them, in its own tensors. The growth reads its inputs from the `tree_*`
        buffers and replays as one graph where one fits: the host sets them and replays.
        Planned ahead of a step in flight, the catch-up and the draft steps are moved back on
        the device as a chain's are (`pending`, `Ahead`)."""
        runner = self.runner
        device, width = runner.device, self.topk
        reqs = [plan.requests[i] for i in rows]
        ks = [plan.draft_lens[i] for i in rows]
        b, sampled = len(reqs), not st.all_greedy
        rows_t = to_device(rows, torch.int64, device) if b < len(plan.requests) else None
        counters = to_device_parts([[r.num_output_tokens + n for r, n in zip(reqs, pending)]], torch.int64,
                                   device)[0] if sampled else None
        logits, state, rejected, absorbing = self._catch_up_rows(reqs, pending, st, counters, rows_t, ahead)
        for r, n in zip(reqs, pending):
            r.num_absorbed = self.catch_up_end(r, n)  # the tree's drafter KV is scratch
        # The growth's inputs, a row per request (it repeats them for each fed node on the
        # device). Every entry of the row buffers is written: a graph's padding rows find
        # depth 0, so they grow nothing and store nowhere.
        widths = [min(width, k) for k in ks]
        depths = [runner.config.speculative_config.draft_depth(k) for k in ks]
        bases = [self.next_position(r, 1, n) for r, n in zip(reqs, pending)]
        padding = [0] * (len(self.tree_base) - b)
        base_t, depths_t, widths_t = to_device_parts([bases + padding, depths + padding, widths + padding],
                                                     torch.int64, device)
        self.tree_base.copy_(base_t)
        cols = max(len(r.pages) for r in reqs)
        table = np.zeros((b, cols), dtype=np.int32)  # (row by row: a flat list of b x cols ints is slower)
        for i, r in enumerate(reqs):
            table[i, :len(r.pages)] = r.pages
        table = torch.from_numpy(table)
        self.tree_pages[:b, :cols].copy_(table.pin_memory() if device.type == "cuda" else table, non_blocking=True)
        if rejected is not None:
            self.tree_base[:b].sub_(rejected)
        self.tree_depths.copy_(depths_t)
        self.tree_widths.copy_(widths_t)
        if st.simulated is not None:
            self.tree_simulated[:b].copy_(st.simulated)
        else:
            self.tree_simulated[:b, -1] = -1
        self.tree_logits[:b].copy_(logits)
        steps, nodes = max(depths) - 1, b * width
        if state is not None:
            state = state.repeat_interleave(width, 0)
        graphs = self.draft_graphs.get(sampled)
        if graphs and graphs[steps].fits(nodes, 1):  # (`_grow` sets every input but the state)
            key = graphs[steps].key(nodes, 1)
            if state is not None:
                graphs[steps].state[:nodes].copy_(state)
            grown, _ = graphs[steps].replay(key, nodes, b)  # per tree, not per fed node
            grown = [t.clone() for t in grown]  # (the next replay overwrites its outputs)
        else:
            def zeros(*shape, dtype=torch.int64):
                return torch.zeros(shape, dtype=dtype, device=device)

            batch = ForwardBatch(zeros(nodes), zeros(nodes), zeros(nodes + 1, dtype=torch.int32),
                                 zeros(nodes, dtype=torch.int32), zeros(nodes, dtype=torch.int32),
                                 zeros(nodes, cols, dtype=torch.int32), zeros(nodes), max_query_len=1,
                                 max_seq_len=max(bases) + steps * width + 1, tree_mask=zeros(nodes),
                                 tree_start=zeros(nodes, dtype=torch.int32))
            grown = self._grow(batch, state, steps, sampled)
        most = max(ks)
        tokens, parents, depth, ancestors = grown
        tokens, tree = tokens[:, :most], Tree(parents[:, :most], depth[:, :1 + most], ancestors[:, :1 + most])
        lens = [0] * len(plan.requests)
        for i, k in zip(rows, ks):
            lens[i] = k
        if rows_t is not None:  # the rows that draft nothing get a tree of their own too (the root's mask)
            tokens = tokens.new_zeros(len(plan.requests), most).index_copy_(0, rows_t, tokens)
            every = Tree.flat(len(plan.requests), most, device)
            for field in ("parents", "depth", "ancestors"):
                getattr(every, field).index_copy_(0, rows_t, getattr(tree, field))
            tree = every
        return Drafts(tokens, lens, absorbing, tree)

    def _grow(self, batch: ForwardBatch, state: torch.Tensor | None, steps: int, sampled: bool):
        """Grow each row's tree `steps` draft steps deep from its catch-up's logits, on the
        device alone (so it replays as a graph): each step feeds the `topk` best nodes of the
        depth before (by cumulative draft log-probability), each as a one-token row of
        `batch`, and gives each its `topk` likeliest tokens (`_children`); the best
        `max_draft_len` of all the nodes grown are returned, best first: tokens [rows, M],
        parents [rows, M] (query indices, 0: the root), and the depth and ancestors [rows, 1 +
        M] of their `Tree`, found inside the growth's graph. A child never scores above its
        parent and comes after it among the nodes grown, so the best M of a tree are a tree.
        Rows past their depth grow nothing; `state` (a row per fed node) is updated in place.
        Every other input of `batch` is set here: its rows are one token each, and row r
        reads request r // topk's page table."""
        width, device = self.topk, batch.input_ids.device
        b = batch.num_seqs // width
        fed = torch.arange(width, device=device)
        one_each = torch.arange(batch.num_seqs + 1, dtype=torch.int32, device=device)
        batch.query_start_loc.copy_(one_each)
        batch.last_index.copy_(one_each[:-1])
        batch.page_table.copy_(self.tree_pages[:b, :batch.page_table.shape[1]].repeat_interleave(width, 0))
        # Every node grown, depth by depth: its token, cumulative draft log-probability and
        # parent (its index among the nodes; -1: the root). The nodes fed next (`front`)
        # carry their scratch slots' mask.
        score, token = self._children(self.tree_logits[:b], b, 0, sampled)
        tokens, scores = [token], [score.masked_fill(fed >= self.tree_widths[:b, None], float("-inf"))]
        parents = [torch.full((b, width), -1, dtype=torch.int64, device=device)]
        front = fed.expand(b, width)
        front_mask, front_token = 1 << front, token
        grown = width
        for d in range(1, steps + 1):
            live = d < self.tree_depths[:b]
            self._place(batch, d, live, front_token, front_mask)
            logits, out = self.forward(batch, state)
            score, token = self._children(logits, b, d, sampled)  # [b * width, width]
            score = (torch.cat(scores, 1).gather(1, front).reshape(-1, 1) + score).view(b, width * width)
            score = score.masked_fill(~live[:, None], float("-inf"))
            tokens.append(token.view(b, width * width))
            scores.append(score)
            parents.append(front.repeat_interleave(width, 1))
            best = score.topk(width, dim=1).indices  # the next step's fed nodes, among these
            front = grown + best
            front_mask = front_mask.gather(1, best // width) | (1 << (d * width + fed))
            front_token = tokens[-1].gather(1, best)
            if out is not None:
                state.copy_(out.view(b, width, -1).gather(1, (best // width)[:, :, None].expand(-1, -1, out.shape[-1]))
                            .view(b * width, -1))
            grown += width * width
        tokens, scores, parents = torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)
        m = min(self.runner.max_draft_len, scores.shape[1])
        best = scores.argsort(dim=1, descending=True, stable=True)[:, :m]
        rank = torch.full_like(parents, -1).scatter_(1, best, torch.arange(m, device=device).expand(b, m).contiguous())
        parent = parents.gather(1, best)
        tree = Tree.of(torch.where(parent >= 0, rank.gather(1, parent.clamp(min=0)) + 1, 0))  # (in the graph)
        return tokens.gather(1, best), tree.parents, tree.depth, tree.ancestors

    def _place(self, batch: ForwardBatch, d: int, live: torch.Tensor, tokens: torch.Tensor, masks: torch.Tensor):
        """Set `batch` for draft step d of the trees: row i's fed node f (tokens, masks [b,
        width]) at draft position d's position, stored in scratch slot `base + (d - 1) *
        width + f` past the row's root, seeing the context and its ancestors' slots only
        (masks: bit j = slot base + j). A node that does not grow (its row not `live`, or
        past its width) stores nowhere."""
        width, ps = self.topk, self.runner.page_size
        b = len(live)
        base = self.tree_base[:b, None]
        stored = live[:, None] & (torch.arange(width, device=live.device) < self.tree_widths[:b, None])
        index = torch.where(stored, base + (d - 1) * width + torch.arange(width, device=live.device), base).view(-1)
        page = batch.page_table.gather(1, (index // ps)[:, None])[:, 0]
        batch.input_ids.copy_(tokens.reshape(-1))
        batch.positions.copy_((base + d - 1).expand(b, width).reshape(-1))
        batch.seq_lens.copy_(index + 1)
        batch.slot_mapping.copy_(torch.where(stored.view(-1), page * ps + index % ps, -1))
        batch.tree_mask.copy_(masks.reshape(-1))
        batch.tree_start.copy_(base.expand(b, width).reshape(-1))

    def _children(self, logits: torch.Tensor, rows: int, d: int, sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each fed node's `topk` best next tokens (target ids), and the log of how likely
        each is to be the target's token there. A greedy row's are the drafter's likeliest,
        at their draft probabilities (the target takes its argmax). A sampled row's are the
        first in the race its target draw at depth d + 1 runs (the noise of output index
        counter + d: the first is what `_pick` draws), at a softmax over the race's keys (log
        q + Gumbel noise): were the target's logits the drafter's, the first would win
        surely; a Gumbel's worth of doubt about them spreads the odds over the runners-up.
        Under simulated acceptance (benchmarks; `verify`) the odds are the simulation's, so
        the tree has the shape a drafter that knew them would grow. logits [rows * group,
        V_draft], a row's fed nodes together."""
        group = logits.shape[0] // rows
        if sampled:
            values, ids = race_top_k(logits, self.topk, self.temperature[:rows], self.seeds[:rows],
                                     self.counters[:rows] + d, self.draft_ids)
        else:
            values, ids = race_top_k(logits, self.topk, lookup=self.draft_ids)
        simulated = self.tree_simulated[:rows].repeat_interleave(group, 0)
        sibling = simulated[:, -1:]
        odds = torch.where(sibling >= 0, torch.log(simulated[:, min(d, simulated.shape[1] - 2), None]
                                                   * sibling ** torch.arange(self.topk, device=logits.device)),
                           values)
        return odds.clamp(min=-1e4), ids
