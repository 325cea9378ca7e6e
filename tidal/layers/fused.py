"""Fused Triton kernels for the small per-layer ops and for sampling (used on CUDA only).

At batch 1 a decode step is dominated by launch count, so RMSNorm (+ residual add),
the rotary embedding (for the torch attention backend; the Triton one rotates as it stores
k/v) and SiluAndMul each run as one kernel here instead of several eager torch kernels, and
at one token the residual add and RMSNorm before a product, the product and (for the MLP's
gate/up) its SwiGLU are one kernel (`norm_gemv`). Each matches the
torch code of its module: same dtype promotion, same roundings (e.g. the residual sum is
rounded to the input dtype before the norm). Grids and outputs depend on shapes only, so
all of them are CUDA-graph capturable. Outputs are fresh contiguous tensors; inputs are
never modified.

Sampling's exponential race hashes its uniforms inside the kernel that reads the weights,
instead of a dozen eager passes over an [N, V] int64 tensor of hashes; the same kernel, with
the logits as the scores, is the greedy argmax, splitting a long row over many programs
whose last to finish picks the winner. The per-row keys and uniforms (acceptance tests) are
one kernel too.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


# ---------------------------------------------------------------------------- launch overlap


@functools.lru_cache(maxsize=None)
def pdl(device: torch.device) -> bool:
    """Whether the decoder's kernels on `device` use programmatic dependent launch (CUDA,
    compute capability 9 on): each is launched while the kernel before it still runs, loads
    its weights, and waits (`after_previous`) before it reads anything a kernel wrote. At
    batch 1 a layer is ten short launches, and without it the GPU idled between them and
    each kernel's first weight reads waited on its launch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """The launch arguments of a kernel that calls `after_previous`."""
    overlap = pdl(device)
    return {"PDL": overlap, "launch_pdl": overlap}


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Wait until the kernel launched before this one has finished and its writes are
    visible, then let the next one launch. Every program calls it before it reads or writes
    anything but its weights (tensors no kernel writes) and before it may return: then a
    kernel finishes after the one before it, so when the next one launches, every kernel
    before this one has finished."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# ---------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    sx0, sx1, sx2, sr0, sr1, sr2, so0, so1, ss0, ss1,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row (i, j) of a [A, B, N] view: out = w * (s * rstd(s)).to(dtype),
    where s = x (+ residual, rounded to the sum's dtype, also written to sum_ptr)."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    after_previous(PDL)
    x = tl.load(x_ptr + i * sx0 + j * sx1 + offs * sx2, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * sr0 + j * sr1 + offs * sr2, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + i * ss0 + j * ss1 + offs, s, mask=mask)
    else:
        s = x
    h = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    h = (h * rstd).to(s.dtype).to(tl.float32)  # torch casts back to x.dtype before scaling
    tl.store(out_ptr + i * so0 + j * so1 + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """View t as [A, B, N] without copying when it has at most 3 dims."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None):
    """Same results as RMSNorm.forward: normed (into `out`, which may be a view with unit
    last stride), or (normed, x + residual). x may be a strided view (e.g. heads of the
    fused qkv output, for q/k norm)."""
    n = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype if residual is None
                                    else torch.promote_types(x.dtype, residual.dtype))
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.stride(-1) == 1
    x3, o3 = _as_3d(x), _as_3d(out)
    if residual is not None:
        s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        r3, s3 = _as_3d(residual.expand(x.shape)), _as_3d(s)
    else:
        s, r3, s3 = None, x3, o3  # unused by the kernel
    if x.numel() == 0:
        return out if residual is None else (out, s)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r3, weight, o3, s3,
        *x3.stride(), *r3.stride(), o3.stride(0), o3.stride(1), s3.stride(0), s3.stride(1),
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block), **pdl_args(x.device),
    )
    return out if residual is None else (out, s)


# ---------------------------------------------------------------------------- rotary


@triton.jit
def _rotary_kernel(
    pos_ptr, cs_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr,
    s_pos, s_cs, sq0, sq1, sq2, sk0, sk1, sk2, sqo0, sqo1, sko0, sko1,
    HQ, HALF, BLOCK: tl.constexpr,
):
    """One program per (token, head) over the q heads then the k heads: neox rotation
    [x1 * cos - x2 * sin, x2 * cos + x1 * sin] in float32, stored in the input dtype."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(pos_ptr + t * s_pos).to(tl.int64)
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if h < HQ:
        src = q_ptr + t * sq0 + h * sq1 + offs * sq2
        src2 = src + HALF * sq2
        dst = qo_ptr + t * sqo0 + h * sqo1 + offs
    else:
        hk = h - HQ
        src = k_ptr + t * sk0 + hk * sk1 + offs * sk2
        src2 = src + HALF * sk2
        dst = ko_ptr + t * sko0 + hk * sko1 + offs
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src2, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """Same results as RotaryEmbedding.forward: rotated copies of q [T, Hq, D] and
    k [T, Hk, D] (any strides, same dtype) at `positions` [T], from the [max_pos, D]
    cos|sin table. Returns contiguous tensors."""
    assert q.dtype == k.dtype and cos_sin.stride(-1) == 1
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = d // 2
    block = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens, hq + hk)](
        positions, cos_sin, q, k, q_out, k_out,
        positions.stride(0), cos_sin.stride(0), *q.stride(), *k.stride(),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        hq, half, BLOCK=block, num_warps=_num_warps(block),
    )
    return q_out, k_out


