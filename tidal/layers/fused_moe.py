"""Fused Mixture-of-Experts: every expert's SwiGLU MLP in two Triton grouped-GEMM launches.

A loop over experts costs a handful of launches per expert hit and, for the loop's bounds, a
host sync that CUDA graphs cannot capture. Here the T*k (token, expert) pairs are instead
sorted by expert into blocks of BLOCK_M rows, each block owned by one expert (an expert's
group is padded to a multiple of BLOCK_M with an invalid pair id), and one launch per
projection runs every block against its expert's weights (the technique of vLLM's fused_moe).
The grouping is a counting sort in small Triton kernels, into buffers whose sizes depend on
shapes only; blocks past the data-dependent number in use find an out-of-range expert and
exit. So the whole of fused_moe can be captured in a CUDA graph.

The router's softmax, top k and renormalisation are one launch too (`route`), and so is the
sum over each token's k experts; for a few tokens (decode, verification at small batch) one
program routes and groups them (`routed_moe`): at batch 1 a layer's launches, not its bytes,
set much of its time (docs/design.md, "Mixture-of-Experts targets").

Integer arguments that follow the token count are not specialised on, so start-up's variants
cover every step (docs/design.md, "Every kernel is built at start-up").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.layers.fused import after_previous, pdl_args


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, topk_weights_ptr,
    num_pairs, pairs_per_a_row, num_experts, N, K,
    sa_row, sa_k, sw_e, sw_n, sw_k, so_row, so_n,
    GATED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block, n-tile): out[pair, n] for the block's pairs, with pair's input row
    a[pair // pairs_per_a_row] and the weights w[expert] [N(, +N), K] of the block's expert.
    GATED: silu(a @ w[:N].T) * (a @ w[N:2N].T), the gate and up tiles computed side by side;
    else (a @ w.T) * topk_weights[pair]. Accumulates in float32; stores in out's dtype."""
    after_previous(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # a surplus block: fewer are needed than the shape-bound grid has
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs  # padding rows hold num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // pairs_per_a_row)[:, None] * sa_row + offs_k[None, :] * sa_k
    w_ptrs = w_ptr + expert * sw_e + offs_n[None, :] * sw_n + offs_k[:, None] * sw_k  # [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * sw_n, mask=w_mask, other=0.0)
            up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * sa_k
        w_ptrs += BLOCK_K * sw_k
    if GATED:
        acc = acc * tl.sigmoid(acc) * up
    else:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None] * so_row + offs_n[None, :] * so_n
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tiles by the mean rows per expert, T*k/E: BLOCK_M follows the size of an expert's group,
    so few rows are padding. Up to 8 rows (decode; T <= 128 at Qwen3-MoE's k/E = 1/16) the
    GEMMs are GEMV-like and bound by reading weights: 16-row tiles (tl.dot's least) and long
    BLOCK_K strips. Larger groups take larger tiles that reuse each weight tile over more rows,
    up to 128x128 once compute-bound. Thresholds are the fastest of a sweep on an H200 (bf16,
    E=128, k=8, H=2048, I=768). float32 tiles are twice the bytes: BLOCK_K is halved to keep
    the pipelined stages within shared memory."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 8:
        config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 16:
        config = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif rows_per_expert <= 64:
        config = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    else:
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        config["BLOCK_K"] //= 2
    return config


# Alignment: a program counts or places CHUNK pairs, through [TILE, experts] one-hot tiles.
_CHUNK = 256


@triton.jit
def _count(ids_ptr, start, end, experts, TILE: tl.constexpr):
    """How many of the pairs [start, end) go to each expert."""
    counts = tl.zeros(experts.shape, dtype=tl.int32)
    for tile_start in range(start, end, TILE):
        pairs = tile_start + tl.arange(0, TILE)
        ids = tl.load(ids_ptr + pairs, mask=pairs < end, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    return counts


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                  TILE: tl.constexpr, PDL: tl.constexpr):
    """Program c: chunk_counts[c, e] = how many of the pairs [c * CHUNK, +CHUNK) go to expert e."""
    after_previous(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    end = tl.minimum(chunk * CHUNK + CHUNK, num_pairs)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + experts, _count(ids_ptr, chunk * CHUNK, end, experts, TILE))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_rows"])
def _place_kernel(
    ids_ptr, chunk_counts_ptr, pair_ids_ptr, block_expert_ptr,
    num_pairs, num_experts, num_chunks, num_rows,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, TILE: tl.constexpr,
    ONE_CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: writes the pairs of chunk p (if any) to their rows, in pair order within each
    expert, after the expert's pairs of earlier chunks; and for rows [p * TILE, +TILE) the
    padding (num_pairs) and each block's expert (num_experts past the last block in use).
    Every program sums the chunk counts itself, so no scan runs between the launches; with
    one chunk it counts the pairs itself, which saves the count launch at decode."""
    after_previous(PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    if ONE_CHUNK:
        counts = _count(ids_ptr, 0, num_pairs, experts, TILE)
        earlier = tl.zeros([BLOCK_E], dtype=tl.int32)
    else:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        earlier = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c_start in range(0, num_chunks, 16):
            chunks = c_start + tl.arange(0, 16)
            chunk_counts = tl.load(chunk_counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :],
                                   mask=(chunks < num_chunks)[:, None], other=0)
            counts += tl.sum(chunk_counts, 0)
            earlier += tl.sum(tl.where((chunks < p)[:, None], chunk_counts, 0), 0)
    padded_counts = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    padded_ends = tl.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    if p < num_chunks:
        next_row = padded_starts + earlier
        for start in range(p * CHUNK, tl.minimum(p * CHUNK + CHUNK, num_pairs), TILE):
            pairs = start + tl.arange(0, TILE)
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
            one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
            dest = tl.sum(one_hot * (next_row[None, :] + tl.cumsum(one_hot, 0) - 1), 1)
            tl.store(pair_ids_ptr + dest, pairs, mask=pairs < num_pairs)
            next_row += tl.sum(one_hot, 0)
    rows = p * TILE + tl.arange(0, TILE)
    # A row's expert: the number of experts whose padded group ends at or before it.
    row_expert = tl.sum((padded_ends[None, :] <= rows[:, None]).to(tl.int32), 1)
    mine = experts[None, :] == row_expert[:, None]
    rank = rows - tl.sum(tl.where(mine, padded_starts, 0), 1)
    padding = (rank >= tl.sum(tl.where(mine, counts, 0), 1)) & (rows < num_rows)
    tl.store(pair_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=padding)
    block_first = (rows % BLOCK_M == 0) & (rows < num_rows)
    tl.store(block_expert_ptr + rows // BLOCK_M, tl.minimum(row_expert, num_experts), mask=block_first)


def _group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(pair_ids, block_expert): pair ids (t * k + j) grouped by expert in pair order, each
    expert's group starting at a multiple of block_m and padded with the invalid id T*k;
    block b's expert, or num_experts for blocks past the last in use. A counting sort in one
    or two small launches, into buffers sized by shapes only: no host sync. (torch.sort
    alone takes 12-85 us on an H200, as long as the decode GEMMs.)"""
    ids = topk_ids.reshape(-1)
    num_pairs, device = ids.numel(), ids.device
    # At most min(E, T*k) experts are hit, each padding fewer than block_m rows.
    num_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    num_chunks = triton.cdiv(num_pairs, _CHUNK)
    block_e = max(16, triton.next_power_of_2(num_experts))
    # One-hot tiles of at most 8192 elements, no taller than the pairs need.
    tile = max(16, min(8192 // block_e, triton.next_power_of_2(num_pairs)))
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    pair_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    if num_chunks > 1:
        _count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, CHUNK=_CHUNK, BLOCK_E=block_e, TILE=tile,
                                     **pdl_args(device))
    _place_kernel[(max(num_chunks, triton.cdiv(num_rows, tile)),)](
        ids, chunk_counts, pair_ids, block_expert,
        num_pairs, num_experts, num_chunks, num_rows,
        BLOCK_M=block_m, CHUNK=_CHUNK, BLOCK_E=block_e, TILE=tile, ONE_CHUNK=num_chunks == 1,
        **pdl_args(device),
    )
    return pair_ids, block_expert


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, s_row,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    """Program t: the k largest of softmax(logits[t]) in float32, in descending order, and
    their experts. The experts are picked on the logits (softmax keeps their order), the
    first of equal ones first, so the choice does not hang on the probabilities' rounding."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * s_row + experts, mask=experts < num_experts,
                     other=float("-inf")).to(tl.float32)
    top = tl.max(logits, 0)
    total = tl.sum(tl.exp(logits - top), 0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(logits, 0)
        expert = tl.min(tl.where(logits == best, experts, BLOCK_E), 0)
        weights = tl.where(slots == j, tl.exp(best - top) / total, weights)
        ids = tl.where(slots == j, expert, ids)
        logits = tl.where(experts == expert, float("-inf"), logits)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + t * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) of router logits [T, E]: the top k
    of the softmax over all experts (computed in float32), renormalised to sum to one when
    `renormalize`: `moe.route_reference` in one launch."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, **pdl_args(logits.device),
        )
    return weights, ids


# At most this many (token, expert) pairs are routed and grouped by one program.
_ONE_PROGRAM_PAIRS = 64


@triton.jit(do_not_specialize=["num_tokens", "num_rows"])
def _route_group_kernel(
    logits_ptr, weights_ptr, ids_ptr, pair_ids_ptr, block_expert_ptr,
    num_tokens, num_experts, num_rows, s_row,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr,
):
    """One program: `_route_kernel` for every token (TOKENS at a time), then `_place_kernel`'s
    layout of the pairs by expert, read back from the ids it wrote. Padding rows are written
    expert by expert, and a block's expert block by block; rows of blocks past the last in use
    are left unwritten (the GEMMs skip those blocks)."""
    after_previous(PDL)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    for t0 in range(0, num_tokens, TOKENS):
        toks = t0 + tl.arange(0, TOKENS)
        tok_ok = toks < num_tokens
        logits = tl.load(logits_ptr + toks[:, None].to(tl.int64) * s_row + experts[None, :],
                         mask=tok_ok[:, None] & (experts < num_experts)[None, :], other=float("-inf")).to(tl.float32)
        logits = tl.where(tok_ok[:, None], logits, 0.0)  # rows past the tokens: finite, never stored
        top = tl.max(logits, 1)
        total = tl.sum(tl.exp(logits - top[:, None]), 1)
        weights = tl.zeros([TOKENS, BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([TOKENS, BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(logits, 1)
            expert = tl.min(tl.where(logits == best[:, None], experts[None, :], BLOCK_E), 1)
            weights = tl.where(slots[None, :] == j, (tl.exp(best - top) / total)[:, None], weights)
            ids = tl.where(slots[None, :] == j, expert[:, None], ids)
            logits = tl.where(experts[None, :] == expert[:, None], float("-inf"), logits)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, 1)[:, None]
        pairs = toks[:, None] * TOP_K + slots[None, :]
        ok = tok_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + pairs, weights, mask=ok)
        tl.store(ids_ptr + pairs, ids, mask=ok)
    tl.debug_barrier()  # the ids are written before the program's threads read each other's
    num_pairs = num_tokens * TOP_K
    counts = _count(ids_ptr, 0, num_pairs, experts, TILE)
    padded_counts = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    padded_ends = tl.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    next_row = padded_starts
    for start in range(0, num_pairs, TILE):
        pairs = start + tl.arange(0, TILE)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        dest = tl.sum(one_hot * (next_row[None, :] + tl.cumsum(one_hot, 0) - 1), 1)
        tl.store(pair_ids_ptr + dest, pairs, mask=pairs < num_pairs)
        next_row += tl.sum(one_hot, 0)
    pad_rows = (padded_starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(pair_ids_ptr + pad_rows, tl.zeros_like(pad_rows) + num_pairs, mask=pad_rows < padded_ends[:, None])
    num_blocks = num_rows // BLOCK_M
    for b0 in range(0, num_blocks, TILE):
        blocks = b0 + tl.arange(0, TILE)
        # A block's expert: the number of experts whose padded group ends at or before it.
        block_expert = tl.sum((padded_ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, tl.minimum(block_expert, num_experts), mask=blocks < num_blocks)


def _route_and_group(logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int, block_m: int):
    """(weights [T*k] float32, ids [T*k] int32, pair_ids, block_expert): `route` then
    `_group_by_expert` in one launch, for at most `_ONE_PROGRAM_PAIRS` pairs."""
    num_tokens = logits.shape[0]
    num_pairs, device = num_tokens * top_k, logits.device
    assert 0 < num_pairs <= _ONE_PROGRAM_PAIRS and logits.stride(-1) == 1 and logits.shape[1] == num_experts
    num_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    block_e = max(16, triton.next_power_of_2(num_experts))
    weights = torch.empty(num_pairs, dtype=torch.float32, device=device)
    ids = torch.empty(num_pairs, dtype=torch.int32, device=device)
    pair_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    # Tiles by the experts alone, so that no token count builds another kernel.
    _route_group_kernel[(1,)](
        logits, weights, ids, pair_ids, block_expert,
        num_tokens, num_experts, num_rows, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        TOKENS=max(1, 1024 // block_e), BLOCK_M=block_m, TILE=max(16, min(64, 4096 // block_e)),
        **pdl_args(device),
    )
    return weights, ids, pair_ids, block_expert


_SUM_BLOCK = 512


@triton.jit
def _sum_slots_kernel(x_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (t, h-tile): out[t, h] = sum_j x[t * TOP_K + j, h], added in float32 (torch's
    reduction over the middle dim of [T, k, H] suits long rows, not k short ones)."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (rows 0..I-1 are the gate projection, I..2I-1 the up projection);
    w2 [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int32 (or int64).
    Returns [T, H] in x.dtype: sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), where
    g, u = split(w13[e] @ x[t]) and e = topk_ids[t, j]. `config`: tiles other than `_config`'s
    (benchmarks/fused_moe_sweep.py)."""
    num_tokens = x.shape[0]
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    config = config or _config(num_tokens, top_k, num_experts, x.dtype)
    pair_ids, block_expert = _group_by_expert(topk_ids, num_experts, config["BLOCK_M"])
    return _experts(x, w13, w2, topk_weights.reshape(-1).to(torch.float32), pair_ids, block_expert, top_k, config)


def routed_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool) -> torch.Tensor:
    """`fused_moe` of x [T, H] routed by the router's logits [T, E] as `route` routes them.
    Up to `_ONE_PROGRAM_PAIRS` pairs one launch routes and groups them (`_route_group_kernel`),
    where `route` and the grouping were two; more take those two (many programs each)."""
    num_tokens = x.shape[0]
    num_experts = w13.shape[0]
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    config = _config(num_tokens, top_k, num_experts, x.dtype)
    if num_tokens * top_k <= _ONE_PROGRAM_PAIRS:
        weights, _, pair_ids, block_expert = _route_and_group(logits, top_k, renormalize, num_experts,
                                                              config["BLOCK_M"])
    else:
        weights, ids = route(logits, top_k, renormalize)
        pair_ids, block_expert = _group_by_expert(ids, num_experts, config["BLOCK_M"])
        weights = weights.reshape(-1)
    return _experts(x, w13, w2, weights, pair_ids, block_expert, top_k, config)


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, pair_ids: torch.Tensor,
             block_expert: torch.Tensor, top_k: int, config: dict) -> torch.Tensor:
    """The two grouped GEMMs and the sum over k of pairs laid out by `_group_by_expert`,
    weights [T*k] float32."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, num_pairs, block_n = two_inter // 2, num_tokens * top_k, config["BLOCK_N"]
    # tl.dot takes float32 as tf32 by default; ieee keeps float32 runs faithful.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # row per pair
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(inter, block_n))](
        x, w13, h, pair_ids, block_expert, weights,
        num_pairs, top_k, num_experts, inter, hidden,
        *x.stride(), *w13.stride(), *h.stride(),
        GATED=True, DOT_PRECISION=precision, **config, **pdl_args(x.device),
    )
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        h, w2, out, pair_ids, block_expert, weights,
        num_pairs, 1, num_experts, hidden, inter,
        *h.stride(), *w2.stride(), *out.stride(),
        GATED=False, DOT_PRECISION=precision, **config, **pdl_args(x.device),
    )
    total = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, _SUM_BLOCK))](out, total, hidden, TOP_K=top_k, BLOCK=_SUM_BLOCK,
                                                                     **pdl_args(x.device))
    return total
