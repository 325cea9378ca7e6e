"""ForwardBatch: the flat tensors one forward pass needs, built from a StepPlan.

Every request contributes a contiguous run of query tokens (a prefill chunk, one decode
token, or a decode token followed by K draft tokens to verify). The query tokens of request
i are the last `query_lens[i]` positions of its context of `seq_lens[i]` tokens, so causal
attention is "query j of request i sees keys 0 .. seq_lens[i] - query_lens[i] + j".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host data as a device tensor, copied without waiting for the device. A plain
    `torch.tensor(data, device=...)` synchronises the stream, so the host stops queueing
    work until the GPU has drained; a copy from pinned memory does not."""
    if torch.device(device).type == "cuda":
        return to_host_pinned(data, dtype).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype)


def to_host_pinned(data, dtype: torch.dtype) -> torch.Tensor:
    """Host data in pinned memory, the source of a copy to the device that does not wait.
    PyTorch's pinned allocator keeps the block until that copy has run."""
    return torch.tensor(data, dtype=dtype).pin_memory()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64, all query tokens of all requests, flat
    positions: torch.Tensor        # [T] int64, position of each query token in its sequence
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (query_start_loc[0] = 0)
    seq_lens: torch.Tensor         # [B] int32, context length including this step's tokens
    page_table: torch.Tensor       # [B, max_pages] int32, page ids of each request (padded with 0)
    slot_mapping: torch.Tensor     # [T] int64, KV slot (page * page_size + offset) per token; -1 = skip
    max_query_len: int             # host copies of the maxima, so kernels pick grids without a sync
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @staticmethod
    def build(
        token_ids: list[list[int]],
        context_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device | str,
    ) -> "ForwardBatch":
        """Build from per-request query tokens, the number of tokens already in the KV cache
        before them, and each request's page table."""
        tokens, rows, table = host_parts(token_ids, context_lens, page_tables, page_size)
        # Two host-to-device copies for all of it (each copy costs the host more than a kernel).
        ids, pos, slot_mapping = to_device(tokens, torch.int64, device).view(3, -1)
        n = len(token_ids)
        rows = to_device(rows, torch.int32, device)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start_loc=rows[:n + 1],
            seq_lens=rows[n + 1:],
            page_table=to_device(table, torch.int32, device),
            slot_mapping=slot_mapping,
            max_query_len=max(len(t) for t in token_ids),
            max_seq_len=max(c + len(t) for c, t in zip(context_lens, token_ids)),
        )

    def advance(self, limits: torch.Tensor, page_size: int) -> None:
        """For a batch of one query token per request: move each request's token to the next
        position while that stays below its limit; a request at its limit stays put and
        stores nothing. A drafter's steps after the first reuse one batch (or one graph's
        inputs) this way, without the host."""
        step = self.positions + 1 < limits
        self.positions.add_(step)
        self.seq_lens.add_(step)
        pages = self.page_table.gather(1, (self.positions // page_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping.copy_(torch.where(step, pages * page_size + self.positions % page_size, -1))


def host_parts(token_ids: list[list[int]], context_lens: list[int], page_tables: list[list[int]], page_size: int,
               pad_seqs: int = 0, pad_tokens: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """A batch's fields as host lists: input ids, positions and slot mapping one after the
    other (each `max(T, pad_tokens)` long); query_start_loc then seq_lens (for
    `max(B, pad_seqs)` requests); page tables padded to a common width. Padding (for a
    captured graph) adds requests with no tokens, and tokens that belong to no request and
    store nowhere."""
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens = []
    for tokens, ctx, pages in zip(token_ids, context_lens, page_tables):
        for pos in range(ctx, ctx + len(tokens)):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        starts.append(starts[-1] + len(tokens))
        seq_lens.append(ctx + len(tokens))
    extra_tokens = max(pad_tokens - len(positions), 0)
    extra_seqs = max(pad_seqs - len(seq_lens), 0)
    width = max(len(p) for p in page_tables)
    table = [p + [0] * (width - len(p)) for p in page_tables]
    tokens = ([t for ids in token_ids for t in ids] + [0] * extra_tokens + positions + [0] * extra_tokens
              + slots + [-1] * extra_tokens)
    return tokens, starts + [starts[-1]] * extra_seqs + seq_lens + [0] * extra_seqs, table
