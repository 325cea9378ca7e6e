"""Reference attention in plain torch, scores in float32.

It is simple on purpose: it is the oracle the Triton kernels are tested against, and the
CPU backend. Requests with a few query tokens (decodes, verifications) are attended in one
batched pass, padded to the longest context among them, because on the CPU a Python loop
over requests would cost more than the arithmetic; a longer chunk (prefill) goes alone."""

from __future__ import annotations

import torch

from tidal.batch import ForwardBatch
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding

BATCHED_QUERY_LEN = 16  # requests with at most this many query tokens share one pass


class TorchAttention:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        rotary: RotaryEmbedding | None = None,
        out: torch.Tensor | None = None,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rotary is not None:
            q, k = rotary(batch.positions, q, k)
        store_kv(k, v, kv_cache, batch.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        rows = [i for i in range(len(seq_lens)) if starts[i + 1] > starts[i]]
        short = [i for i in rows if starts[i + 1] - starts[i] <= BATCHED_QUERY_LEN]
        groups = ([short] if short else []) + [[i] for i in rows if starts[i + 1] - starts[i] > BATCHED_QUERY_LEN]
        for group in groups:
            attend(q, out, kv_cache, batch.page_table, starts, seq_lens, group, scale,
                   None if batch.tree_mask is None else (batch.tree_mask, batch.tree_start))
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's k/v at its slot; slot -1 means "do not store" (padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def attend(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
           starts: list[int], seq_lens: list[int], rows: list[int], scale: float,
           tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Causal attention for `rows`, written into `out`. Row r's n query tokens are the last
    n positions of its context of seq_lens[r] keys: query j sees keys 0 .. seq_len - n + j;
    with `tree` (`ForwardBatch.tree_mask`, `tree_start`), of the keys from tree_start[r] on
    only those its mask names.
    Queries are padded to the longest n and contexts to the longest seq_len; the padding
    is masked out (keys) or dropped (queries). Grouped-query heads share a kv head."""
    _, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    device = q.device
    lens = [starts[r + 1] - starts[r] for r in rows]
    width, context = max(lens), max(seq_lens[r] for r in rows)
    index = torch.tensor([[starts[r] + min(j, n - 1) for j in range(width)] for r, n in zip(rows, lens)], device=device)
    query_pos = torch.tensor([[seq_lens[r] - n + j for j in range(width)] for r, n in zip(rows, lens)], device=device)
    pages = page_table[torch.tensor(rows, device=device)][:, :-(-context // page_size)]
    keys = kv_cache[0, pages].flatten(1, 2)[:, :context].float()    # [b, L, kv heads, D]
    values = kv_cache[1, pages].flatten(1, 2)[:, :context].float()
    queries = q[index].float().view(len(rows), width, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bwkgd,blkd->bkgwl", queries, keys) * scale
    keys_at = torch.arange(context, device=device)
    hidden = keys_at[None, None, :] > query_pos[:, :, None]  # [b, W, L]: future or padding
    if tree is not None:
        mask, start = tree
        rel = keys_at[None, None, :] - start[torch.tensor(rows, device=device)].long()[:, None, None]
        bits = (mask[index][:, :, None] >> rel.clamp(0, 63)) & 1
        hidden |= (rel >= 0) & (bits == 0)
    scores.masked_fill_(hidden[:, None, None], float("-inf"))
    result = torch.einsum("bkgwl,blkd->bwkgd", scores.softmax(dim=-1), values).flatten(2, 3)
    valid = torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    out[index[valid]] = result[valid].to(out.dtype)
