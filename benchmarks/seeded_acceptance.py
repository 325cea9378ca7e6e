"""What seeded, schedule-independent sampling costs in acceptance: the demo pair (its trained
EAGLE-3 head, K = 4, fixed) on ShareGPT prompts at temperatures 0.7 and 1.0, in this tree
(drafts raced against the target's own noise, accepted when they equal its draw) and, with
--old-tree, in another source tree (e.g. one with rejection sampling), side by side.

    PYTHONPATH=. python benchmarks/seeded_acceptance.py [--old-tree DIR] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURES = (0.7, 1.0)


def measure(num_prompts: int, max_tokens: int) -> dict:
    """Acceptance per draft position and mean accepted length, per temperature, with the
    `tidal` this interpreter imports (the demo pair of this tree's package)."""
    import tidal
    from tidal import LLM, SamplingParams

    pair = ROOT / "tidal" / "demo_pair"
    from tidal.bench.datasets import sharegpt_requests
    from tidal.tokenizer import Tokenizer

    requests, _ = sharegpt_requests(Tokenizer.from_pretrained(str(pair / "target")), num_prompts, 0, None, 512)
    prompts = [r.prompt[:448] for r in requests]
    spec = {"method": "eagle3", "model": str(pair / "eagle3"), "num_speculative_tokens": 4, "policy": "fixed"}
    out = {"tidal": str(Path(tidal.__file__).parent)}
    for t in TEMPERATURES:
        llm = LLM(model=str(pair / "target"), device="cpu", speculative_config=spec)
        params = [SamplingParams(temperature=t, max_tokens=max_tokens, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()["spec"]
        out[str(t)] = {"mean_accepted_length": stats["mean_accepted_length"],
                       "acceptance_rate": stats["num_accepted"] / stats["num_drafted"],
                       "acceptance_per_position": stats["acceptance_per_position"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-tree", default=None, help="a source tree to measure beside this one")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one tree, JSON on stdout
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.num_prompts, args.max_tokens)))
        return
    trees = {"this tree": str(ROOT)} | ({"old tree": str(Path(args.old_tree).resolve())} if args.old_tree else {})
    results = {}
    for name, tree in trees.items():
        proc = subprocess.run([sys.executable, __file__, "--measure", "--num-prompts", str(args.num_prompts),
                               "--max-tokens", str(args.max_tokens)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": tree}, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"demo pair, EAGLE-3 head, K = 4 fixed, {args.num_prompts} ShareGPT prompts x {args.max_tokens} tokens")
    print(f"{'tree':<10} {'T':>4} {'accepted length':>16} {'acceptance':>11}  per position")
    for name, r in results.items():
        for t in TEMPERATURES:
            m = r[str(t)]
            print(f"{name:<10} {t:>4} {m['mean_accepted_length']:>16.3f} {m['acceptance_rate']:>11.3f}  "
                  f"{[round(a, 3) for a in m['acceptance_per_position']]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
