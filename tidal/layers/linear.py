"""Linear layers whose parameters know how to load themselves (`param.weight_loader`).

They are written for tensor parallelism (Megatron's split): a column layer keeps its rank's
slice of the output features, a row layer its slice of the input features (and all-reduces
the partial sums), attention's q|k|v its rank's heads, a vocabulary-sized matrix its slice of
the vocabulary. Loaders take the full checkpoint tensor and narrow it to the rank's slice.
Layers built inside `tensor_parallel(rank, size)` are split so; layers built outside it (the
default, and a drafter, which rank 0 runs alone) are whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tidal.layers.activation import SiluAndMul

NORM_GEMV_MAX_K = 16384  # `fused.norm_gemv` holds the normed row in registers

_split = (0, 1)  # (rank, ranks) that layers being built take their slice for


@contextmanager
def tensor_parallel(rank: int, size: int):
    """Build layers as rank `rank`'s slice of a model split over `size` ranks (the
    collectives they run use the default process group)."""
    global _split
    outer, _split = _split, (rank, size)
    try:
        yield
    finally:
        _split = outer


def tp_rank_size() -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split that layers built now take: (0, 1), whole,
    outside `tensor_parallel`."""
    return _split


def heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, kv heads) of one rank: the query heads split evenly, the kv heads too,
    or, with fewer kv heads than ranks, the one kv head its query heads read (so a kv head
    is held by tp_size / num_kv_heads ranks)."""
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)


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


def norm_product(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, layer: "Linear",
                 gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(product, normed, stream) of the residual stream before a norm and the product after
    it: stream = x + residual (x when residual is None: x is the embedding), normed =
    norm(stream) (an `RMSNorm`), product = layer(normed), SiluAndMul'd when `gated` (layer a
    fused [gate | up]). `layer` is a column or replicated layer (its input whole on every
    rank). For one token on CUDA the three are one kernel (`fused.norm_gemv`): at batch 1
    the norm before each product was a launch of its own."""
    if one_token_on_cuda(x) and (residual is None or one_token_on_cuda(residual)) and x.shape[1] <= NORM_GEMV_MAX_K:
        from tidal.layers import fused

        return fused.norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias, gated)
    normed, stream = (norm(x), x) if residual is None else norm(x, residual)
    product = layer(normed)
    return SiluAndMul()(product) if gated else product, normed, stream


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
        self.starts = [rank * size for size in self.local_sizes]  # of the rank's rows in each checkpoint tensor
        super().__init__(in_features, sum(self.local_sizes), bias)
        self.shard_ids = tuple(shard_ids if shard_ids is not None else range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
        index = self.shard_ids.index(shard_id)
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.starts[index], size))


class QKVLinear(MergedColumnLinear):
    """Attention's q|k|v projection, split by heads (`heads_per_rank`): a rank holds its query
    heads and the kv heads they read, so that it attends without the others."""

    def __init__(self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        rank, tp_size = tp_rank_size()
        q_heads, kv_heads = heads_per_rank(num_heads, num_kv_heads, tp_size)
        self.local_sizes = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        first_kv = rank * num_kv_heads // tp_size * head_dim
        self.starts = [rank * q_heads * head_dim, first_kv, first_kv]
        Linear.__init__(self, in_features, sum(self.local_sizes), bias)
        self.shard_ids = ("q", "k", "v")


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


class VocabEmbedding(nn.Module):
    """A vocabulary-sized matrix [V, H] split over the ranks by rows: rank r holds rows
    [r * n, (r + 1) * n), n = ceil(V / ranks), the last slice padded with zeros. As the input
    embedding (`forward`) a token's vector comes from the one rank that holds it (the others
    add zeros in the all-reduce); as the LM head (`logits`) each rank scores its slice of the
    vocabulary and rank 0 gathers the slices."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"shape mismatch: expected {(self.vocab_size, param.shape[1])}, checkpoint tensor "
                             f"{tuple(loaded.shape)}")
        rows = loaded[self.start:self.start + self.rows]
        param.data[len(rows):].zero_()
        copy_checked(param.data[:len(rows)], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        elsewhere = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill_(elsewhere[:, None], 0)
        dist.all_reduce(out)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [T, V] in float32 on rank 0; None on the other ranks."""
        local = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return local.float()
        slices = [torch.empty_like(local) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(local, slices, dst=0)
        return None if slices is None else torch.cat(slices, dim=-1)[:, :self.vocab_size].float()
