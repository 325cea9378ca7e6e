"""Sampled drafts from the drafter's CUDA graphs draw with the target's own noise: with the
target as its own draft model, every sampled draft is accepted (greedy and sampled rows in
one batch, planned ahead of the step in flight and not). Exits non-zero otherwise.

    PYTHONPATH=. python benchmarks/sampled_drafts.py [--device cuda]   # writes $OUT/sampled_drafts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from tidal import LLM, SamplingParams
from tidal.demo import default_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=32)
    args = p.parse_args()
    target = default_model_dir()
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, ignore_eos=True)
              for i, t in zip(range(args.requests), [0.8, 1.3, 0.0, 0.6] * args.requests)]
    prompts = [[5 + i % 7, 6, 7, 8] * 3 for i in range(args.requests)]
    rows = []
    for async_scheduling in (True, False):
        extra = {"gpu_memory_utilization": 0.3} if args.device == "cuda" else {}
        llm = LLM(model=target, device=args.device, async_scheduling=async_scheduling, **extra,
                  speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                      "policy": "fixed"})
        llm.generate(prompts, params, use_tqdm=False)
        spec = llm.engine.stats()["spec"]
        rows.append({"async_scheduling": async_scheduling, "drafted": spec["num_drafted"],
                     "accepted": spec["num_accepted"], "graphs": llm.engine.core.runner.graphs is not None})
        print(rows[-1])
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sampled_drafts.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if any(r["drafted"] == 0 or r["accepted"] != r["drafted"] for r in rows):
        raise SystemExit("a sampled draft was rejected: the drafter's draws do not use the target's noise")


if __name__ == "__main__":
    main()
