"""ForwardBatch: the flat tensors one forward pass needs, built from a StepPlan.

Every request contributes a contiguous run of query tokens (a prefill chunk, one decode
token, or a decode token followed by K draft tokens to verify). The query tokens of request
i are the last `query_lens[i]` positions of its context of `seq_lens[i]` tokens, so causal
attention is "query j of request i sees keys 0 .. seq_lens[i] - query_lens[i] + j".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host data as a device tensor, copied without waiting for the device. A plain
    `torch.tensor(data, device=...)` synchronises the stream, so the host stops queueing
    work until the GPU has drained; a copy from pinned memory does not."""
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def to_device_parts(parts: list[list[int]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Several host lists as device tensors, in one copy (`to_device`), each starting 16-byte
    aligned: Triton builds a kernel for each alignment of its pointers, so a part that
    started where the lists before it happened to end would build another in a user's step."""
    unit = max(1, 16 // dtype.itemsize)
    padding = [-len(part) % unit for part in parts]
    joined = to_device([x for part, pad in zip(parts, padding) for x in part + [0] * pad], dtype, device)
    views = joined.split([len(part) + pad for part, pad in zip(parts, padding)])
    return [view[:len(part)] for part, view in zip(parts, views)]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64, all query tokens of all requests, flat
    positions: torch.Tensor        # [T] int64, position of each query token in its sequence
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (query_start_loc[0] = 0)
    seq_lens: torch.Tensor         # [B] int32, context length including this step's tokens
    last_index: torch.Tensor       # [B] int32, each request's last real query token (its logits row)
    page_table: torch.Tensor       # [B, max_pages] int32, page ids of each request (padded with 0)
    slot_mapping: torch.Tensor     # [T] int64, KV slot (page * page_size + offset) per token; -1 = skip
    max_query_len: int             # host copies of the maxima, so kernels pick grids without a sync
    max_seq_len: int
    # Trees of drafts (None: causal only). A key at index L >= tree_start[i] of request i is
    # seen by query token t only if bit L - tree_start[i] of tree_mask[t] is set (-1: all).
    tree_mask: torch.Tensor | None = None   # [T] int64
    tree_start: torch.Tensor | None = None  # [B] int32

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
        pad_tokens: int = 0,
    ) -> "ForwardBatch":
        """Build from per-request query tokens, the number of tokens already in the KV cache
        before them, and each request's page table: one host-to-device copy for all of it
        (each copy costs the host more than a kernel). `pad_tokens` pads the tokens to that
        many with ones that belong to no request and store nowhere."""
        host = HostBatch(token_ids, context_lens, page_tables, page_size, pin=torch.device(device).type == "cuda",
                         pad_tokens=pad_tokens)
        buffer = host.buffer.to(device, non_blocking=True)
        ids, positions, slots = token_fields(host.tokens(buffer), host.num_tokens)
        query_start_loc, seq_lens, last_index = row_fields(host.rows(buffer), host.num_seqs)
        return ForwardBatch(ids, positions, query_start_loc, seq_lens, last_index, host.page_table(buffer), slots,
                            max_query_len=host.max_query_len, max_seq_len=host.max_seq_len)

    def at_last_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of x [T, ...] at each request's last query token: x itself when every
        request has one (a drafter's one-token steps), with no gather."""
        return x if self.max_query_len == 1 else x[self.last_index]

    def advance(self, limits: torch.Tensor, page_size: int) -> None:
        """For a batch of one query token per request: move each request's token to the next
        position while that stays below its limit; a request at its limit stays put and
        stores nothing. A drafter's steps after the first reuse one batch (or one graph's
        inputs) this way, without the host."""
        if limits.is_cuda:
            from tidal import batch_kernels

            batch_kernels.advance(limits, self.seq_lens, self.positions, self.slot_mapping, self.page_table, page_size)
            return
        step = self.positions + 1 < limits
        self.positions.add_(step)
        self.seq_lens.add_(step)
        pages = self.page_table.gather(1, (self.positions // page_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping.copy_(torch.where(step, pages * page_size + self.positions % page_size, -1))

    def move_back(self, rejected: torch.Tensor, page_size: int) -> None:
        """Move request i's tokens `rejected[i]` positions back (a device tensor: the drafts
        the step before rejected). A step planned ahead of a drafting one is built as if
        every draft there were accepted; this puts its rows where they really are, without
        the host. Tokens that store nowhere still store nowhere."""
        if rejected.is_cuda:
            from tidal import batch_kernels

            batch_kernels.move_back(rejected, self.query_start_loc, self.seq_lens, self.positions,
                                    self.slot_mapping, self.page_table, page_size)
            return
        n = rejected.shape[0]
        token = torch.arange(self.num_tokens, dtype=torch.int32, device=rejected.device)
        rows = torch.searchsorted(self.query_start_loc[1:n + 1], token, right=True)
        real = rows < n
        rows = rows.clamp(max=n - 1)
        self.positions.sub_(torch.where(real, rejected[rows], 0))
        self.seq_lens[:n].sub_(rejected.to(self.seq_lens.dtype))
        pages = self.page_table[rows, self.positions // page_size]
        self.slot_mapping.copy_(torch.where(real & (self.slot_mapping >= 0),
                                            pages * page_size + self.positions % page_size, -1))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostBatch:
    """A batch's index data packed in one host buffer (pinned when it goes to a CUDA device):
    input ids, positions and slots (int64), then query_start_loc, seq_lens and last_index
    (int32), then the page tables (int32). Every field starts 16-byte aligned, so kernels see one pointer
    alignment whatever the batch. The same views read the buffer or its copy on the device.

    Padding (for a captured graph) adds requests with no tokens, and tokens that belong to
    no request and store nowhere."""

    def __init__(self, token_ids: list[list[int]], context_lens: list[int], page_tables: list[list[int]],
                 page_size: int, pin: bool, pad_seqs: int = 0, pad_tokens: int = 0):
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
        self.num_tokens = max(len(positions), pad_tokens)
        self.num_seqs = max(len(seq_lens), pad_seqs)
        self.table_shape = (len(page_tables), max(len(p) for p in page_tables))
        self.max_query_len = max(len(t) for t in token_ids)
        self.max_seq_len = max(seq_lens)
        t, b = self.num_tokens, self.num_seqs
        tokens_len, rows_len = self.tokens_len_for(t), self.rows_len_for(b)
        self.buffer = torch.empty(8 * tokens_len + 4 * (rows_len + self.table_shape[0] * self.table_shape[1]),
                                  dtype=torch.uint8, pin_memory=pin)
        array = self.buffer.numpy()
        ids64, pos64, slots64 = array[:8 * tokens_len].view(np.int64).reshape(3, -1)
        extra = t - len(positions)
        ids64[:t] = [x for ids in token_ids for x in ids] + [0] * extra
        pos64[:t] = positions + [0] * extra
        slots64[:t] = slots + [-1] * extra
        rows32 = array[8 * tokens_len:].view(np.int32)
        extra = b - len(seq_lens)
        rows32[:b + 1] = starts + [starts[-1]] * extra
        stride = self.row_stride(b)
        rows32[stride:stride + b] = seq_lens + [0] * extra
        last = stride + _round_up(b, 4)
        rows32[last:last + b] = [end - 1 for end in starts[1:]] + [max(starts[-1] - 1, 0)] * extra
        width = self.table_shape[1]
        rows32[rows_len:] = [page for p in page_tables for page in p + [0] * (width - len(p))]
        self.tokens_len, self.rows_len = tokens_len, rows_len

    @staticmethod
    def token_stride(num_tokens: int) -> int:
        return _round_up(num_tokens, 2)

    @staticmethod
    def tokens_len_for(num_tokens: int) -> int:
        return 3 * HostBatch.token_stride(num_tokens)

    @staticmethod
    def row_stride(num_seqs: int) -> int:
        return _round_up(num_seqs + 1, 4)

    @staticmethod
    def rows_len_for(num_seqs: int) -> int:
        return HostBatch.row_stride(num_seqs) + 2 * _round_up(num_seqs, 4)

    def tokens(self, buffer: torch.Tensor) -> torch.Tensor:
        """Input ids, positions and slots, back to back (int64)."""
        return buffer[:8 * self.tokens_len].view(torch.int64)

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """query_start_loc, seq_lens, then last_index (int32)."""
        start = 8 * self.tokens_len
        return buffer[start:start + 4 * self.rows_len].view(torch.int32)

    def page_table(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[8 * self.tokens_len + 4 * self.rows_len:].view(torch.int32).view(self.table_shape)


def token_fields(tokens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, positions and slot mapping: views of int64 data laid out as `HostBatch.tokens`."""
    stride = HostBatch.token_stride(num_tokens)
    return tokens[:num_tokens], tokens[stride:stride + num_tokens], tokens[2 * stride:2 * stride + num_tokens]


def row_fields(rows: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_start_loc, seq_lens and last_index: views of int32 data laid out as `HostBatch.rows`."""
    stride = HostBatch.row_stride(num_seqs)
    last = stride + _round_up(num_seqs, 4)
    return rows[:num_seqs + 1], rows[stride:stride + num_seqs], rows[last:last + num_seqs]


def with_device_tails(feeds: list[list[int]], counts: list[int], source: torch.Tensor) -> torch.Tensor:
    """The feeds' tokens, flat, on `source`'s device, with the last counts[i] of feed i taken
    from source[i, :counts[i]] (tokens only the device knows: drafts, or those a step still
    in flight samples); the feeds hold placeholders there."""
    flat, dst, src = [t for feed in feeds for t in feed], [], []
    end, width = 0, source.shape[1]
    for i, (feed, k) in enumerate(zip(feeds, counts)):
        end += len(feed)
        dst += range(end - k, end)
        src += range(i * width, i * width + k)
    ids, dst, src = to_device(flat + dst + src, torch.int64, source.device).split([len(flat), len(dst), len(src)])
    return ids.index_copy(0, dst, source.reshape(-1)[src])
