"""CUDA graphs for decode, verification and drafting steps (`CudaGraphs`), and for steps
that carry prompt tokens (`PiecewiseGraphs`, below).

One graph per (batch bucket, tokens per request W). For the target, W = 1 is the plain
decode and W = 1 + K verifies up to K drafts per request; drafters capture their catch-up
(W up to K + 1) the same way, and their one-token draft steps as one set per number of
steps chained in a graph (the sets share one memory pool and one set of inputs). A step
replays the smallest graph that fits it: requests beyond the real ones have no tokens and
an empty context, tokens beyond the real ones write nowhere (slot -1). The plain decode
graph is the same whether or not speculation is configured. Graphs of one set share a
memory pool and one set of input buffers (ids, positions, batch metadata and, for
drafters, an input state).
"""

from __future__ import annotations

from typing import Callable

import torch

from tidal.batch import ForwardBatch, HostBatch, row_fields, token_fields

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphs:
    def __init__(self, forward: Callable[[ForwardBatch, torch.Tensor | None], object], page_size: int,
                 max_model_len: int, max_batch: int, max_width: int, device: torch.device,
                 state_width: int = 0, state_dtype: torch.dtype | None = None, per_row: bool = False,
                 inputs_of: "CudaGraphs | None" = None, trees: bool = False, group: int = 1):
        """forward(batch, state) runs the model; its outputs are per token, or per request
        when `per_row` (e.g. a drafter's logits at each request's last token). With
        `inputs_of`, the graphs read that set's input buffers (so one `load` serves both).
        With `trees`, the batches carry tree inputs (`ForwardBatch.tree_mask`), which every
        `load` resets to none and a step with trees then sets. Requests that come `group`
        to a request of the step (a drafter's fed nodes of a tree) fill buckets of
        multiples of `group`."""
        self.forward = forward
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.device = device
        self.per_row = per_row
        self.buckets = [group * b for b in BATCH_BUCKETS if group * b < max_batch] + [max_batch]
        self.widths = list(range(1, max_width + 1))
        max_tokens = max_batch * max_width
        if inputs_of is not None:
            self.tokens, self.rows, self.page_table, self.state = (inputs_of.tokens, inputs_of.rows,
                                                                   inputs_of.page_table, inputs_of.state)
        else:
            # The inputs, laid out as `HostBatch` lays them out for each graph's shape, so that
            # a step fills them in three host-to-device copies.
            self.tokens = torch.zeros(HostBatch.tokens_len_for(max_tokens), dtype=torch.int64, device=device)
            self.rows = torch.zeros(HostBatch.rows_len_for(max_batch), dtype=torch.int32, device=device)
            self.page_table = torch.zeros(max_batch, -(-max_model_len // page_size), dtype=torch.int32,
                                          device=device)
            self.state = (torch.zeros(max_tokens, state_width, dtype=state_dtype, device=device)
                          if state_width else None)
        if inputs_of is not None:
            self.tree_mask, self.tree_start = inputs_of.tree_mask, inputs_of.tree_start
        else:
            self.tree_mask = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if trees else None
            self.tree_start = torch.zeros(max_batch, dtype=torch.int32, device=device) if trees else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, ForwardBatch, object]] = {}

    def view(self, b: int, w: int) -> ForwardBatch:
        ids, positions, slots = token_fields(self.tokens, b * w)
        query_start_loc, seq_lens, last_index = row_fields(self.rows, b)
        batch = ForwardBatch(ids, positions, query_start_loc, seq_lens, last_index, self.page_table[:b], slots,
                             max_query_len=w, max_seq_len=self.max_model_len)
        if self.tree_mask is not None:
            batch.tree_mask, batch.tree_start = self.tree_mask[:b * w], self.tree_start[:b]
        return batch

    def blank_inputs(self, b: int, w: int) -> ForwardBatch:
        """The inputs of graph (b, w) as its capture runs it: b rows of w tokens that store
        nowhere (graphs' inputs overlap: what another left here is cleared)."""
        batch = self.view(b, w)
        batch.input_ids.zero_()
        batch.positions.zero_()
        batch.slot_mapping.fill_(-1)
        batch.query_start_loc.copy_(torch.arange(0, b * w + 1, w, dtype=torch.int32))
        batch.seq_lens.fill_(w)
        batch.last_index.copy_(torch.arange(w - 1, b * w, w, dtype=torch.int32))
        return batch

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every graph (into `pool`, if given). Returns the memory pool."""
        stream = torch.cuda.Stream(self.device)
        for w in reversed(self.widths):          # largest first: later graphs reuse its memory
            for b in reversed(self.buckets):
                batch = self.blank_inputs(b, w)
                state = None if self.state is None else self.state[:b * w]
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward(batch, state)  # compile and warm up
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(batch, state)
                pool = graph.pool()
                self.graphs[(b, w)] = (graph, batch, out)
        torch.cuda.synchronize(self.device)
        return pool

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1] and width <= self.widths[-1]

    def load(self, feeds: list[list[int]], context_lens: list[int], page_tables: list[list[int]], width: int,
             state: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
             rejected: torch.Tensor | None = None) -> tuple[int, int]:
        """Fill the inputs of the graph for these rows (`input_ids` on the device, if given,
        replace the fed tokens; `rejected` moves rows back, `ForwardBatch.move_back`).
        Returns that graph's key."""
        b, _ = self.key(len(feeds), width)
        host = HostBatch(feeds, context_lens, page_tables, self.page_size, pin=self.device.type == "cuda",
                         pad_seqs=b, pad_tokens=b * width)
        self.tokens[:host.tokens_len].copy_(host.tokens(host.buffer), non_blocking=True)
        self.rows[:host.rows_len].copy_(host.rows(host.buffer), non_blocking=True)
        rows, cols = host.table_shape
        self.page_table[:rows, :cols].copy_(host.page_table(host.buffer), non_blocking=True)
        num_tokens = sum(len(f) for f in feeds)
        if input_ids is not None:
            self.tokens[:num_tokens].copy_(input_ids)  # input ids come first in every layout
        if state is not None:
            self.state[:num_tokens].copy_(state)
        if rejected is not None:
            self.inputs((b, width)).move_back(rejected, self.page_size)
        if self.tree_mask is not None:  # no trees unless the step's own (`TreeInputs.apply`)
            self.tree_mask.fill_(-1)
            self.tree_start.fill_(torch.iinfo(torch.int32).max)
        return b, width

    def key(self, num_seqs: int, width: int) -> tuple[int, int]:
        """The key of the graph that runs this many rows of this width."""
        return next(size for size in self.buckets if size >= num_seqs), width

    def inputs(self, key: tuple[int, int]) -> ForwardBatch:
        """The input buffers the graph of this key reads."""
        return self.graphs[key][1]

    def replay(self, key: tuple[int, int], num_tokens: int, num_seqs: int):
        """Replay a loaded graph. Returns the outputs of the real tokens (or rows) and their
        slot mapping."""
        graph, batch, out = self.graphs[key]
        graph.replay()
        n = num_seqs if self.per_row else num_tokens
        if isinstance(out, tuple):
            return tuple(o if o is None else o[:n] for o in out), batch.slot_mapping[:num_tokens]
        return out[:n], batch.slot_mapping[:num_tokens]

    def run(self, feeds: list[list[int]], context_lens: list[int], page_tables: list[list[int]], width: int,
            state: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
            rejected: torch.Tensor | None = None):
        """`load`, then `replay`."""
        key = self.load(feeds, context_lens, page_tables, width, state, input_ids, rejected)
        return self.replay(key, sum(len(f) for f in feeds), len(feeds))


