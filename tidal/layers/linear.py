"""Linear layers whose parameters know how to load themselves (`param.weight_loader`).

They are written for tensor parallelism: a column layer keeps its rank's slice of the
output features, a row layer its slice of the input features (and all-reduces the partial
sums). Loaders take the full checkpoint tensor and narrow it to the rank's slice. With no
process group set up (the default) every layer is whole on rank 0 of 1.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tp_rank_size() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group: the default process group if one is
    initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), refusing a shape mismatch (copy_ would broadcast silently)."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint tensor {tuple(src.shape)}")
    dst.copy_(src)


def one_token_on_cuda(x: torch.Tensor) -> bool:
    """Whether x [T, in] is a single contiguous token on CUDA (a batch-1 decode), whose
    products run `fused.gemv`: it beats cuBLAS there."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight^T: `fused.gemv` for one token on CUDA, cuBLAS otherwise."""
    if one_token_on_cuda(x):
        from tidal.layers import fused

        return fused.gemv(x, weight)
    return F.linear(x, weight)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded)


def split_size(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {tp_size}")
    return size // tp_size


class Linear(nn.Module):
    """y = x W^T + b with the whole weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return matmul(x, self.weight)
        return F.linear(x, self.weight, self.bias)


class MergedColumnLinear(Linear):
    """Several projections of the same input fused into one matmul (q|k|v, gate|up).

    Each checkpoint tensor is loaded into its block with `weight_loader(param, tensor,
    shard_id)`, where shard_id is one of `shard_ids` (default 0, 1, ...)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_ids: Sequence[Hashable] | None = None,
    ):
        rank, tp_size = tp_rank_size()
        self.local_sizes = [split_size(s, tp_size, "output size") for s in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias)
        self.shard_ids = tuple(shard_ids if shard_ids is not None else range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
        index = self.shard_ids.index(shard_id)
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class RowLinear(Linear):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        _, tp_size = tp_rank_size()
        super().__init__(split_size(in_features, tp_size, "input size"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias
