"""Trees of drafts: their shape, and which of their nodes the target accepts.

A request's tree is its root (the row's last committed token, query index 0) and its
nodes, best first (query indices 1 .. n): `parents[r]` is the query index of node r + 1's
parent, always a lower one, so the nodes of any prefix form a tree. A chain is the tree
whose node r + 1 hangs from node r.
"""

from __future__ import annotations

import torch


def tree_shape(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth and ancestors of every query token of trees parents [B, N]: depth [B, 1 + N]
    (the root's 0) and ancestors [B, 1 + N] int64, bit j set where query token j is the
    token itself or one of its ancestors (the attention mask of `ForwardBatch.tree_mask`).
    By pointer jumping: each round adds what the token's current ancestor has gathered and
    jumps twice as far, so a tree of any shape takes log2(1 + N) rounds of a few kernels."""
    b, n = parents.shape
    up = torch.cat([parents.new_zeros(b, 1), parents], 1)  # the root is its own parent
    index = torch.arange(1 + n, device=parents.device)
    depth = (index > 0).to(torch.int64).expand(b, 1 + n)
    ancestors = (1 << index).expand(b, 1 + n)
    for _ in range(n.bit_length()):
        depth = depth + depth.gather(1, up)
        ancestors = ancestors | ancestors.gather(1, up)
        up = up.gather(1, up)
    return depth, ancestors


def children(parents: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, N] bool: whether node c (query index c + 1) is a valid child of query token q."""
    valid = torch.arange(1, parents.shape[1] + 1, device=parents.device)[None, :] <= lens[:, None]
    return (parents[:, None, :] == torch.arange(width, device=parents.device)[None, :, None]) & valid[:, None, :]


def accept_tree(targets: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, lens: torch.Tensor,
                depth: torch.Tensor, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from its root: at a node, the target's own token there (`targets`
    [B, W], its draw or argmax at each query token) is committed, and the walk goes on into
    the child drafted as that token, if there is one. drafts [B, W - 1] and parents are the
    nodes (row i's first lens[i] valid), depth [B, W] their depths (`tree_shape`). Siblings
    are distinct tokens, so at most one child matches, and the nodes whose every ancestor
    matched form the path. Returns token_ids [B, W] (the targets along the path),
    accept_lens [B] (the path's nodes plus one) and path [B, W] (the query index at each
    depth; the root's 0, and 0 past the path). With `chosen` [B, W, N] (simulated
    acceptance), the child taken at each query token is the one chosen there, whatever its
    token, and the drafts along the path are committed."""
    b, w = targets.shape
    valid = torch.arange(1, w, device=targets.device)[None, :] <= lens[:, None]
    up = torch.cat([parents.new_zeros(b, 1), parents], 1)
    if chosen is None:
        taken = drafts == targets.gather(1, parents)  # each node is its parent's target token
    else:
        taken = chosen.any(1)  # (chosen[i, q, c] only where q is c's parent)
        targets = torch.where(chosen.any(-1), drafts.gather(1, chosen.to(torch.int64).argmax(-1)), targets)
    on_path = torch.cat([valid.new_ones(b, 1), taken & valid], 1)
    for _ in range((w - 1).bit_length()):  # a node is on the path if all its ancestors are
        on_path = on_path & on_path.gather(1, up)
        up = up.gather(1, up)
    nodes = torch.arange(w, device=targets.device).expand(b, w)
    path = torch.zeros_like(nodes).scatter_(1, torch.where(on_path, depth, 0), torch.where(on_path, nodes, 0))
    return targets.gather(1, path), on_path.sum(1), path


def simulated_choice(parents: torch.Tensor, lens: torch.Tensor, depth: torch.Tensor, rates: torch.Tensor,
                     sibling: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Benchmarks only: which child, if any, simulated acceptance takes at each query token
    ([B, W, N] bool, for `accept_tree`). At a node of depth m, its r-th best child is the
    target's token with probability rates[m] * sibling^r (`SimulatedAcceptance`), drawn
    with the uniform u [B, W]."""
    b, w = depth.shape
    first = rates.gather(1, depth.clamp(max=rates.shape[1] - 1))  # [B, W]: the best child's chance
    odds = first[:, :, None] * sibling[:, None, :] ** torch.arange(w - 1, device=depth.device)
    rank = (u[:, :, None] >= odds.cumsum(-1)).sum(-1)  # the rank taken (w - 1: none)
    earlier = torch.ones(w - 1, w - 1, dtype=torch.bool, device=depth.device).tril(-1)
    sibling_rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)  # [B, N]
    return children(parents, lens, w) & (sibling_rank[:, None, :] == rank[:, :, None])
