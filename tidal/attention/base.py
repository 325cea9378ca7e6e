"""The attention backend protocol.

A KV cache for one layer is a tensor [2, num_pages, page_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Token at position p of a request lives in slot
page_table[p // page_size] * page_size + p % page_size.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tidal.batch import ForwardBatch
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,         # [T, num_heads, head_dim]
        k: torch.Tensor,         # [T, num_kv_heads, head_dim]
        v: torch.Tensor,         # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
        batch: ForwardBatch,
        scale: float,
        rotary: RotaryEmbedding | None = None,
        out: torch.Tensor | None = None,  # where to write the result (q's shape and dtype)
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,  # Qwen3's per-head q and k norms
    ) -> torch.Tensor:           # [T, num_heads, head_dim]
        """Norm q and k head by head by `qk_norm` and rotate them by `rotary` at
        batch.positions (a backend may fuse both with the store), store k/v at
        batch.slot_mapping (skipping -1), then attend causally over each request's cached
        context plus its new tokens. Rows of `out` past the batch's real tokens (padding)
        are left as they were."""
        ...


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from tidal.attention.torch_ref import TorchAttention

        return TorchAttention()
    if name == "triton":
        from tidal.attention.triton_attn import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend: unknown backend {name!r} (expected 'torch' or 'triton')")
