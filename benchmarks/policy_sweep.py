"""Speculation policies side by side on one GPU: off, fixed K in {1, 2, 4}, goodput.

    PYTHONPATH=. python benchmarks/policy_sweep.py            # H200: Llama-3.1-8B shape, bf16
    PYTHONPATH=. python benchmarks/policy_sweep.py --smoke    # tiny shapes on the CPU

Random weights with an EAGLE-3-shaped head; acceptance is SIMULATED (each draft accepted
with probability a, whatever its value), so the numbers measure cost, not drafting skill.
Each concurrency level c runs c requests of 128 prompt + 128 output tokens at once
(offline, in-process). The bursty load alternates phases of 1 and 128 concurrent requests.
All policies of one acceptance level share one engine (the policy object is swapped), so
ratios compare like with like. Writes $OUT/policy_sweep.json and goodput's decision log per acceptance level
($OUT/decisions_a*.jsonl: one JSON line per step); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from gpu_fastpath import LLAMA_8B, SMOKE, greedy, random_prompts, free_memory, write_eagle_dir, write_model_dir
from tidal import LLM
from tidal.spec.policy import Fixed, Off


def throughput(llm, phases, prompt_len, new_tokens, vocab):
    """Output tokens per second over a sequence of phases (concurrency levels)."""
    tokens, start = 0, time.perf_counter()
    drafted = llm.engine.stats()["spec"]["num_drafted"]
    for i, c in enumerate(phases):
        outs = llm.generate(random_prompts(c, prompt_len, vocab, seed=100 + i), greedy(new_tokens), use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    steps_drafted = llm.engine.stats()["spec"]["num_drafted"] - drafted
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "drafted": steps_drafted}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    levels = (1, 4) if args.smoke else (1, 10, 70, 250)
    bursty = (1, 8, 1, 8) if args.smoke else (1, 128, 1, 128)
    prompt_len, new_tokens = (16, 16) if args.smoke else (128, 128)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"note": "random weights, EAGLE-3-shaped head, SIMULATED acceptance", "runs": {}}
    max_seqs = max(max(levels), max(bursty))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, eagle_dir = write_model_dir(Path(tmp), shape), write_eagle_dir(Path(tmp), shape)
        for acc in (0.6, 0.8):
            sc = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4,
                  "policy": "goodput", "simulate_acceptance": acc,
                  "decision_log": str(out_dir / f"decisions_a{acc}.jsonl")}
            llm = LLM(model=str(model_dir), speculative_config=sc, device=device, load_format="dummy",
                      dtype="bfloat16" if device == "cuda" else "float32", max_model_len=1024,
                      max_num_seqs=max_seqs, num_pages=max_seqs * (prompt_len + new_tokens + 16) // 16 + 64)
            goodput = llm.engine.scheduler.policy
            policies = {"off": Off(), "fixed:1": Fixed(1), "fixed:2": Fixed(2), "fixed:4": Fixed(4), "goodput": goodput}
            for warm in (Fixed(4), Off()):  # compile every kernel shape before timing
                llm.engine.scheduler.policy = warm
                throughput(llm, bursty, prompt_len, 16, shape["vocab_size"])
            for name, policy in policies.items():
                llm.engine.scheduler.policy = policy
                for c in levels:
                    r = throughput(llm, (c,), prompt_len, new_tokens, shape["vocab_size"])
                    results["runs"][f"a={acc} {name} c={c}"] = r
                    print(f"a={acc} {name:8} c={c:<4} {r['tok_s']:9.0f} tok/s", flush=True)
                r = throughput(llm, bursty, prompt_len, new_tokens, shape["vocab_size"])
                results["runs"][f"a={acc} {name} bursty"] = r
                print(f"a={acc} {name:8} bursty {r['tok_s']:9.0f} tok/s", flush=True)
            results[f"policy_stats a={acc}"] = llm.engine.stats().get("policy")
            del llm, goodput, policies
            free_memory()

    table = []
    for acc in (0.6, 0.8):
        for load in [f"c={c}" for c in levels] + ["bursty"]:
            row = {n: results["runs"][f"a={acc} {n} {load}"]["tok_s"] for n in ("off", "fixed:1", "fixed:2", "fixed:4", "goodput")}
            best = max(v for n, v in row.items() if n != "goodput")
            table.append((acc, load, row, row["goodput"] / best))
    results["table"] = [{"acceptance": a, "load": l, **row, "goodput_vs_best_fixed": r} for a, l, row, r in table]
    (out_dir / "policy_sweep.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{'acc':>4} {'load':>7} {'off':>8} {'fixed:1':>8} {'fixed:2':>8} {'fixed:4':>8} {'goodput':>8} {'gp/best':>8}")
    for acc, load, row, r in table:
        print(f"{acc:>4} {load:>7} " + " ".join(f"{row[n]:8.0f}" for n in ("off", "fixed:1", "fixed:2", "fixed:4", "goodput"))
              + f" {r:8.3f}")


if __name__ == "__main__":
    main()
