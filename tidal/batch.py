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
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


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
        pad_seqs: int = 0,
        pad_tokens: int = 0,
    ) -> "ForwardBatch":
        """Build from per-request query tokens, the number of tokens already in the KV cache
        before them, and each request's page table. Padding (for a captured graph) adds
        requests with no tokens and tokens that belong to no request and write nowhere."""
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
        flat_ids = [t for tokens in token_ids for t in tokens]
        extra_tokens = max(pad_tokens - len(flat_ids), 0)
        extra_seqs = max(pad_seqs - len(seq_lens), 0)
        width = max(len(p) for p in page_tables)
        table = [page for p in page_tables for page in p + [0] * (width - len(p))] + [0] * (width * extra_seqs)
        parts = [flat_ids + [0] * extra_tokens, positions + [0] * extra_tokens, slots + [-1] * extra_tokens,
                 starts + [starts[-1]] * extra_seqs, seq_lens + [0] * extra_seqs, table]
        # One host-to-device copy for all of it (each copy costs the host more than a kernel).
        flat = to_device([x for part in parts for x in part], torch.int64, device)
        ids, pos, slot_mapping, query_start_loc, lens, pages = flat.split([len(part) for part in parts])
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start_loc=query_start_loc.int(),
            seq_lens=lens.int(),
            page_table=pages.view(len(page_tables) + extra_seqs, width).int(),
            slot_mapping=slot_mapping,
            max_query_len=max(len(t) for t in token_ids),
            max_seq_len=max(seq_lens),
        )
