"""Reference attention in plain torch: one request at a time, scores in float32.

It is slow and simple on purpose: it is the oracle the Triton kernels are tested against,
and the CPU backend for tests."""

from __future__ import annotations

import torch

from tidal.batch import ForwardBatch


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
    ) -> torch.Tensor:
        store_kv(k, v, kv_cache, batch.slot_mapping)
        page_size = kv_cache.shape[2]
        out = torch.empty_like(q)
        starts = batch.query_start_loc.tolist()
        for i, (seq_len, pages) in enumerate(zip(batch.seq_lens.tolist(), batch.page_table)):
            start, end = starts[i], starts[i + 1]
            if start == end:
                continue
            pages = pages[: (seq_len + page_size - 1) // page_size]
            keys = kv_cache[0, pages].flatten(0, 1)[:seq_len]
            values = kv_cache[1, pages].flatten(0, 1)[:seq_len]
            out[start:end] = causal_attention(q[start:end], keys, values, scale)
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's k/v at its slot; slot -1 means "do not store" (padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a context of keys/values [L, Hkv, D]:
    query j sees keys 0 .. L - n + j. Grouped-query heads share a kv head."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    query_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    scores.masked_fill_(key_pos > query_pos, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)
