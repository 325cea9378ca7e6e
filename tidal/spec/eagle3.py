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

from tidal.batch import ForwardBatch
from tidal.layers.sampler import STREAM_DRAFT, SamplingTensors, processed_probs, sample_from_probs
from tidal.models.config import ModelConfig
from tidal.models.eagle3 import Eagle3Config, load_eagle3
from tidal.models.loader import default_aux_layer_ids
from tidal.step import StepPlan


class Eagle3Proposer:
    def __init__(self, model_dir: str, runner, target_config: ModelConfig):
        self.config = Eagle3Config.from_pretrained(model_dir, target_config)
        self.runner = runner
        self.head = load_eagle3(model_dir, runner.model, runner.dtype, runner.device, runner.attn,
                               runner.config.load_format)
        self.vocab_size = target_config.vocab_size
        self.draft_ids = self.head.draft_to_target(torch.arange(self.config.draft_vocab_size, device=runner.device))
        runner.aux_layer_ids = self.config.aux_layer_ids or default_aux_layer_ids(target_config.num_layers)
        self.kv_cache: torch.Tensor | None = None

    @property
    def bytes_per_page(self) -> int:
        return self.runner.kv_bytes_per_page(self.config.model)

    def allocate_cache(self) -> None:
        self.kv_cache, = self.runner.allocate_kv(self.config.model, self.runner.num_pages)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, rows: list[int]):
        reqs = [plan.requests[i] for i in rows]
        ks = [plan.draft_lens[i] for i in rows]
        device, ps = self.runner.device, self.runner.page_size
        st = SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs], device)
        counters = torch.tensor([r.num_output_tokens for r in reqs], device=device)
        probs = torch.zeros(len(plan.requests), max(ks), self.vocab_size, device=device)
        rows_t = torch.tensor(rows, device=device)

        # Catch up: positions num_absorbed .. n - 2 take token p + 1 and the target's state at p.
        starts = [r.num_absorbed for r in reqs]
        feeds = [r.token_ids[s + 1:] for r, s in zip(reqs, starts)]
        slots = [[r.pages[p // ps] * ps + p % ps for p in range(s, r.num_tokens - 1)] for r, s in zip(reqs, starts)]
        hidden_in = self.runner.aux_cache[torch.tensor([x for row in slots for x in row], device=device)]
        tokens, state = self._step(feeds, starts, hidden_in, reqs, st, counters, probs, rows_t, 0)
        drafts = [[t] for t in tokens]
        for j in range(1, max(ks)):
            live = [b for b, k in enumerate(ks) if k > j]
            sub = [reqs[b] for b in live]
            tokens, state[live] = self._step([[drafts[b][-1]] for b in live], [r.num_tokens + j - 2 for r in sub],
                                             state[live], sub, st.select(live), counters[live] + j, probs,
                                             rows_t[live], j)
            for b, t in zip(live, tokens):
                drafts[b].append(t)
        for r in reqs:
            r.num_absorbed = r.num_tokens - 1
        return drafts, probs

    def _step(self, feeds, starts, hidden_in, reqs, st, counters, probs, rows_t, j):
        """One head forward; returns each row's draft token (target ids) and the head's
        output state at each row's last position."""
        batch = ForwardBatch.build(feeds, starts, [r.pages for r in reqs], self.runner.page_size, self.runner.device)
        prenorm = self.head(batch.input_ids, hidden_in, batch.positions, batch, self.kv_cache)
        last = prenorm[batch.query_start_loc[1:].long() - 1]
        logits = self.head.compute_logits(last)
        q = processed_probs(logits, st)
        probs[rows_t[:, None], j, self.draft_ids[None, :]] = q
        tokens = self.draft_ids[sample_from_probs(q, st.seeds, counters, STREAM_DRAFT)]
        return tokens.tolist(), last
