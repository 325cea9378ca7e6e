"""Two trees of tidal side by side on one device: the same measurements, each tree in a
process of its own (its `tidal` first on the path), alternating, so that what a change of
the engine costs shows as a ratio measured in one run.

    PYTHONPATH=. python benchmarks/ab_trees.py OLD NEW [--rounds 1] [--correctness] [--smoke]

OLD and NEW are repository roots (e.g. a `git worktree` of the commit before). Per tree, with
the Llama-3.1-8B shape and random weights (bf16): batch-1 plain decode, offline 256 x (128 in,
128 out) plain, and batch-1 decode with an EAGLE-3-shaped head at K = 4 with SIMULATED
acceptance 0.8 (policy fixed). `--correctness` first runs `gpu_fastpath.check_correctness`
(greedy tokens equal transformers') in NEW. Prints a table last; writes $OUT/ab_trees.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args) -> dict:
    """In a tree's own process: build each engine, measure, return the figures."""
    import tidal
    from common import LLAMA_8B, SMOKE, write_eagle_dir, write_model_dir
    from gpu_fastpath import decode_rate, free_memory, random_prompts
    from tidal import LLM

    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    batch, prompt_len, new_tokens, b1_tokens = (8, 16, 16, 32) if args.smoke else (256, 128, 128, 256)
    common = dict(device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
                  max_model_len=256 if args.smoke else 2048, max_num_seqs=batch,
                  num_pages=(batch * (prompt_len + new_tokens + 8)) // 16 + 64)
    out = {"tidal": tidal.__file__}
    if args.correctness:
        from gpu_fastpath import check_correctness

        out["correctness"] = {}
        check_correctness(device, out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, eagle_dir = write_model_dir(Path(tmp), shape), write_eagle_dir(Path(tmp), shape)
        one = random_prompts(1, prompt_len, shape["vocab_size"], seed=3)
        many = random_prompts(batch, prompt_len, shape["vocab_size"], seed=4)
        llm = LLM(model=str(model_dir), **common)
        out["plain_b1"] = decode_rate(llm, one, b1_tokens)
        out["plain_offline"] = decode_rate(llm, many, new_tokens)
        del llm
        free_memory()
        spec = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4, "policy": "fixed",
                "simulate_acceptance": 0.8}
        llm = LLM(model=str(model_dir), speculative_config=spec, **common)
        out["eagle3_sim08_k4_b1"] = decode_rate(llm, one, b1_tokens)
    return out


def run_tree(tree: Path, args, correctness: bool = False) -> dict:
    """`worker` in a fresh process whose `tidal` is `tree`'s."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *(["--smoke"] if args.smoke else []),
           *(["--correctness"] if correctness else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tree}: worker failed\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--correctness", action="store_true", help="first check NEW's greedy tokens against transformers")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(HERE))
        print(json.dumps(worker(args)))
        return
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[name].append(run_tree(getattr(args, name), args, args.correctness and r == 0 and name == "new"))
            print(f"round {r + 1}: {name} done", flush=True)
    rows = []
    for key, rate in (("plain_b1", "decode_tok_s"), ("plain_offline", "tok_s"), ("eagle3_sim08_k4_b1", "decode_tok_s")):
        for r in range(args.rounds):
            old, new = runs["old"][r][key][rate], runs["new"][r][key][rate]
            rows.append((f"{key} ({rate}), round {r + 1}", f"{old:.0f}", f"{new:.0f}", f"{new / old:.3f}"))
    correctness = runs["new"][0].get("correctness", {})
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ab_trees.json").write_text(json.dumps({"old": str(args.old), "new": str(args.new), "runs": runs},
                                                      indent=1))
    for name, value in correctness.items():
        print(f"NEW greedy == transformers, {name}: {value}")
    print(f"{'measure':48} {'old':>8} {'new':>8} {'new/old':>8}")
    for row in rows:
        print(f"{row[0]:48} {row[1]:>8} {row[2]:>8} {row[3]:>8}")


if __name__ == "__main__":
    main()
