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
    token itself or one of its ancestors (the attention mask of `ForwardBatch.tree_mask`)."""
    b, n = parents.shape
    depth = torch.zeros(b, 1 + n, dtype=torch.int64, device=parents.device)
    ancestors = torch.ones(b, 1 + n, dtype=torch.int64, device=parents.device)
    for r in range(n):
        parent = parents[:, r:r + 1]
        depth[:, r + 1:r + 2] = depth.gather(1, parent) + 1
        ancestors[:, r + 1:r + 2] = ancestors.gather(1, parent) | (1 << (r + 1))
    return depth, ancestors


def children(parents: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, N] bool: whether node c (query index c + 1) is a valid child of query token q."""
    valid = torch.arange(1, parents.shape[1] + 1, device=parents.device)[None, :] <= lens[:, None]
    return (parents[:, None, :] == torch.arange(width, device=parents.device)[None, :, None]) & valid[:, None, :]


def accept_tree(targets: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor,
                lens: torch.Tensor, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from its root: at a node, the target's own token there (`targets`
    [B, W], its draw or argmax at each query token) is committed, and the walk goes on into
    the child drafted as that token, if there is one. drafts [B, W - 1] and parents are the
    nodes (row i's first lens[i] valid). Siblings are distinct tokens, so at most one child
    matches. Returns token_ids [B, W] (the targets along the path), accept_lens [B] (the
    path's nodes plus one) and path [B, W] (the query index at each depth; the root's 0,
    entries past the path repeat its end). With `chosen` [B, W, N] (simulated acceptance),
    the child the walk takes at each query token is the one chosen there, whatever its token,
    and the drafts along the path are committed."""
    b, w = targets.shape
    device = targets.device
    # child[i, q]: the node drafted as the target's token at query token q (0: none).
    matches = children(parents, lens, w) & (drafts[:, None, :] == targets[:, :, None] if chosen is None else chosen)
    child = torch.where(matches.any(-1), matches.to(torch.int64).argmax(-1) + 1, 0)
    if chosen is not None:
        targets = torch.where(child > 0, drafts.gather(1, (child - 1).clamp(min=0)), targets)
    path = torch.zeros(b, w, dtype=torch.int64, device=device)
    for depth in range(1, w):
        step = child.gather(1, path[:, depth - 1:depth])
        path[:, depth:depth + 1] = torch.where(step > 0, step, path[:, depth - 1:depth])
    accept_lens = 1 + (path[:, 1:] != path[:, :-1]).sum(1)
    return targets.gather(1, path), accept_lens, path


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