# ---------------------------------------------------------------------------- SiluAndMul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, sx0, sx1, so0, I, BLOCK: tl.constexpr):
    """Program (row, block): out = silu(gate).to(dtype) * up, rounded as torch does."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * sx0 + offs * sx1, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * sx0 + (offs + I) * sx1, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * so0 + offs, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same results as SiluAndMul.forward: x [..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, inter)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, o2, x2.stride(0), x2.stride(1), o2.stride(0), inter,
        BLOCK=block, num_warps=_num_warps(block),
    )
    return out


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, K, N, stride_w,
                 GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
    """One token's product with W [N (x2 when GATED), K]: program n computes its BLOCK_N
    outputs over the whole of K, streaming its rows of W once in float32 FMAs (no split-K,
    so no reduction kernel after it). With GATED, W is [gate | up] and the output
    silu(g) * u, g and u rounded to the output dtype first, as the product followed by
    SiluAndMul rounds them."""
    after_previous(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GATED:
        up_rows = rows + N.to(tl.int64) * stride_w
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            mask = n_ok[:, None]
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
        else:
            k_ok = k0 + rk < K
            mask = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.load(rows + k0, mask=mask, other=0.0).to(tl.float32) * x[None, :]
        if GATED:
            acc_up += tl.load(up_rows + k0, mask=mask, other=0.0).to(tl.float32) * x[None, :]
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc, axis=1).to(dtype)
    if GATED:
        gate = out.to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
        out = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
    tl.store(out_ptr + rn, out, mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, block_n: int = 1,
         block_k: int = 512) -> torch.Tensor:
    """F.linear(x, weight) for one token x [1, K] in one kernel; with `gated`, weight is a
    fused [gate | up] and the result SiluAndMul of the product, so that at batch 1 (a
    chain of small launches) the SwiGLU is not a launch of its own. Equal to the unfused
    result up to the order in which the products are summed. At Llama-8B's shapes on an
    H200, 1 x 512 blocks beat cuBLAS on every decoder product, with no split-K reduction
    after it (docs/design.md)."""
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1 and x.dtype == weight.dtype
    k = x.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_k = min(block_k, triton.next_power_of_2(k))
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, k, n, weight.stride(0),
        GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4, num_stages=4,
        **pdl_args(x.device),
    )
    return out


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, normed_ptr, K, N, stride_w, eps,
                      HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """`_rms_norm_kernel`'s residual add and norm of one token, then the `_gemv_kernel`
    product of the normed row with ROWS rows of W (the whole of K in one tile). Each program
    recomputes the norm, since no program can wait for another's; its rows of W are loaded
    first, so that their reads overlap the norm (and, launched early, the kernel before).
    Program 0 writes the sum and the normed row (to fresh tensors: the others still read x
    and the residual)."""
    pid = tl.program_id(0)
    rn = pid * ROWS + tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_ok = rk < K
    mask = n_ok[:, None] & k_ok[None, :]
    rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    w = tl.load(rows, mask=mask, other=0.0)
    if GATED:
        w_up = tl.load(rows + N.to(tl.int64) * stride_w, mask=mask, other=0.0)
    norm_w = tl.load(norm_w_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    after_previous(PDL)
    x = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rk, mask=k_ok, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    else:
        s = x
    h = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    dtype = out_ptr.dtype.element_ty
    normed = (norm_w * (h * rstd).to(s.dtype).to(tl.float32)).to(dtype)  # rounded as RMSNorm rounds
    if pid == 0:
        tl.store(normed_ptr + rk, normed, mask=k_ok)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + rk, s, mask=k_ok)
    hn = normed.to(tl.float32)[None, :]
    acc = tl.sum(w.to(tl.float32) * hn, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = acc.to(dtype)
    if GATED:
        up = tl.sum(w_up.to(tl.float32) * hn, axis=1)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
        gate = out.to(tl.float32)
        out = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rn, out, mask=n_ok)


def norm_gemv_tiles(n: int, k: int, gated: bool) -> tuple[int, int]:
    """(rows of W a program takes, warps) for `norm_gemv`. A program reads the token, the
    residual and the norm's weights (3 K elements) beside its rows: 4 rows (2 gated pairs)
    make that less than the token alone cost the plain GEMV, which reads it once per row;
    short outputs (a router's) keep a row a program, so that enough programs stream. Warps
    hold about 32 weights a thread."""
    block_k, halves = triton.next_power_of_2(k), 2 if gated else 1
    rows = 1 if n < 2048 else max(1, min(4 // halves, 16384 // (block_k * halves)))
    return rows, max(4, min(16, rows * block_k * halves // 1024))


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
              tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(product, normed, stream) for one token x [1, K]: stream = x + residual (x itself when
    residual is None), normed = RMSNorm(stream), product = F.linear(normed, weight, bias), or
    with `gated` its SiluAndMul (weight a fused [gate | up]), in one kernel, where a batch-1
    decode ran the norm as a launch of its own before `gemv`. Rounded as the unfused modules
    round. `tiles`: other than `norm_gemv_tiles`' (benchmarks). All tensors share x's dtype."""
    k = x.shape[1]
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.dtype == weight.dtype == norm_weight.dtype and norm_weight.is_contiguous()
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    rows, num_warps = tiles or norm_gemv_tiles(n, k, gated)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    normed = torch.empty(1, k, dtype=x.dtype, device=x.device)
    stream = x if residual is None else torch.empty(1, k, dtype=x.dtype, device=x.device)
    _norm_gemv_kernel[(triton.cdiv(n, rows),)](
        x, x if residual is None else residual, norm_weight, weight, out if bias is None else bias, out, stream,
        normed, k, n, weight.stride(0), eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, GATED=gated, ROWS=rows,
        BLOCK_K=triton.next_power_of_2(k), num_warps=num_warps, **pdl_args(x.device),
    )
    return out, normed, stream


# ---------------------------------------------------------------------------- sampling


@triton.jit
def _mix32(x):
    """`sampler._mix32` on uint32, where multiplication wraps mod 2^32 by itself."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


_MAX_ARRIVALS = 1 << 16
_arrivals: dict[torch.device, torch.Tensor] = {}


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for kernels whose programs count their arrivals, so that the
    last to arrive merges the others' partial results. Every launch leaves its counters at
    0, so one buffer per device serves every kernel, step and graph; it is never replaced,
    since captured graphs keep its address."""
    if n > _MAX_ARRIVALS:
        raise ValueError(f"{n} groups of programs to count; at most {_MAX_ARRIVALS}")
    if device not in _arrivals:
        _arrivals[device] = torch.zeros(_MAX_ARRIVALS, dtype=torch.int32, device=device)
    return _arrivals[device]


@triton.jit(do_not_specialize=["BLOCKS_PER_SPLIT"])  # it changes with the row count
def _first_best_kernel(x_ptr, keys_ptr, best_ptr, index_ptr, out_ptr, lookup_ptr, count_ptr, stride, V,
                       BLOCKS_PER_SPLIT, BLOCK: tl.constexpr, RACE: tl.constexpr, SPLIT: tl.constexpr,
                       SPLITS_PAD: tl.constexpr, LOOKUP: tl.constexpr):
    """Program (row, split): the first v in the split's blocks with the largest score, where
    the score is x[v] itself, or with RACE the exponential race's x[v] / -log(u(key, v)),
    u being `sampler`'s uniform of the row's key and vocabulary index v; one pass over x.
    With several splits the last of a row to finish (an atomic count) takes the first
    split holding the largest score. With LOOKUP it writes lookup[v] instead of v."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    if RACE:
        key = tl.load(keys_ptr + row).to(tl.uint32)
    first_block = split * BLOCKS_PER_SPLIT
    for block in range(first_block, first_block + BLOCKS_PER_SPLIT):
        v = block * BLOCK + tl.arange(0, BLOCK)
        mask = v < V
        x = tl.load(x_ptr + row * stride + v, mask=mask, other=float("-inf")).to(tl.float32)
        if RACE:
            h = _mix32(key ^ _mix32(v.to(tl.uint32)))
            u = ((h >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
            x = tl.where(mask, x / -tl.log(u), float("-inf"))
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, v, V), axis=0)
        best_index = tl.where(top > best, first, best_index)
        best = tl.maximum(top, best)
    if not SPLIT:
        if LOOKUP:
            best_index = tl.load(lookup_ptr + best_index)
        tl.store(out_ptr + row, best_index.to(tl.int64))
    else:
        splits = tl.num_programs(1)
        tl.store(best_ptr + row * splits + split, best)
        tl.store(index_ptr + row * splits + split, best_index)
        tl.debug_barrier()  # the partial is written before the count moves
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == splits - 1:
            offs = tl.arange(0, SPLITS_PAD)
            found = tl.load(best_ptr + row * splits + offs, mask=offs < splits, other=float("-inf"),
                            cache_modifier=".cg")
            winner = tl.min(tl.where(found == tl.max(found, axis=0), offs, SPLITS_PAD), axis=0)
            index = tl.load(index_ptr + row * splits + winner, cache_modifier=".cg")
            if LOOKUP:
                index = tl.load(lookup_ptr + index)
            tl.store(out_ptr + row, index.to(tl.int64))
            tl.atomic_xchg(count_ptr + row, 0)


_BEST_BLOCK = 2048
_BEST_PROGRAMS = 512  # enough to fill the GPU when there are few rows


def _first_best(x: torch.Tensor, keys: torch.Tensor | None, out: torch.Tensor | None = None,
                lookup: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of x [N, V], the first index of the largest score (see `_first_best_kernel`),
    or its entry of `lookup`, written to `out` (contiguous int64 [N]) if given. With few
    rows a row is split over several programs; the first split holding the largest score
    wins, so ties go to the first index, as with torch's argmax."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, v = x.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=x.device)
    assert out.shape == (n,) and out.dtype == torch.int64 and out.is_contiguous()
    if n == 0:
        return out
    blocks = triton.cdiv(v, _BEST_BLOCK)
    splits = min(blocks, triton.cdiv(_BEST_PROGRAMS, n))
    per_split = triton.cdiv(blocks, splits)
    if splits > 1:
        best = torch.empty(n, splits, dtype=torch.float32, device=x.device)
        index = torch.empty(n, splits, dtype=torch.int32, device=x.device)
        counts = arrival_counts(x.device, n)
    else:
        best, index, counts = out, out, out  # unread with one split
    race = keys is not None
    keys = keys.expand(n).contiguous() if race else x  # unread without the race
    # The padding is the most splits this vocabulary can have, so that a new row count does
    # not compile another kernel in the middle of serving.
    _first_best_kernel[(n, splits)](x, keys, best, index, out, out if lookup is None else lookup, counts,
                                    x.stride(0), v, per_split, BLOCK=_BEST_BLOCK, RACE=race, SPLIT=splits > 1,
                                    SPLITS_PAD=triton.next_power_of_2(min(blocks, _BEST_PROGRAMS)),
                                    LOOKUP=lookup is not None, num_warps=8)
    return out


def argmax(x: torch.Tensor, out: torch.Tensor | None = None, lookup: torch.Tensor | None = None) -> torch.Tensor:
    """torch's argmax over the last dim of x [N, V] (NaN aside), in one pass that splits long
    rows over several programs: torch reduces a row of a 128k vocabulary in one block,
    about twice as slow at one row on an H200. With `lookup`,
    lookup[argmax] (e.g. a drafter's draft-to-target ids); into `out`, if given."""
    return _first_best(x, None, out, lookup)


def race_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`sampler.sample_from_probs` given each row's 32-bit key [N]: one pass over the
    weights [N, V] instead of a dozen over an int64 [N, V] of hashes."""
    return _first_best(probs, keys)


@triton.jit(do_not_specialize=["stride", "V", "group"])
def _race_top_k_kernel(x_ptr, temperature_ptr, keys_ptr, lookup_ptr, values_ptr, index_ptr, stride, V, group,
                       K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, RACE: tl.constexpr,
                       LOOKUP: tl.constexpr):
    """Program row: `sampler.race_top_k` of x[row] in one pass, its race drawn with the key
    and temperature of request row // group (with LOOKUP, at the token ids lookup[v]; the
    indices stored are x's). A running top K (best first, ties to the first index) takes in
    a block's best only when they beat its last, and a running log-sum-exp normalises the
    scores at the end."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    top = tl.full([K_PAD], float("-inf"), tl.float32)  # (slots past K: -inf, after the others on ties)
    top_index = tl.zeros([K_PAD], dtype=tl.int32)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    if RACE:
        t = tl.load(temperature_ptr + row // group)
        key = tl.load(keys_ptr + row // group).to(tl.uint32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        mask = v < V
        score = tl.load(x_ptr + row * stride + v, mask=mask, other=float("-inf")).to(tl.float32)
        if RACE:
            if t > 0:
                col = tl.load(lookup_ptr + v, mask=mask, other=0) if LOOKUP else v
                h = _mix32(key ^ _mix32(col.to(tl.uint32)))
                u = ((h >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
                score = tl.where(mask, score / t - tl.log(-tl.log(u)), float("-inf"))
        best = tl.max(score, axis=0)
        grown = tl.maximum(m, best)
        total = total * tl.exp(m - grown) + tl.sum(tl.exp(score - grown), axis=0)
        m = grown
        if best > tl.min(tl.where(slots < K, top, float("inf")), axis=0):
            # Merge the block's best K into the running top: K rounds, each taking the larger
            # head of the two lists (the running one on ties: its indices come first).
            merged = tl.zeros([K_PAD], dtype=tl.float32)
            merged_index = tl.zeros([K_PAD], dtype=tl.int32)
            for i in tl.static_range(K):
                head = tl.max(top, axis=0)
                block_head = tl.max(score, axis=0)
                if head >= block_head:
                    at = tl.min(tl.where(top == head, slots, K_PAD), axis=0)
                    taken = tl.sum(tl.where(slots == at, top_index, 0), axis=0)
                    top = tl.where(slots == at, float("-inf"), top)
                    value = head
                else:
                    taken = tl.min(tl.where(score == block_head, v, V), axis=0)
                    score = tl.where(v == taken, float("-inf"), score)
                    value = block_head
                merged = tl.where(slots == i, value, merged)
                merged_index = tl.where(slots == i, taken, merged_index)
            top = tl.where(slots < K, merged, float("-inf"))
            top_index = merged_index
    tl.store(values_ptr + row * K + slots, top - (m + tl.log(total)), mask=slots < K)
    tl.store(index_ptr + row * K + slots, top_index.to(tl.int64), mask=slots < K)


def race_top_k(x: torch.Tensor, k: int, temperature: torch.Tensor | None, keys: torch.Tensor | None,
               lookup: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.race_top_k` in one kernel: x [N, V], temperature [R] and keys [R] of R
    requests of N / R rows each (None: no race, every row greedy); `lookup` gives the token
    ids the race's noise is drawn at. Returns values [N, k] float32 and indices into x's
    rows [N, k] int64 (the caller maps them through `lookup`)."""
    n, v = x.shape
    values = torch.empty(n, k, dtype=torch.float32, device=x.device)
    index = torch.empty(n, k, dtype=torch.int64, device=x.device)
    if n:
        race = keys is not None
        _race_top_k_kernel[(n,)](x, temperature if race else x, keys if race else x, x if lookup is None else lookup,
                                 values, index, x.stride(0), v, n // len(keys) if race else 1, K=k,
                                 K_PAD=triton.next_power_of_2(k), BLOCK=1024, RACE=race, LOOKUP=lookup is not None)
    return values, index


_ROW_KEYS_BLOCK = 256


# No compiles mid-serving: sizes and strides change from step to step, and a stream's key,
# a hash, may be a multiple of 16 or not (it is typed by its range: start-up passes each).
@triton.jit(do_not_specialize=["s_seed0", "s_seed1", "s_count0", "s_count1", "C", "N", "stream_key"])
def _row_keys_kernel(seeds_ptr, counters_ptr, out_ptr, s_seed0, s_seed1, s_count0, s_count1, C, N, stream_key,
                     UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """`sampler._row_keys` (or, with UNIT, `sampler.hash_uniform`) of element i of a [N / C, C]
    broadcast of seeds and counters; stream_key is the stream's part, hashed on the host."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    r, c = i // C, i % C
    seed = tl.load(seeds_ptr + r * s_seed0 + c * s_seed1, mask=mask, other=0)
    counter = tl.load(counters_ptr + r * s_count0 + c * s_count1, mask=mask, other=0)
    h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ stream_key.to(tl.uint32))
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    if UNIT:
        tl.store(out_ptr + i, ((h >> 9).to(tl.float32) + 0.5) * (2.0 ** -23), mask=mask)
    else:
        tl.store(out_ptr + i, h.to(tl.int64), mask=mask)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor, stream_key: int, unit: bool) -> torch.Tensor:
    """`sampler._row_keys` (int64 keys) or, with `unit`, `sampler.hash_uniform` (float32) of the
    broadcast of int64 seeds and counters, in one kernel instead of some thirty eager ones."""
    shape = torch.broadcast_shapes(seeds.shape, counters.shape)
    cols = shape[-1] if shape else 1
    seeds2, counters2 = (torch.broadcast_to(t, shape).reshape(-1, cols) for t in (seeds, counters))
    out = torch.empty(shape, dtype=torch.float32 if unit else torch.int64, device=seeds.device)
    n = out.numel()
    if n:  # one block size whatever n, so that no batch builds another kernel
        _row_keys_kernel[(triton.cdiv(n, _ROW_KEYS_BLOCK),)](seeds2, counters2, out, *seeds2.stride(),
                                                             *counters2.stride(), cols, n, stream_key, UNIT=unit,
                                                             BLOCK=_ROW_KEYS_BLOCK)
    return out


# ---------------------------------------------------------------------------- top-p


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (-0.0 taken as 0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """The float32 whose `_order_key` is key."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _top_p_kernel(x_ptr, floor_ptr, top_p_ptr, out_ptr, stride, V, BLOCK: tl.constexpr, G: tl.constexpr):
    """Row r: the smallest value x among those >= floor[r] whose mass above it, W(x) (the
    sum of exp(v - max) over values v > x), is below top_p[r] times the mass of all of
    them: the last value the sorted cumulative mass keeps. A search over the values'
    order keys: each pass over the row narrows (lo, hi], with W(lo) >= target > W(hi), to
    one of G + 1 parts, until it holds one key, which is then x (W changes only at values).
    A row with top_p = 1 (off) gets -inf without a pass."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(top_p_ptr + row)
    if p < 1.0:
        tl.store(out_ptr + row, _top_p_search(x_ptr + row * stride, tl.load(floor_ptr + row), p, V, BLOCK, G))
    else:
        tl.store(out_ptr + row, float("-inf"))


@triton.jit
def _top_p_search(row_ptr, floor, p, V, BLOCK: tl.constexpr, G: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    bottom = tl.full((BLOCK,), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(row_ptr + start + offs, mask=mask, other=float("-inf"))
        top = tl.maximum(top, x)
        bottom = tl.minimum(bottom, tl.where(mask & (x >= floor), x, float("inf")))
    top_value = tl.max(top, axis=0)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(row_ptr + start + offs, mask=mask, other=float("-inf"))
        total += tl.where(mask & (x >= floor), tl.exp(x - top_value), 0.0)
    target = p * tl.sum(total, axis=0)
    lo = _order_key(tl.min(bottom, axis=0)).to(tl.int64) - 1  # every kept value lies above
    hi = _order_key(top_value).to(tl.int64)
    part = (tl.arange(0, G) + 1).to(tl.int64)
    while hi - lo > 1:
        cuts = (lo + (hi - lo) * part // (G + 1)).to(tl.int32)  # keys fit int32; their differences do not
        above = tl.zeros((G,), tl.float32)
        for start in range(0, V, BLOCK):
            mask = start + offs < V
            x = tl.load(row_ptr + start + offs, mask=mask, other=float("-inf"))
            w = tl.where(mask, tl.exp(x - top_value), 0.0)  # values above lo are >= floor anyway
            above += tl.sum(tl.where(_order_key(x)[:, None] > cuts[None, :], w[:, None], 0.0), axis=0)
        heavy = tl.sum((above >= target).to(tl.int32), axis=0)  # cuts with W >= target come first
        new_lo = tl.sum(tl.where(part == heavy, cuts, 0), axis=0).to(tl.int64)
        new_hi = tl.sum(tl.where(part == heavy + 1, cuts, 0), axis=0).to(tl.int64)
        lo = tl.where(heavy > 0, new_lo, lo)
        hi = tl.where(heavy < G, new_hi, hi)
    return _key_value(hi)


def top_p_threshold(scaled: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor, group: int = 8) -> torch.Tensor:
    """`sampler.processed_probs`'s top-p threshold per row over the values >= floor [N] (the
    top-k threshold, or -inf), without sorting the vocabulary: a few passes over each row,
    `group` (a power of 2) cuts tried per pass (8 was the fastest on an H200). It sums the
    kept mass in another order than the sort, so where a value's mass sits within rounding
    of the boundary the two may keep one value more or less. top_p [N] float32 in (0, 1]."""
    scaled = scaled if scaled.stride(-1) == 1 else scaled.contiguous()
    n, v = scaled.shape
    out = torch.empty(n, dtype=torch.float32, device=scaled.device)
    if n:
        _top_p_kernel[(n,)](scaled, floor.contiguous(), top_p, out, scaled.stride(0), v, BLOCK=1024, G=group,
                            num_warps=8)
    return out


# Strides change with the width, and a [B, 1] tensor's last stride is whatever its source's was.
@triton.jit(do_not_specialize=["sb0", "sb1", "sd0", "sd1", "su0", "su1", "K", "W"])
def _accept_matching_kernel(best_ptr, drafts_ptr, lens_ptr, u_ptr, tokens_ptr, accept_ptr, sb0, sb1, sd0, sd1, su0,
                          su1, K, W, SIMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """Row program: the accepted prefix of the drafts (each equal to the target's token
    at its position or, with SIMULATE, each drawing u < 1, up to the row's draft length),
    then the target's token after it."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    drafted = j < K
    draft = tl.load(drafts_ptr + row * sd0 + j * sd1, mask=drafted, other=0)
    best = tl.load(best_ptr + row * sb0 + j * sb1, mask=j < W, other=0)
    if SIMULATE:
        ok = tl.load(u_ptr + row * su0 + j * su1, mask=drafted, other=1.0) < 1.0
    else:
        ok = draft == best
    ok = ok & drafted & (j < tl.load(lens_ptr + row))
    accepted = tl.min(tl.where(ok, BLOCK, j), axis=0)  # the first position not accepted
    bonus = tl.sum(tl.where(j == accepted, best, 0), axis=0)
    tl.store(tokens_ptr + row * W + j, tl.where(j < accepted, draft, tl.where(j == accepted, bonus, 0)), mask=j < W)
    tl.store(accept_ptr + row, accepted + 1)


def accept_matching(best: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor,
                    u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.verify`'s acceptance in one kernel: the target's tokens best [B, W] (its
    draws, or argmax), the drafts [B, W - 1], their lengths [B] and, when simulating
    acceptance, the uniforms over each draft's acceptance rate [B, W - 1] (draft j accepted
    if u < 1). Returns token_ids [B, W] (zero past the one after the accepted prefix) and
    accept_lens [B]. The torch version is a dozen kernels."""
    b, w = best.shape
    tokens = torch.empty(b, w, dtype=torch.int64, device=best.device)
    accept = torch.empty(b, dtype=torch.int64, device=best.device)
    if b:
        u_strides = (0, 0) if u is None else u.stride()
        _accept_matching_kernel[(b,)](best, drafts, draft_lens.contiguous(), drafts if u is None else u, tokens, accept,
                                    *best.stride(), *drafts.stride(), *u_strides, w - 1, w,
                                    SIMULATE=u is not None, BLOCK=matching_tile(w))
    return tokens, accept


def matching_tile(width: int) -> int:
    """`accept_matching`'s tile for rows of `width` tokens: a kernel variant of its own."""
    return max(8, triton.next_power_of_2(width))


@triton.jit(do_not_specialize=["W", "R"])
def _accept_tree_kernel(targets_ptr, drafts_ptr, parents_ptr, depth_ptr, ancestors_ptr, lens_ptr, u_ptr, sim_ptr,
                        tokens_ptr, accept_ptr, path_ptr, W, R, SIMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """Row program: `tree.accept_tree`'s walk (with SIMULATE, `tree.simulated_choice`'s
    children) over one row's query tokens q (0 the root, c >= 1 node c), in registers."""
    row = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, BLOCK)
    inside = q < W
    node = (q >= 1) & (q <= tl.load(lens_ptr + row))
    parent = tl.load(parents_ptr + row * (W - 1) + q - 1, mask=node, other=0)
    draft = tl.load(drafts_ptr + row * (W - 1) + q - 1, mask=node, other=0)
    if SIMULATE:
        # Node c is taken if its rank among its siblings (the earlier nodes of its parent) is
        # the rank its parent's uniform draws: u in [first * (1 + .. + s^(r-1)), first * (1 + .. + s^r)).
        rank = tl.sum(((parent[:, None] == parent[None, :]) & (q[None, :] < q[:, None]) & node[None, :]).to(tl.int32),
                      axis=1)
        u = tl.load(u_ptr + row * W + parent, mask=node, other=2.0)
        level = tl.minimum(tl.load(depth_ptr + row * W + parent, mask=node, other=0), R - 1)
        first = tl.load(sim_ptr + row * (R + 1) + level, mask=node, other=0.0)
        sibling = tl.load(sim_ptr + row * (R + 1) + R)
        power = tl.full([BLOCK], 1.0, tl.float32)
        upto = tl.zeros([BLOCK], tl.float32)
        before = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(BLOCK):
            upto += tl.where(r <= rank, power, 0.0)
            before += tl.where(r < rank, power, 0.0)
            power = power * sibling
        taken = (u >= first * before) & (u < first * upto)
    else:
        taken = draft == tl.load(targets_ptr + row * W + parent, mask=node, other=-1)
    bit = tl.full([BLOCK], 1, tl.int64) << q.to(tl.int64)
    matched = tl.sum(tl.where(taken & node, bit, 0), axis=0) | 1  # distinct bits: the sum is their OR
    ancestors = tl.load(ancestors_ptr + row * W + q, mask=inside, other=0)
    on_path = ((ancestors & ~matched) == 0) & inside
    depth = tl.load(depth_ptr + row * W + q, mask=inside, other=-1)
    accept = tl.sum(on_path.to(tl.int64), axis=0)
    d = tl.arange(0, BLOCK)  # the path's node at each depth (0 past it)
    path = tl.sum(tl.where(on_path[None, :] & (depth[None, :] == d[:, None]), q[None, :], 0), axis=1)
    token = tl.load(targets_ptr + row * W + path)
    if SIMULATE:  # the drafts along the path are committed, then the target's draw
        after = tl.sum(tl.where(on_path[None, :] & (depth[None, :] == d[:, None] + 1), q[None, :], 0), axis=1)
        token = tl.where(d + 1 < accept, tl.load(drafts_ptr + row * (W - 1) + after - 1, mask=d + 1 < accept,
                                                 other=0), token)
    tl.store(tokens_ptr + row * W + d, token, mask=d < W)
    tl.store(path_ptr + row * W + d, path, mask=d < W)
    tl.store(accept_ptr + row, accept)


def accept_tree(targets: torch.Tensor, drafts: torch.Tensor, tree, lens: torch.Tensor, u: torch.Tensor | None = None,
                simulated: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.accept_tree` in one kernel (the torch walk is dozens): targets [B, W], the
    nodes' drafts [B, W - 1], their `tree.Tree` and lengths [B]; when simulating acceptance,
    each query token's uniform u [B, W] and the rates by depth with the sibling factor last
    (`SamplingTensors.simulated`). Returns token_ids [B, W] (unspecified past the
    accepted), accept_lens [B] and path [B, W]."""
    b, w = targets.shape
    tokens = torch.empty(b, w, dtype=torch.int64, device=targets.device)
    path = torch.empty(b, w, dtype=torch.int64, device=targets.device)
    accept = torch.empty(b, dtype=torch.int64, device=targets.device)
    if b:
        c = torch.Tensor.contiguous
        _accept_tree_kernel[(b,)](c(targets), c(drafts), c(tree.parents), c(tree.depth), c(tree.ancestors), c(lens),
                                  targets if u is None else c(u), targets if simulated is None else c(simulated),
                                  tokens, accept, path, w, 1 if simulated is None else simulated.shape[1] - 1,
                                  SIMULATE=u is not None, BLOCK=64)  # (W <= 64: `config.MAX_DRAFT_TOKENS`)
    return tokens, accept, path


def build_argmax_variants(vocab_size: int, device: torch.device, lookup: torch.Tensor | None = None) -> None:
    """Build `argmax` over this vocabulary (with `lookup`, if given) for rows split over several
    programs and for rows enough to take one each: the two variants the row count picks."""
    for n in (1, _BEST_PROGRAMS):
        argmax(torch.zeros(n, vocab_size, device=device), lookup=lookup)


def build_sampling_variants(vocab_size: int, max_width: int, device: torch.device, trees: bool = False) -> None:
    """Build, at start-up, every variant of the sampling and acceptance kernels that steps
    over this vocabulary can reach (verification up to `max_width` tokens a row), so that
    none is built inside a user's step. Sizes and strides that change from step to step are
    not specialised on; what is left are the kernels' flags, and the split of a row over
    programs, which depends on the row count. (The per-layer kernels take the model's fixed
    shapes: a forward builds them.)"""
    zeros = functools.partial(torch.zeros, device=device)
    build_argmax_variants(vocab_size, device)
    for n in (1, _BEST_PROGRAMS):
        race_sample(zeros(n, vocab_size), zeros(n, dtype=torch.int64))
    top_p_threshold(zeros(1, vocab_size), zeros(1), zeros(1) + 0.5)
    from tidal.layers.sampler import STREAM_ACCEPT, STREAM_SAMPLE, stream_key

    for stream in (STREAM_SAMPLE, STREAM_ACCEPT):
        for unit in (False, True):
            row_keys(zeros(1, dtype=torch.int64), zeros(1, dtype=torch.int64), stream_key(stream), unit)
    # Chains verify 2 .. max_width tokens a row; an engine that drafts trees verifies chains
    # of one node only. A width per tile.
    chain_widths = range(2, (2 if trees else max_width) + 1)
    for w in {matching_tile(w): w for w in chain_widths}.values():
        best, drafts = zeros(1, w, dtype=torch.int64), zeros(1, w - 1, dtype=torch.int64)
        for u in (None, zeros(1, w - 1)):  # (simulated acceptance, for benchmarks)
            accept_matching(best, drafts, zeros(1, dtype=torch.int64), u)
    if trees:
        from tidal.speculative.tree import Tree

        best, drafts = zeros(1, max_width, dtype=torch.int64), zeros(1, max_width - 1, dtype=torch.int64)
        tree = Tree.of(zeros(1, max_width - 1, dtype=torch.int64))
        for u, simulated in ((None, None), (zeros(1, max_width), zeros(1, 2))):
            accept_tree(best, drafts, tree, zeros(1, dtype=torch.int64), u, simulated)
