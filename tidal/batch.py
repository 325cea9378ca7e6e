"""ForwardBatch: the flat tensors one forward pass needs, built from a StepPlan.

Every request contributes a contiguous run of query tokens (a prefill chunk, one decode
token, or a decode token followed by K draft tokens to verify). The query tokens of request
i are the last `query_lens[i]` positions of its context of `seq_lens[i]` tokens, so causal
attention is "query j of request i sees keys 0 .. seq_lens[i] - query_lens[i] + j".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        table = [p + [0] * (width - len(p)) for p in page_tables] + [[0] * width] * extra_seqs

        def as_tensor(data, dtype):
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=as_tensor(flat_ids + [0] * extra_tokens, torch.int64),
            positions=as_tensor(positions + [0] * extra_tokens, torch.int64),
            query_start_loc=as_tensor(starts + [starts[-1]] * extra_seqs, torch.int32),
            seq_lens=as_tensor(seq_lens + [0] * extra_seqs, torch.int32),
            page_table=as_tensor(table, torch.int32),
            slot_mapping=as_tensor(slots + [-1] * extra_tokens, torch.int64),
            max_query_len=max(len(t) for t in token_ids),
            max_seq_len=max(seq_lens),
        )
