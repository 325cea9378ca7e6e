"""Mixture-of-Experts MLP: a softmax top-k router over experts that are SwiGLU MLPs.

The experts' weights are stacked, gate|up [E, 2I, H] and down [E, H, I], so that on CUDA one
fused kernel runs every expert a step routes to (`fused_moe`: two GEMM launches, CUDA-graph
capturable, with the routing and grouping before them); elsewhere `experts_reference` loops
over the experts hit, the kernel's oracle. Checkpoints store experts one by one (Qwen3-MoE's
gate/up/down_proj, Mixtral's w1/w3/w2) or stacked as transformers 5 holds them; both load. Under tensor
parallelism each expert is split as a dense MLP is (gate/up by rows, down by columns) and the
partial sums are all-reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tidal.layers.linear import Linear, copy_checked, norm_product, split_size, tp_rank_size


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up), (gate, up) = w13[e] @ x[t],
    e = topk_ids[t, j]: a loop over the experts hit, in the op order of transformers'
    Qwen3MoeExperts (bit-identical to it in float32): each expert's rows in (slot, token)
    order, its output times the weights cast to x.dtype, index_add_ into x.dtype zeros."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():
        slot, token = torch.where(topk_ids.t() == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of the softmax over all experts (in float32), renormalised to sum to one when
    `renormalize`: the router's torch ops, and the oracle of its kernel (`fused_moe.route`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """E SwiGLU MLPs as two stacked parameters (this rank's slice of each expert's width)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank, tp_size = tp_rank_size()
        width = split_size(intermediate_size, tp_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, width), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        self.full_width = intermediate_size

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """`loaded` is all experts' gate|up [E, 2I, H] (shard_id None), or expert e's gate
        (shard_id (e, 0)) or up ((e, 1)) [I, H]."""
        width = param.shape[1] // 2
        start = self.tp_rank * width
        if shard_id is None:
            _check_shape(loaded, (param.shape[0], 2 * self.full_width, param.shape[2]))
            for half, part in enumerate(loaded.chunk(2, dim=1)):
                copy_checked(param.data[:, half * width:(half + 1) * width], part.narrow(1, start, width))
        else:
            expert, half = shard_id
            _check_shape(loaded, (self.full_width, param.shape[2]))
            copy_checked(param.data[expert, half * width:(half + 1) * width], loaded.narrow(0, start, width))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """`loaded` is all experts' down [E, H, I] (shard_id None), or expert e's [H, I]
        (shard_id e)."""
        width = param.shape[2]
        if shard_id is None:
            _check_shape(loaded, (param.shape[0], param.shape[1], self.full_width))
            copy_checked(param.data, loaded.narrow(2, self.tp_rank * width, width))
        else:
            _check_shape(loaded, (param.shape[1], self.full_width))
            copy_checked(param.data[shard_id], loaded.narrow(1, self.tp_rank * width, width))


def _check_shape(loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: expected {tuple(shape)}, checkpoint tensor {tuple(loaded.shape)}")


class SparseMoE(nn.Module):
    """Router (`gate`, replicated on every rank) and experts. The routing weights are the
    softmax over all experts (in float32) at the top k, renormalised to sum to one when
    `norm_topk_prob` (always for Mixtral; a config field for Qwen3-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.tp_size = tp_rank_size()[1]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for normed tokens x [T, H]."""
        logits = self.gate(x)
        if logits.is_cuda:
            from tidal.layers.fused_moe import route

            return route(logits, self.top_k, self.norm_topk_prob)
        return route_reference(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(MoE(norm(x + residual)), x + residual). The norm rides in the router's product
        (`norm_product`), which hands the normed tokens on to the experts; on CUDA the
        routing, the grouping by expert and the experts run from the router's logits
        (`fused_moe.routed_moe`)."""
        logits, normed, stream = norm_product(norm, x, residual, self.gate)
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if logits.is_cuda:
            from tidal.layers.fused_moe import routed_moe

            y = routed_moe(normed, logits, w13, w2, self.top_k, self.norm_topk_prob)
        else:
            y = experts_reference(normed, w13, w2, *route_reference(logits, self.top_k, self.norm_topk_prob))
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y, stream
