"""CUDA graphs for decode, verification and drafting steps.

One graph per (batch bucket, tokens per request W). For the target, W = 1 is the plain
decode and W = 1 + K verifies up to K drafts per request; drafters capture their catch-up
(W up to K + 1) and their one-token draft steps the same way. A step replays the smallest
graph that fits it: requests beyond the real ones have no tokens and an empty context,
tokens beyond the real ones write nowhere (slot -1). The plain decode graph is the same
whether or not speculation is configured. Graphs of one set share a memory pool and one
set of input buffers (ids, positions, batch metadata and, for drafters, an input state).
"""

from __future__ import annotations

from typing import Callable

import torch

from tidal.batch import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphs:
    def __init__(self, forward: Callable[[ForwardBatch, torch.Tensor | None], object], page_size: int,
                 max_model_len: int, max_batch: int, max_width: int, device: torch.device,
                 state_width: int = 0, state_dtype: torch.dtype | None = None, per_row: bool = False):
        """forward(batch, state) runs the model; its outputs are per token, or per request
        when `per_row` (e.g. a drafter's logits at each request's last token)."""
        self.forward = forward
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.device = device
        self.per_row = per_row
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.widths = list(range(1, max_width + 1))
        max_tokens = max_batch * max_width
        max_pages = -(-max_model_len // page_size)
        self.static = ForwardBatch(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
            page_table=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            max_query_len=max_width,
            max_seq_len=max_model_len,
        )
        self.state = (torch.zeros(max_tokens, state_width, dtype=state_dtype, device=device)
                      if state_width else None)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}

    def view(self, b: int, w: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(s.input_ids[:b * w], s.positions[:b * w], s.query_start_loc[:b + 1], s.seq_lens[:b],
                            s.page_table[:b], s.slot_mapping[:b * w], max_query_len=w,
                            max_seq_len=self.max_model_len)

    def state_view(self, num_tokens: int) -> torch.Tensor | None:
        return None if self.state is None else self.state[:num_tokens]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.device)
        for w in reversed(self.widths):          # largest first: later graphs reuse its memory
            for b in reversed(self.buckets):
                batch, state = self.view(b, w), self.state_view(b * w)
                batch.query_start_loc.copy_(torch.arange(0, b * w + 1, w, dtype=torch.int32))
                batch.seq_lens.fill_(w)
                batch.slot_mapping.fill_(-1)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward(batch, state)  # compile and warm up
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(batch, state)
                pool = graph.pool()
                self.graphs[(b, w)] = (graph, out)
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1] and width <= self.widths[-1]

    def run(self, feeds: list[list[int]], context_lens: list[int], page_tables: list[list[int]], width: int,
            state: torch.Tensor | None = None, input_ids: torch.Tensor | None = None):
        """Replay the graph for these rows (`input_ids` on the device, if given, replace the
        fed tokens). Returns the outputs of the real tokens (or rows) and their slot mapping."""
        b = next(size for size in self.buckets if size >= len(feeds))
        batch = ForwardBatch.build(feeds, context_lens, page_tables, self.page_size, self.device,
                                   pad_seqs=b, pad_tokens=b * width)
        view = self.view(b, width)
        for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping"):
            getattr(view, name).copy_(getattr(batch, name))
        view.page_table[:, :batch.page_table.shape[1]].copy_(batch.page_table)
        num_tokens = sum(len(f) for f in feeds)
        if input_ids is not None:
            view.input_ids[:num_tokens].copy_(input_ids)
        if state is not None:
            self.state[:num_tokens].copy_(state)
        graph, out = self.graphs[(b, width)]
        graph.replay()
        n = len(feeds) if self.per_row else num_tokens
        if isinstance(out, tuple):
            return tuple(o if o is None else o[:n] for o in out), view.slot_mapping[:num_tokens]
        return out[:n], view.slot_mapping[:num_tokens]
