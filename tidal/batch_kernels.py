"""`ForwardBatch`'s edits on the device as Triton kernels (CUDA only): moving a batch's rows
back by the drafts a step in flight rejected (`ForwardBatch.move_back`), and moving a
drafter's rows on by a position (`ForwardBatch.advance`). Each is one kernel where the eager
torch version is a dozen, and each runs inside graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BATCH_BLOCK = 16  # tokens (move_back) or rows (advance) a program handles at a time


@triton.jit(do_not_specialize=["table_stride"])  # the page table's width changes from step to step
def _move_back_kernel(rejected_ptr, query_start_ptr, seq_lens_ptr, pos_ptr, slot_ptr, table_ptr, table_stride,
                      PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    back = tl.load(rejected_ptr + row)
    tl.store(seq_lens_ptr + row, tl.load(seq_lens_ptr + row) - back.to(tl.int32))
    end = tl.load(query_start_ptr + row + 1)
    for start in range(tl.load(query_start_ptr + row), end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        pos = tl.load(pos_ptr + offs, mask=mask, other=0) - back
        tl.store(pos_ptr + offs, pos, mask=mask)
        slot = tl.load(slot_ptr + offs, mask=mask, other=-1)
        stores = mask & (slot >= 0)
        page = tl.load(table_ptr + row * table_stride + pos // PAGE_SIZE, mask=stores, other=0).to(tl.int64)
        tl.store(slot_ptr + offs, tl.where(stores, page * PAGE_SIZE + pos % PAGE_SIZE, -1), mask=mask)


def move_back(rejected: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              positions: torch.Tensor, slot_mapping: torch.Tensor, page_table: torch.Tensor,
              page_size: int) -> None:
    """`ForwardBatch.move_back` in one kernel, in place: a program per row moves its tokens
    back by rejected[row] and recomputes their slots (the eager version is a dozen kernels)."""
    _move_back_kernel[(rejected.shape[0],)](rejected, query_start_loc, seq_lens, positions, slot_mapping, page_table,
                                            page_table.stride(0), PAGE_SIZE=page_size, BLOCK=_BATCH_BLOCK)


@triton.jit(do_not_specialize=["table_stride", "B"])  # as does the batch's size
def _advance_kernel(limits_ptr, seq_lens_ptr, pos_ptr, slot_ptr, table_ptr, table_stride, B,
                    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < B
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    step = ok & (pos + 1 < tl.load(limits_ptr + rows, mask=ok, other=0))
    pos += step.to(pos.dtype)
    tl.store(pos_ptr + rows, pos, mask=ok)
    tl.store(seq_lens_ptr + rows, tl.load(seq_lens_ptr + rows, mask=ok, other=0) + step.to(tl.int32), mask=ok)
    page = tl.load(table_ptr + rows * table_stride + pos // PAGE_SIZE, mask=step, other=0).to(tl.int64)
    tl.store(slot_ptr + rows, tl.where(step, page * PAGE_SIZE + pos % PAGE_SIZE, -1), mask=ok)


def advance(limits: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            page_table: torch.Tensor, page_size: int) -> None:
    """`ForwardBatch.advance` in one kernel, in place (the eager version is a dozen kernels,
    in every one of a drafter's steps after the first)."""
    b = positions.shape[0]
    _advance_kernel[(triton.cdiv(b, _BATCH_BLOCK),)](limits, seq_lens, positions, slot_mapping, page_table,
                                                     page_table.stride(0), b, PAGE_SIZE=page_size, BLOCK=_BATCH_BLOCK)
