"""RMSNorm with an optional fused residual add (the decoder keeps the residual stream
separate so each layer adds it inside the norm instead of in its own kernel)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """norm(x) -> normed, or norm(x, residual) -> (norm(x + residual), x + residual);
        normed is written to `out` if given (e.g. a slice of a concatenation).

        Same order of operations as transformers: add in the model dtype, normalise in
        float32, cast back, then scale by the weight."""
        if x.is_cuda:
            from tidal.layers import fused

            return fused.rms_norm(x, self.weight, self.eps, residual, out)
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * h.to(x.dtype)
        if out is not None:
            normed = out.copy_(normed)
        return normed if residual is None else (normed, x)