# Token counts of the piecewise graphs up to 1,024; `piecewise_buckets` adds four a doubling
# above, up to the step budget but not past PIECEWISE_MAX_TOKENS. Steps with more tokens run
# eagerly: there the GPU's work outlasts the host's launches, which do not grow with the
# tokens (docs/design.md, "Graphs for steps with prompt tokens").
PIECEWISE_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
PIECEWISE_MAX_TOKENS = 4096


def piecewise_buckets(max_tokens: int) -> list[int]:
    """The token buckets of a step budget of `max_tokens`: PIECEWISE_BUCKETS, then each a
    quarter of a power of two past the one before (1,280, 1,536, ... 2,560, 3,072, ...), so
    that padding costs a long step at most a quarter of its work; the last is the budget
    itself, or PIECEWISE_MAX_TOKENS."""
    top = min(max_tokens, PIECEWISE_MAX_TOKENS)
    sizes, t = list(PIECEWISE_BUCKETS), PIECEWISE_BUCKETS[-1]
    while t < top:
        t += 2 ** (t.bit_length() - 1) // 4
        sizes.append(t)
    return [t for t in sizes if t < top] + [top]


class PiecewiseGraphs:
    """CUDA graphs for the steps `CudaGraphs` does not serve: prompt chunks, alone or
    beside decodes. Their attention needs the step's own grids, so the forward is cut at
    each attention call: what lies between two calls (norms, projections, MLP) replays from
    a graph captured per token bucket, and attention runs eagerly between the pieces on
    the step's batch, padded to the bucket with tokens that store nowhere. A graph reads
    the attention output from one static buffer, which every attention call writes into."""

    def __init__(self, model: torch.nn.Module, attn, kv_caches: list[torch.Tensor], max_tokens: int,
                 page_size: int, device: torch.device):
        self.model, self.attn, self.kv_caches = model, attn, kv_caches
        self.page_size = page_size
        self.device = device
        self.buckets = piecewise_buckets(max_tokens)
        self.input_ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.attn_out: torch.Tensor | None = None  # [max bucket, heads, head_dim], allocated at the first cut
        # bucket -> (graphs, the attention calls between them, the last graph's outputs)
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[tuple], object]] = {}

    def bucket(self, num_tokens: int) -> int | None:
        """The token bucket a step of this many tokens replays, None if it runs eagerly."""
        return next((t for t in self.buckets if t >= num_tokens), None)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for t in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            # One request of t tokens on the null page: the recording run attends for real.
            batch = ForwardBatch.build([[0] * t], [0], [[0] * -(-t // self.page_size)], self.page_size, self.device)
            ids = self.input_ids[:t]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.model(ids, batch, self.kv_caches)  # compile and warm up
                recorder = _Recorder(self, pool)
                out = recorder.record(lambda: self.model(ids, batch, self.kv_caches))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.pieces[t] = (recorder.graphs, recorder.calls, out)
        torch.cuda.synchronize(self.device)

    def run(self, batch: ForwardBatch, num_tokens: int):
        """Replay the pieces of batch.num_tokens (a bucket; the first `num_tokens` are real)
        around attention on `batch`. Returns the outputs of the real tokens."""
        graphs, calls, out = self.pieces[batch.num_tokens]
        self.input_ids[:batch.num_tokens].copy_(batch.input_ids)
        attn_out = self.attn_out[:batch.num_tokens]
        graphs[0].replay()
        for (q, k, v, kv_cache, scale, rotary, qk_norm), graph in zip(calls, graphs[1:]):
            self.attn.forward(q, k, v, kv_cache, batch, scale, rotary, out=attn_out, qk_norm=qk_norm)
            graph.replay()
        if isinstance(out, tuple):
            return tuple(o[:num_tokens] for o in out)
        return out[:num_tokens]


class _Recorder:
    """Stands in for the attention backend while a forward is recorded: each call ends the
    graph being captured, runs attention eagerly into the static output buffer, notes its
    inputs (which live in the graphs' memory) and begins the next graph."""

    def __init__(self, owner: PiecewiseGraphs, pool):
        self.owner, self.pool = owner, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple] = []

    def record(self, forward: Callable[[], object]):
        modules = [m for m in self.owner.model.modules() if getattr(m, "attn", None) is self.owner.attn]
        for m in modules:
            m.attn = self
        try:
            self._begin()
            out = forward()
            self.graphs[-1].capture_end()
        finally:
            for m in modules:
                m.attn = self.owner.attn
        return out

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def forward(self, q, k, v, kv_cache, batch, scale, rotary=None, out=None, qk_norm=None):
        self.graphs[-1].capture_end()
        owner = self.owner
        if owner.attn_out is None:
            owner.attn_out = torch.zeros(owner.buckets[-1], *q.shape[1:], dtype=q.dtype, device=q.device)
        out = owner.attn_out[:q.shape[0]]
        owner.attn.forward(q, k, v, kv_cache, batch, scale, rotary, out=out, qk_norm=qk_norm)
        self.calls.append((q, k, v, kv_cache, scale, rotary, qk_norm))
        self._begin()
        return out


def forward_rows(graphs: CudaGraphs | None, eager: Callable[[ForwardBatch, torch.Tensor | None], object],
                 feeds: list[list[int]], contexts: list[int], pages: list[list[int]], page_size: int,
                 device: torch.device, state: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                 adjust: Callable[[ForwardBatch], None] | None = None, pad_tokens: int = 0):
    """One forward over these rows, the target's or a drafter's: replayed from `graphs`
    where one fits, else `eager` on a batch built for it (padded to `pad_tokens`).
    `input_ids` (on the device) replace the fed tokens; `adjust` edits the batch's
    inputs on the device before it runs (rows moved back by the drafts a step in flight
    rejected). Returns the forward's outputs for the real tokens (or rows) and their
    slot mapping."""
    num_tokens, width = sum(len(f) for f in feeds), max(len(f) for f in feeds)
    if graphs is not None and graphs.fits(len(feeds), width):
        key = graphs.load(feeds, contexts, pages, width, state, input_ids)
        if adjust is not None:
            adjust(graphs.inputs(key))
        return graphs.replay(key, num_tokens, len(feeds))
    batch = ForwardBatch.build(feeds, contexts, pages, page_size, device, pad_tokens=pad_tokens)
    if input_ids is not None:
        batch.input_ids[:num_tokens].copy_(input_ids)
    if adjust is not None:
        adjust(batch)
    return eager(batch, state), batch.slot_mapping[:num_tokens]
