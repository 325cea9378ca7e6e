"""Verification of drafted tokens: greedy matching and lossless speculative sampling,
batched over requests with different draft lengths, without host syncs."""

from __future__ import annotations

import torch

from tidal.layers.sampler import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingTensors,
    greedy_tokens,
    hash_uniform,
    processed_probs,
    sample_from_probs,
)


def verify(
    target_logits: torch.Tensor,       # [B, W, V] float32
    draft_tokens: torch.Tensor,        # [B, W - 1] int64, row i valid up to draft_lens[i]
    draft_probs: torch.Tensor | None,  # [B, W - 1, V] float32, or None for a deterministic draft
    draft_lens: torch.Tensor,          # [B] int64, K_i in [0, W - 1]
    st: SamplingTensors,               # one row per request
    counters: torch.Tensor,            # [B] int64, output index of the token after the last committed one
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide which drafts to commit. Returns token_ids [B, W] int64 and accept_lens [B]
    int64: commit token_ids[i, :accept_lens[i]], 1 <= accept_lens[i] <= 1 + K_i (entries
    past accept_lens are unspecified).

    target_logits[i, j] is the target's distribution after input j (input 0 = last
    committed token, input j = draft j). Draft j is accepted only if all earlier ones were:
    greedy rows accept while the draft equals the target's argmax; sampling rows accept
    with probability min(1, p(d) / q(d)), where p is `processed_probs` of the target and q
    the draft distribution (one-hot on the draft when draft_probs is None). The token after
    the accepted prefix is sampled from normalise(max(p - q, 0)) at a rejection (p if that
    is all zero) or from p when every draft was accepted (the bonus token), which keeps the
    output distribution exactly the target's. Position j uses counter counters[i] + j, so
    with K_i = 0 this is the same draw as `sample`.

    With `st.simulated` (benchmarks only), draft j of row i is accepted with probability
    st.simulated[i, j], whatever its value, and the drafts themselves are committed; the
    output is then not the target's.
    """
    B, W, V = target_logits.shape
    K = W - 1
    positions = torch.arange(W, device=target_logits.device)
    seeds = st.seeds.unsqueeze(1)

    greedy_only = st.all_greedy
    simulated = None if st.simulated is None else st.simulated[:, :K]
    if greedy_only:
        target_argmax = greedy_tokens(target_logits)  # [B, W]
        if target_logits.is_cuda:
            from tidal.layers import fused  # the rest in one kernel

            u = None if simulated is None else hash_uniform(
                seeds, counters.unsqueeze(1) + positions[:K], STREAM_ACCEPT) / simulated
            return fused.greedy_accept(target_argmax, draft_tokens, draft_lens, u)
    else:
        p = processed_probs(target_logits.reshape(B * W, V), st.repeat_rows(W)).view(B, W, V)

    if simulated is not None:
        u = hash_uniform(seeds, counters.unsqueeze(1) + positions[:K], STREAM_ACCEPT)
        accept = u < simulated
    elif greedy_only:
        accept = draft_tokens == target_argmax[:, :K]
    else:
        u = hash_uniform(seeds, counters.unsqueeze(1) + positions[:K], STREAM_ACCEPT)
        p_draft = p[:, :K].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
        if draft_probs is None:
            accept = u < p_draft
        else:
            accept = u < p_draft / draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    accept = accept & (positions[:K] < draft_lens.unsqueeze(1))
    num_accepted = accept.long().cumprod(1).sum(1)  # [B]

    if greedy_only:
        next_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    else:
        weights = p.gather(1, num_accepted.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # p at the stop position
        if simulated is None and K > 0:
            weights = _residual(weights, num_accepted, draft_tokens, draft_probs, draft_lens)
        next_token = sample_from_probs(weights, st.seeds, counters + num_accepted, STREAM_SAMPLE)

    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    token_ids = padded.scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return token_ids, num_accepted + 1


def _residual(p: torch.Tensor, num_accepted: torch.Tensor, draft_tokens: torch.Tensor,
              draft_probs: torch.Tensor | None, draft_lens: torch.Tensor) -> torch.Tensor:
    """Weights for the token after the accepted prefix: max(p - q, 0) where a draft was
    rejected (p if that is all zero), p where all drafts were accepted. Unnormalised:
    sampling does not need the sum."""
    B, V = p.shape
    at = num_accepted.clamp(max=draft_tokens.shape[1] - 1).unsqueeze(1)  # the rejected draft, if any
    if draft_probs is None:
        residual = p.scatter(1, draft_tokens.gather(1, at), 0.0)
    else:
        q = draft_probs.gather(1, at.unsqueeze(2).expand(B, 1, V)).squeeze(1)
        residual = (p - q).clamp_min(0.0)
    rejected = (num_accepted < draft_lens) & (residual.sum(-1) > 0)
    return torch.where(rejected.unsqueeze(1), residual, p)
