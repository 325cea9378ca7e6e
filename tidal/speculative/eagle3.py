"""EAGLE-3 proposer: a one-layer head that drafts from the target's own hidden states.

The head's KV entry at position p is built from (token p + 1, target hidden state at p).
The target keeps its hidden states per KV slot (`runner.aux_cache`), so a request that
sat at K = 0 catches up over everything it missed in one batched extend. Further draft
positions feed the head's own output hidden state; those entries are not the target's,
so after drafting the head's progress is set back to the last position built from target
states (`num_absorbed = num_tokens - 1`).
"""

from __future__ import annotations

import torch

from tidal.batch import to_device
from tidal.models.config import ModelConfig
from tidal.models.eagle3 import Eagle3Config, load_eagle3
from tidal.models.loader import default_aux_layer_ids
from tidal.speculative.proposer import ChainDrafter


class Eagle3Proposer(ChainDrafter):
    def __init__(self, model_dir: str, runner, target_config: ModelConfig, topk: int = 1, depth: int = 0):
        self.config = Eagle3Config.from_pretrained(model_dir, target_config)
        super().__init__(runner, target_config.vocab_size, topk, depth, self.config.draft_vocab_size)
        self.head = load_eagle3(model_dir, runner.model, runner.dtype, runner.device, runner.attn,
                               runner.config.load_format, runner.config.model)
        self.draft_ids = self.head.draft_to_target(torch.arange(self.config.draft_vocab_size, device=runner.device))
        runner.aux_layer_ids = self.config.aux_layer_ids or default_aux_layer_ids(target_config.num_layers)
        self.kv_cache: torch.Tensor | None = None

    @property
    def bytes_per_page(self) -> int:
        return self.runner.kv_bytes_per_page(self.config.model)

    def allocate_cache(self) -> None:
        self.kv_cache, = self.runner.allocate_kv(self.config.model, self.runner.num_pages)

    def catch_up(self, reqs, starts, ends):
        # Position p takes token p + 1 and the target's state at p.
        ps = self.runner.page_size
        slots = [r.pages[p // ps] * ps + p % ps for r, s, e in zip(reqs, starts, ends) for p in range(s, e)]
        state = self.runner.aux_cache[to_device(slots, torch.int64, self.runner.device)]
        return [r.token_ids[s + 1:e + 1] + [0] * max(e + 1 - r.num_tokens, 0)
                for r, s, e in zip(reqs, starts, ends)], state

    def feed_width(self, k):
        # The K + 1 tokens a verification in flight commits (position p takes token p + 1).
        return k + 1

    def catch_up_end(self, req, pending):
        return req.num_tokens + pending - 1

    def next_position(self, req, j, pending):
        return req.num_tokens + pending + j - 2

    def forward(self, batch, state):
        normed, prenorm = self.head(batch.input_ids, state, batch, self.kv_cache)
        return self.head.compute_logits(batch.at_last_tokens(normed)), batch.at_last_tokens(prenorm)

    def state_width(self, catching_up):
        return self.runner.aux_cache.shape[1] if catching_up else self.config.model.hidden_size

    def absorbed(self, req, k, pending):
        # Draft positions were built from the head's own states, not the target's.
        return req.num_tokens + pending - 1
