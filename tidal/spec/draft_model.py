"""Draft-model proposer: a smaller causal LM with the target's vocabulary, with its own KV
cache addressed through the target's page tables (same slots, separate tensors).

The drafter's KV holds a request's tokens [0, num_absorbed). Drafting first catches up
over every token it missed (one batched extend, also after K = 0 steps), then runs one
decode per further draft position.
"""

from __future__ import annotations

import torch

from tidal.batch import ForwardBatch
from tidal.layers.sampler import STREAM_DRAFT, SamplingTensors, processed_probs, sample_from_probs
from tidal.models.config import ModelConfig
from tidal.models.loader import load_model
from tidal.step import StepPlan


class DraftModelProposer:
    def __init__(self, model_dir: str, runner, target_config: ModelConfig):
        self.config = ModelConfig.from_pretrained(model_dir)
        if self.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: drafter vocabulary ({self.config.vocab_size} tokens) differs from "
                f"the target's ({target_config.vocab_size})")
        self.runner = runner
        self.model = load_model(model_dir, runner.dtype, runner.device, runner.attn, runner.config.load_format)
        self.kv_caches: list[torch.Tensor] = []

    @property
    def bytes_per_page(self) -> int:
        return self.runner.kv_bytes_per_page(self.config)

    def allocate_cache(self) -> None:
        self.kv_caches = self.runner.allocate_kv(self.config, self.runner.num_pages)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, rows: list[int]):
        reqs = [plan.requests[i] for i in rows]
        ks = [plan.draft_lens[i] for i in rows]
        device = self.runner.device
        st = SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs], device)
        counters = torch.tensor([r.num_output_tokens for r in reqs], device=device)
        probs = torch.zeros(len(plan.requests), max(ks), self.config.vocab_size, device=device)
        rows_t = torch.tensor(rows, device=device)

        # Catch up over every token not yet absorbed; the last one's logits give draft 1.
        starts = [r.num_absorbed for r in reqs]
        feeds = [r.token_ids[s:] for r, s in zip(reqs, starts)]
        tokens = self._step(feeds, starts, reqs, st, counters, probs, rows_t, 0)
        drafts = [[t] for t in tokens]
        for j in range(1, max(ks)):
            live = [b for b, k in enumerate(ks) if k > j]
            sub = [reqs[b] for b in live]
            tokens = self._step([[drafts[b][-1]] for b in live], [r.num_tokens + j - 1 for r in sub], sub,
                                st.select(live), counters[live] + j, probs, rows_t[live], j)
            for b, t in zip(live, tokens):
                drafts[b].append(t)
        for r, k in zip(reqs, ks):
            r.num_absorbed = r.num_tokens + k - 1
        return drafts, probs

    def _step(self, feeds, starts, reqs, st, counters, probs, rows_t, j) -> list[int]:
        batch = ForwardBatch.build(feeds, starts, [r.pages for r in reqs], self.runner.page_size, self.runner.device)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1])
        q = processed_probs(logits, st)
        probs[rows_t, j] = q
        return sample_from_probs(q, st.seeds, counters, STREAM_DRAFT).tolist()
