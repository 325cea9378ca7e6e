"""Draft-model proposer: a smaller causal LM with the target's vocabulary, with its own KV
cache addressed through the target's page tables (same slots, separate tensors).

The drafter's KV entry at position p holds token p, so entries for drafts the target
accepted stay valid: after drafting k tokens it has absorbed num_tokens + k - 1, and the
scheduler trims that to what the target kept.
"""

from __future__ import annotations

import torch

from tidal.models.config import ModelConfig
from tidal.models.loader import load_model
from tidal.speculative.proposer import ChainDrafter


class DraftModelProposer(ChainDrafter):
    def __init__(self, model_dir: str, runner, target_config: ModelConfig, topk: int = 1, depth: int = 0):
        self.config = ModelConfig.from_pretrained(model_dir)
        if self.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: drafter vocabulary ({self.config.vocab_size} tokens) differs from "
                f"the target's ({target_config.vocab_size})")
        super().__init__(runner, target_config.vocab_size, topk, depth)
        self.model = load_model(model_dir, runner.dtype, runner.device, runner.attn, runner.config.load_format)
        self.kv_caches: list[torch.Tensor] = []

    @property
    def bytes_per_page(self) -> int:
        return self.runner.kv_bytes_per_page(self.config)

    def allocate_cache(self) -> None:
        self.kv_caches = list(self.runner.allocate_kv(self.config, self.runner.num_pages).unbind(0))

    def catch_up(self, reqs, starts, ends):
        return [r.token_ids[s:e] + [0] * max(e - r.num_tokens, 0) for r, s, e in zip(reqs, starts, ends)], None

    def feed_width(self, k):
        # The token a verification in flight feeds first and the K + 1 it commits.
        return k + 2

    def catch_up_end(self, req, pending):
        return req.num_tokens + pending

    def next_position(self, req, j, pending):
        return req.num_tokens + pending + j - 1

    def forward(self, batch, state):
        hidden = self.model(batch.input_ids, batch, self.kv_caches)
        return self.model.compute_logits(batch.at_last_tokens(hidden)), None

    def absorbed(self, req, k, pending):
        return req.num_tokens + pending + k - 1
