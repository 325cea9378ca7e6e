"""Speculative decoding: proposers (drafters), verification and the policy that picks K."""

from __future__ import annotations

from tidal.config import SpecConfig
from tidal.speculative.proposer import Proposer


def build_proposer(spec: SpecConfig, runner, target_config) -> Proposer:
    if spec.method == "ngram":
        from tidal.speculative.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, runner.device)
    if spec.method == "draft_model":
        from tidal.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(spec.model, runner, target_config)
    from tidal.speculative.eagle3 import Eagle3Proposer

    return Eagle3Proposer(spec.model, runner, target_config)
