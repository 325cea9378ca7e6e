"""Trees of drafts: their shape, and which of their nodes the target accepts.

A request's tree is its root (the row's last committed token, query index 0) and its
nodes, best first (query indices 1 .. n): `parents[r]` is the query index of node r + 1's
parent, always a lower one, so the nodes of any prefix form a tree. A chain is the tree
whose node r + 1 hangs from node r.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Tree:
    """A step's trees on the device: each node's parent [B, N], and each query token's
    depth and ancestors [B, 1 + N] (`tree_shape`), found once, where the trees are grown
    (inside the growth's graph), for the target's forward and the walk to share."""

    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor

    @staticmethod
    def of(parents: torch.Tensor) -> Tree:
        return Tree(parents, *tree_shape(parents))

    @staticmethod
    def flat(b: int, n: int, device: torch.device) -> Tree:
        """b trees of n nodes, each hanging from the root (`tree_shape` of zero parents)."""
        query = torch.arange(1 + n, device=device)
        return Tree(query.new_zeros(b, n), (query > 0).to(torch.int64).repeat(b, 1), ((1 << query) | 1).repeat(b, 1))

    def rows(self, index: torch.Tensor) -> Tree:
        return Tree(self.parents[index], self.depth[index], self.ancestors[index])


def children(parents: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, N] bool: whether node c (query index c + 1) is a valid child of query token q."""
    valid = torch.arange(1, parents.shape[1] + 1, device=parents.device)[None, :] <= lens[:, None]
    return (parents[:, None, :] == torch.arange(width, device=parents.device)[None, :, None]) & valid[:, None, :]


def accept_tree(targets: torch.Tensor, drafts: torch.Tensor, tree: Tree, lens: torch.Tensor,
                chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from its root: at a node, the target's own token there (`targets`
    [B, W], its draw or argmax at each query token) is committed, and the walk goes on into
    the child drafted as that token, if there is one. drafts [B, W - 1] are the nodes' tokens
    (row i's first lens[i] valid). Siblings are distinct tokens, so at most one child
    matches, and the path is the nodes whose every ancestor matched (the root matches: its
    ancestors' bits within the matched ones). Returns token_ids [B, W] (the targets along
    the path), accept_lens [B] (the path's nodes plus one) and path [B, W] (the query index
    at each depth; the root's 0, and 0 past the path). With `chosen` [B, W, N] (simulated
    acceptance), the child taken at each query token is the one chosen there, whatever its
    token, and the drafts along the path are committed. `fused.accept_tree` is the same
    walk in one kernel."""
    b, w = targets.shape
    query = torch.arange(w, device=targets.device)
    valid = query[1:] <= lens[:, None]
    if chosen is None:
        taken = drafts == targets.gather(1, tree.parents)  # each node is its parent's target token
    else:
        taken = chosen.any(1)  # (chosen[i, q, c] only where q is c's parent)
        targets = torch.where(chosen.any(-1), drafts.gather(1, chosen.to(torch.int64).argmax(-1)), targets)
    # The matched nodes' bits, the root's included: distinct bits, so their sum is their OR.
    matched = ((taken & valid).to(torch.int64) << query[1:]).sum(1, keepdim=True) | 1
    on_path = (tree.ancestors & ~matched) == 0
    path = torch.zeros_like(tree.depth).scatter_(1, torch.where(on_path, tree.depth, 0),
                                                 torch.where(on_path, query, 0))
    return targets.gather(1, path), on_path.sum(1), path


def simulated_choice(parents: torch.Tensor, lens: torch.Tensor, depth: torch.Tensor, rates: torch.Tensor,
                     sibling: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Benchmarks only: which child, if any, simulated acceptance takes at each query token
    ([B, W, N] bool, for `accept_tree`). At a node of depth m, its r-th best child is the
    target's token with probability rates[m] * sibling^r (`SimulatedAcceptance`), drawn
    with the uniform u [B, W]."""
    b, w = depth.shape
    first = rates.gather(1, depth.clamp(max=rates.shape[1] - 1))  # [B, W]: the best child's chance
    # The chance that one of the first r + 1 children is taken, first * (1 + s + ... + s^r):
    # powers by products and sums in order, as `fused.accept_tree` makes them.
    powers = torch.cat([torch.ones_like(sibling), sibling.expand(b, w - 2)], 1).cumprod(1)
    below = first[:, :, None] * powers.cumsum(1)[:, None, :]
    rank = (u[:, :, None] >= below).sum(-1)  # the rank taken (w - 1: none)
    earlier = torch.ones(w - 1, w - 1, dtype=torch.bool, device=depth.device).tril(-1)
    sibling_rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)  # [B, N]
    return children(parents, lens, w) & (sibling_rank[:, None, :] == rank[:, :, None])
