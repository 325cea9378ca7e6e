"""Speculative decoding: proposers (drafters), verification and the policy that picks K."""

from __future__ import annotations

from tidal.config import EngineConfig, SpecConfig
from tidal.speculative.cost_model import CostModel
from tidal.speculative.policy import SpecPolicy, make_policy
from tidal.speculative.proposer import Proposer


class Speculation:
    """What speculative decoding adds to an engine, in one place: the most a request may
    draft in a step (K's limit, which sizes the runner's graphs), the drafter, built on the
    target's runner (`attach`), the prices the goodput policy starts from (measured at
    start-up, `tidal.profiling`), and the policy, made for the scheduler's pages and prompts.
    Simulated acceptance (benchmarks) rides on the requests it is given to."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.proposer: Proposer | None = None
        self.cost_model: CostModel | None = None

    @property
    def max_draft_len(self) -> int:
        return self.config.max_draft_len

    @property
    def profiles_costs(self) -> bool:
        return self.config.policy == "goodput" and self.config.cost_model == "profile"

    def attach(self, runner, target_config) -> Proposer:
        """Build the drafter on the target's runner (its device, pages and hidden states)."""
        spec = self.config
        if spec.method == "ngram":
            from tidal.speculative.ngram import NgramProposer

            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, runner.device)
        elif spec.method == "draft_model":
            from tidal.speculative.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(spec.model, runner, target_config, spec.topk, spec.num_speculative_tokens)
        else:
            from tidal.speculative.eagle3 import Eagle3Proposer

            self.proposer = Eagle3Proposer(spec.model, runner, target_config, spec.topk, spec.num_speculative_tokens)
        return self.proposer

    def make_policy(self, demand, queued, config: EngineConfig) -> SpecPolicy:
        """The policy, seeing `demand(limit)`, the prompt tokens that want a step's budget, and
        `queued()`, the requests that will decode once their prompts are fed."""
        return make_policy(self.config, demand=demand, queued=queued, max_num_seqs=config.max_num_seqs,
                           max_num_batched_tokens=config.max_num_batched_tokens, cost_model=self.cost_model)

    def describe(self) -> str:
        spec = self.config
        return (f"{spec.method}{f' ({spec.model})' if spec.model else ''}, K <= {self.max_draft_len}"
                + (f" (tree nodes, topk {spec.topk}, depth {spec.num_speculative_tokens})" if spec.topk > 1 else "")
                + ", "
                f"policy {spec.policy}" + (f", SIMULATED acceptance {spec.simulate_acceptance.describe()}"
                                           if spec.simulate_acceptance is not None else ""))
