"""Verification of drafted tokens, batched over requests with different draft lengths,
without host syncs.

Every position's token is the target's own draw there, the one plain sampling makes at that
output index: the argmax of its processed probabilities raced against exponential noise
hashed from (seed, output index, token id) (`sample_from_probs`; a greedy row's is its
argmax). A draft is accepted when it equals the target's draw at its position, and the
token after the accepted ones is the target's draw there. So what a request commits is
exactly what it would sample without speculation: lossless, and a seeded request's
tokens do not depend on K, the batch or the schedule. A drafter that samples with the same
noise (`ChainDrafter`) proposes the target's token whenever its distribution agrees.

A tree of drafts is verified the same way: every node's token is the target's draw at the
node's depth, and the walk from the root follows the child drafted as that token
(`tree.accept_tree`). What is committed is again the target's draws along one path.
"""

from __future__ import annotations

import torch

from tidal.layers.sampler import STREAM_ACCEPT, SamplingTensors, greedy_tokens, hash_uniform, sample
from tidal.speculative.tree import Tree, accept_tree, simulated_choice


def verify(
    target_logits: torch.Tensor,       # [B, W, V] float32
    draft_tokens: torch.Tensor,        # [B, W - 1] int64, row i valid up to draft_lens[i]
    draft_lens: torch.Tensor,          # [B] int64, K_i in [0, W - 1] (not read at W = 1)
    st: SamplingTensors,               # one row per request
    counters: torch.Tensor,            # [B] int64, output index of the token after the last committed one
    tree: Tree | None = None,          # the drafts' trees; None: chains
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decide which drafts to commit. Returns token_ids [B, W] int64, accept_lens [B]
    int64 and, for trees, the accepted path (`tree.accept_tree`; None for chains): commit
    token_ids[i, :accept_lens[i]], 1 <= accept_lens[i] <= 1 + K_i (entries past
    accept_lens are unspecified). target_logits[i, j] is the target's distribution
    after input j (input 0 = the last committed token, input j = draft j); position j's draw
    uses output index counters[i] + j, so with K_i = 0 this is `sample`'s draw.

    With `st.simulated` (benchmarks only), draft j of row i is accepted with probability
    st.simulated[i, j], whatever its value, and the drafts themselves are committed; the
    output is then not the target's. For trees, a node's r-th best child is taken with
    probability st.simulated[i, depth] * sibling^r, the sibling factor in its last column
    (`tree.simulated_choice`).
    """
    B, W, V = target_logits.shape
    K = W - 1
    if K == 0:  # plain sampling
        return sample(target_logits[:, 0], st, counters)[:, None], torch.ones(B, dtype=torch.int64,
                                                                              device=target_logits.device), None
    positions = torch.arange(W, device=target_logits.device)
    if tree is not None:  # a node's draw is at its depth's output index
        positions = tree.depth
    if st.all_greedy:
        targets = greedy_tokens(target_logits)  # [B, W]
    else:
        targets = sample(target_logits.reshape(B * W, V), st.repeat_rows(W),
                         (counters.unsqueeze(1) + positions).reshape(-1)).view(B, W)
    if tree is not None:
        u = chosen = None
        if st.simulated is not None:  # its last column is the sibling factor
            u = hash_uniform(st.seeds.unsqueeze(1), counters.unsqueeze(1) + positions, STREAM_ACCEPT)
        if target_logits.is_cuda:
            from tidal.layers import fused  # the walk in one kernel

            return fused.accept_tree(targets, draft_tokens, tree, draft_lens, u, st.simulated)
        if u is not None:
            rates, sibling = st.simulated[:, :-1], st.simulated[:, -1:]
            chosen = simulated_choice(tree.parents, draft_lens, positions, rates, sibling, u)
        return accept_tree(targets, draft_tokens, tree, draft_lens, chosen)
    u = None
    if st.simulated is not None:
        u = hash_uniform(st.seeds.unsqueeze(1), counters.unsqueeze(1) + positions[:K], STREAM_ACCEPT) \
            / st.simulated[:, :K]
    if target_logits.is_cuda:
        from tidal.layers import fused  # the rest in one kernel

        return *fused.accept_matching(targets, draft_tokens, draft_lens, u), None
    accept = u < 1 if u is not None else draft_tokens == targets[:, :K]
    accept = accept & (positions[:K] < draft_lens.unsqueeze(1))
    num_accepted = accept.long().cumprod(1).sum(1)  # [B]
    next_token = targets.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    token_ids = padded.scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return token_ids, num_accepted + 1, None
