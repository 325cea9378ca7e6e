"""Triton paged attention (the GPU backend).

Three kernels:
- `_rotate_store_kernel` applies the rotary embedding to each token's q and k, and writes
  its k/v into the paged cache at its slot (-1 = skip).
- `_attention_kernel` attends a block of query tokens of one request over its keys, read
  through the page table. One kernel serves prefill, chunked extend, verification and
  decode: query lengths vary per request, attention is causal with the cached prefix
  visible. The query heads sharing a kv head are processed together (rows of the tile are
  (token, head) pairs), so K/V are loaded once per group. When there are too few programs
  to fill the GPU (decode, verification at small batch), the keys are split over several
  programs (split-KV), each writing a partial output and its log-sum-exp.
- `_combine_kernel` merges those partials.

Grids and split counts come from host ints only (shapes, `batch.max_query_len`,
`batch.max_seq_len`); every per-request length is read on the device, and scratch buffers
are sized by shapes, so all launches can be captured in CUDA graphs. A captured graph stays
correct for any sequence lengths, as long as no request has more query tokens than
`batch.max_query_len` had at capture (`max_seq_len` only tunes the split count).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal.batch import ForwardBatch
from tidal.compiles import watch as compile_watch
from tidal.kv_cache import NULL_PAGE
from tidal.layers.fused import after_previous, pdl_args
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding

_LOG2E = 1.4426950408889634
_MIN_SPLIT_KEYS = 256  # fewest keys worth a split of their own
_MAX_SPLITS = 32


@triton.jit
def _rotate_store_kernel(
    pos_ptr, cs_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, cache_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, eps,
    s_cs, sq0, sq1, sk0, sk1, sv0, sv1, sqo0, sqo1,
    stride_kv, stride_page, stride_slot, stride_head,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, ROTATE: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, head) over the query heads, then the kv heads: a query head is
    (normed and) rotated into the output; a kv head's key is (normed and) rotated and stored
    with its value in the cache slot (-1 = skip). With NORM the head is RMS-normed first by
    its weights (q's or k's), rounded as `RMSNorm` rounds. The neox rotation [x1 cos - x2 sin,
    x2 cos + x1 sin] runs in float32 and is stored in the input dtype, as `RotaryEmbedding`
    does."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cs_ptr + pos * s_cs + offs)
        sin = tl.load(cs_ptr + pos * s_cs + HALF + offs)
    if h < NUM_HEADS:
        src = q_ptr + t * sq0 + h * sq1
        dst = qo_ptr + t * sqo0 + h * sqo1
        keep = offs < HALF  # every query is rotated, padding's too
        norm_ptr = q_norm_ptr
    else:
        slot = tl.load(slot_ptr + t)
        keep = offs < tl.where(slot >= 0, HALF, 0)
        kv_head = h - NUM_HEADS
        src = k_ptr + t * sk0 + kv_head * sk1
        dst = cache_ptr + (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot + kv_head * stride_head
        v_src = v_ptr + t * sv0 + kv_head * sv1
        tl.store(dst + stride_kv + offs, tl.load(v_src + offs), mask=keep)
        tl.store(dst + stride_kv + HALF + offs, tl.load(v_src + HALF + offs), mask=keep)
        norm_ptr = k_norm_ptr
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    dtype = x1.dtype
    if NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
        w1 = tl.load(norm_ptr + offs).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + offs).to(tl.float32)
        x1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
    if ROTATE:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = (a * cos - b * sin).to(dtype), (b * cos + a * sin).to(dtype)
    tl.store(dst + offs, x1, mask=keep)
    tl.store(dst + HALF + offs, x2, mask=keep)


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, kv_ptr, page_row_ptr, n0, end, last_key, qk_scale,
    stride_kv, stride_page, stride_slot, offs_d, tree_start, tree_bits,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    """Online-softmax update with keys n0 .. n0 + BLOCK_N. With MASKED, keys at or past
    `end` are skipped and row r only sees keys <= last_key[r]; with TREE too, of the keys
    from `tree_start` on only those whose bit is set in tree_bits[r] (`ForwardBatch.tree_mask`)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        in_range = offs_n < end
        page = tl.load(page_row_ptr + offs_n // PAGE_SIZE, mask=in_range, other=0)
    else:
        page = tl.load(page_row_ptr + offs_n // PAGE_SIZE)
    slot_off = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_slot
    k_ptrs = kv_ptr + slot_off[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]
    v_ptrs = kv_ptr + stride_kv + slot_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if MASKED:
        visible = (offs_n[None, :] <= last_key[:, None]) & in_range[None, :]
        if TREE:
            rel = offs_n - tree_start
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
            visible = visible & ((rel[None, :] < 0) | (bit != 0))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# Runtime ints that change from step to step (split count, page-table width, token count
# in scratch strides) are not specialised on: each new value class would compile another
# kernel in the middle of a user's step.
@triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_os", "stride_ls"])
def _attention_kernel(
    q_ptr, cache_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    tree_mask_ptr, tree_start_ptr, qk_scale, num_splits,
    stride_qt, stride_qh,
    stride_kv, stride_page, stride_slot, stride_head, stride_pt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query block x split, request, kv head). Tile row r is query token
    r // GROUP of the block with query head r % GROUP of this kv head's group. With TREE,
    keys from the request's tree_start on are seen as its query tokens' masks say."""
    after_previous(PDL)
    q_block = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    # Keys [0, kv_end) are seen by some row of the block, [0, shared_end) by all of them.
    kv_end = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    shared_end = ctx_len + q_block * BLOCK_Q + 1
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_end)
    mid = tl.maximum(start, tl.minimum(end, shared_end // BLOCK_N * BLOCK_N))
    tree_start = seq_len
    tree_bits = tl.full([BLOCK_M], -1, dtype=tl.int64)
    if TREE:  # a tree's keys are masked per row, never in the unmasked loop
        tree_start = tl.load(tree_start_ptr + seq)
        tree_bits = tl.load(tree_mask_ptr + q_start + tok, mask=row_ok, other=-1)
        mid = tl.maximum(start, tl.minimum(mid, tree_start // BLOCK_N * BLOCK_N))

    kv_ptr = cache_ptr + kv_head * stride_head
    page_row_ptr = page_table_ptr + seq * stride_pt
    last_key = ctx_len + tok
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, mid, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, n0, end, last_key, qk_scale,
            stride_kv, stride_page, stride_slot, offs_d, tree_start, tree_bits,
            PAGE_SIZE, BLOCK_N, False, PRECISION, TREE)
    for n0 in range(mid, end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, kv_ptr, page_row_ptr, n0, end, last_key, qk_scale,
            stride_kv, stride_page, stride_slot, offs_d, tree_start, tree_bits,
            PAGE_SIZE, BLOCK_N, True, PRECISION, TREE)

    # A split may hold no key a row sees (l_i = 0): its partial is 0 with weight 0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = split * stride_os + (q_start + tok) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + (q_start + tok) * stride_lt + head, lse,
                 mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ls"])
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (token, head): weight each split's partial by exp2(lse)."""
    after_previous(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = splits < num_splits
    lse = tl.load(lse_ptr + splits * stride_ls + t * stride_lt + h, mask=ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + splits[:, None] * stride_ps + t * stride_pt + h * stride_ph
                   + offs_d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of `_attention_kernel` (rows = query tokens x heads of a group)."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter on CPU: behave like an H100/H200


def _tiles(rows: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(block_m, block_n) for a query block of `rows` (token, head) rows."""
    wide = dtype == torch.float32 or head_dim > 128  # keep big tiles within shared memory
    if rows <= 64:  # decode / verification: one query block per request
        block_m = max(16, _next_pow2(rows))
    else:
        block_m = 64 if wide else 128
    return max(block_m, _next_pow2(group)), 32 if wide else 64


def _config(block_m: int, block_n: int, num_splits: int) -> AttentionConfig:
    return AttentionConfig(block_m, block_n, num_splits, 8 if block_m >= 128 else 4, 3)


def choose_config(
    batch: ForwardBatch, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> AttentionConfig:
    """Pick tile sizes and the split count from host ints only."""
    group = num_heads // num_kv_heads
    block_m, block_n = _tiles(batch.max_query_len * group, group, head_dim, dtype)
    q_blocks = triton.cdiv(batch.max_query_len, block_m // group)
    programs = batch.num_seqs * num_kv_heads * q_blocks
    sms = _num_sms(device)
    num_splits = 1
    if programs < sms:
        num_splits = max(1, min(triton.cdiv(2 * sms, programs),
                                triton.cdiv(batch.max_seq_len, _MIN_SPLIT_KEYS), _MAX_SPLITS))
    return _config(block_m, block_n, num_splits)


def every_config(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[AttentionConfig]:
    """One configuration of each kernel variant choose_config can pick for this geometry:
    its tile sizes, with and without split-KV (the split count itself is not specialised on)."""
    group = num_heads // num_kv_heads
    tiles = {_tiles(rows, group, head_dim, dtype) for rows in (16, 32, 64, 128)}
    return [_config(block_m, block_n, splits) for block_m, block_n in sorted(tiles) for splits in (1, 2)]


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     batch: ForwardBatch, cos_sin: torch.Tensor | None,
                     qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
    """RMS-norm q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] head by head with
    `qk_norm` (if given), rotate them at batch.positions by the [max_pos, head_dim] cos|sin
    table (None: no rotation), and write k/v into kv_cache at batch.slot_mapping (-1 = skip),
    in one kernel. Returns the new q, contiguous; the new k lives only in the cache, where
    attention reads it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.dtype == k.dtype == v.dtype == kv_cache.dtype, "q, k, v and the kv cache must share a dtype"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kv_cache.stride(-1) == 1
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"need a power-of-two head_dim >= 16, got {head_dim}"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    rotate = cos_sin is not None
    cs = cos_sin if rotate else q_out  # unread without rotation
    assert not rotate or (cos_sin.dtype == torch.float32 and cos_sin.stride(-1) == 1)
    q_norm, k_norm = qk_norm or (None, None)
    if qk_norm:
        assert q_norm.eps == k_norm.eps and q_norm.weight.numel() == k_norm.weight.numel() == head_dim
    _rotate_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        batch.positions, cs, q, k, v, q_out, kv_cache, batch.slot_mapping,
        q_norm.weight if qk_norm else q_out, k_norm.weight if qk_norm else q_out, q_norm.eps if qk_norm else 0.0,
        cs.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, HALF=head_dim // 2, PAGE_SIZE=kv_cache.shape[2], ROTATE=rotate,
        NORM=qk_norm is not None, num_warps=1, **pdl_args(q.device),
    )
    return q_out


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    config: AttentionConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each request's cached keys,
    written into `out` (contiguous, q's shape and dtype) when given."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert head_dim == cache_head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256, (
        f"triton attention needs a power-of-two head_dim in [16, 256], got {head_dim}")
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    assert q.dtype == kv_cache.dtype, f"q dtype {q.dtype} != kv cache dtype {kv_cache.dtype}"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = config or choose_config(batch, num_heads, num_kv_heads, head_dim, q.dtype, q.device)
    block_q = cfg.block_m // group
    split = cfg.num_splits > 1
    if split:
        part = torch.empty((cfg.num_splits, num_tokens, num_heads, head_dim),
                           dtype=torch.float32, device=q.device)
        lse = torch.empty((cfg.num_splits, num_tokens, num_heads), dtype=torch.float32,
                          device=q.device)
        dst = part
    else:
        dst, lse = out.unsqueeze(0), out  # lse is unused without splits
    grid = (triton.cdiv(batch.max_query_len, block_q) * cfg.num_splits, batch.num_seqs,
            num_kv_heads)
    tree = batch.tree_mask is not None
    _attention_kernel[grid](
        q, kv_cache, batch.page_table, batch.query_start_loc, batch.seq_lens, dst, lse,
        batch.tree_mask if tree else batch.slot_mapping, batch.tree_start if tree else batch.seq_lens,
        scale * _LOG2E, cfg.num_splits,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        batch.page_table.stride(0),
        dst.stride(0), dst.stride(1), dst.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_Q=block_q, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TREE=tree,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q.device),
    )
    if split:
        _combine_kernel[(num_tokens, num_heads)](
            part, lse, out, cfg.num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_PAD=_next_pow2(_MAX_SPLITS),  # one variant for every split count
            **pdl_args(q.device),
        )
    return out


class TritonAttention:
    """Paged attention backend on Triton kernels (see module docstring)."""

    name = "triton"

    def __init__(self):
        self.built: set[tuple] = set()  # geometries whose every kernel variant is built
        self.trees = False  # the engine drafts trees: build their variants too

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        batch: ForwardBatch, scale: float, rotary: RotaryEmbedding | None = None,
        out: torch.Tensor | None = None, qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        q = rotate_and_store(q, k, v, kv_cache, batch, None if rotary is None else rotary.cos_sin, qk_norm)
        if not compile_watch.is_serving:  # (while serving, a forward does only its own work)
            self._build_every_variant(q, kv_cache)
        return paged_attention(q, kv_cache, batch, scale, out=out)

    def _build_every_variant(self, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """At start-up, at the first forward of a geometry (heads, head size, dtype, page
        size) that is not being captured in a CUDA graph, attend one token over the null page
        with every configuration `choose_config` can pick, without and with trees of drafts:
        each is then built before any user's step needs it. Which tile a step takes depends
        on its query lengths and batch, so a variant first met while serving would be built
        inside that step. An engine that drafts trees (`trees`) builds the tree variants too,
        whether or not a forward of its start-up has a tree: the memory plan and the cost
        profile, which draft one, are skipped with num_pages given and a cached profile."""
        geometry = (q.shape[1], *kv_cache.shape[2:], q.dtype)
        if not q.is_cuda or geometry in self.built or torch.cuda.is_current_stream_capturing():
            return
        self.built.add(geometry)
        batch = ForwardBatch.build([[0]], [0], [[NULL_PAGE]], kv_cache.shape[2], q.device)
        one = torch.zeros_like(q[:1])
        for tree in (False, True) if self.trees else (False,):
            if tree:
                batch.tree_mask = torch.full((1,), -1, dtype=torch.int64, device=q.device)
                batch.tree_start = torch.zeros(1, dtype=torch.int32, device=q.device)
            for config in every_config(q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype):
                paged_attention(one, kv_cache, batch, 1.0, config)
