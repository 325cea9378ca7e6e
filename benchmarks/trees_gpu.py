"""One GPU run for trees of drafts (speculative_config topk > 1): correctness first, then
batch-1 speed.

    PYTHONPATH=. python benchmarks/trees_gpu.py            # on the GPU machine
    PYTHONPATH=. python benchmarks/trees_gpu.py --smoke    # tiny shapes on the CPU (checks the script)

Correctness: the shipped demo pair (float32) decodes the same greedy tokens, and the same
seeded sampled tokens, with trees as without speculation, through CUDA graphs and eagerly,
with its EAGLE-3 head and with the target drafting for itself; and the head's mean accepted
length, chain against trees (a trained head: real acceptance).
Speed, random weights (bf16), a Llama-3.1-8B shape with an EAGLE-3-shaped head, SIMULATED
acceptance (a node's best child is the target's token with probability `--rate`, its r-th
best with rate * sibling^r; the drafter's tree takes those odds, `ChainDrafter._children`):
batch-1 decode of plain, chains of K = 3..6 and trees of 8 and 16 nodes, and where the
steps of the chain of 5 and the trees of 16 spend their time (the profiler); then, under
load (`--rows` requests sampling at temperature 0.7, the workload matrix's W2), steps of
K = 0, 1, 2 (policy `table`) of the chain engine and of the tree engine (topk 4, 5 deep,
16 nodes), profiled: what a small tree costs where goodput weighs it against K = 0.
Prints tables last; writes JSON to $OUT/trees_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from common import LLAMA_8B, SMOKE, write_eagle_dir, write_model_dir
from gpu_fastpath import decode_rate, free_memory, greedy, random_prompts, where_time_goes
from tidal import LLM, SamplingParams
from tidal.demo import DEMO_DIR

TREES = ((4, 5, 8), (4, 5, 16))  # (topk, depth, nodes)


def check_correctness(device: str, results: dict, num_prompts: int = 6, max_tokens: int = 40) -> None:
    target, head = str(DEMO_DIR / "target"), str(DEMO_DIR / "eagle3")
    prompts = random_prompts(num_prompts, 12, 384, seed=1)
    params = {"greedy": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              "seeded": [SamplingParams(temperature=t, seed=s, max_tokens=max_tokens, ignore_eos=True)
                         for s, t in enumerate((0.8, 1.2, 0.0, 0.6, 1.0, 0.7)[:num_prompts])]}
    plain = LLM(model=target, dtype="float32", device=device)
    want = {k: [o.outputs[0].token_ids for o in plain.generate(prompts, p, use_tqdm=False)] for k, p in params.items()}
    del plain
    free_memory()
    checks, accepted = results["correctness"], results.setdefault("demo_accepted_length", {})
    for label, spec in {"eagle3 chain K=4": {"method": "eagle3", "model": head, "num_speculative_tokens": 4},
                        "eagle3 tree 2x4, 8": {"method": "eagle3", "model": head, "num_speculative_tokens": 4,
                                               "topk": 2, "num_draft_tokens": 8},
                        "eagle3 tree 4x5, 16": {"method": "eagle3", "model": head, "num_speculative_tokens": 5,
                                                "topk": 4, "num_draft_tokens": 16},
                        "self-drafted tree 3x3, 9": {"method": "draft_model", "model": target,
                                                     "num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 9},
                        # one node a step: chains of one in the engine that drafts trees
                        "eagle3 tree 4x5, 16, one node": {"method": "eagle3", "model": head, "num_speculative_tokens": 5,
                                                          "topk": 4, "num_draft_tokens": 16, "policy": "table",
                                                          "table": {"1": 1}},
                        }.items():
        for eager in (False, True):
            if eager and device != "cuda":
                continue
            llm = LLM(model=target, dtype="float32", device=device, enforce_eager=eager,
                      speculative_config={"policy": "fixed", **spec})
            for kind, p in params.items():
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
                checks[f"{label}{' eager' if eager else ''}: {kind} == plain"] = got == want[kind]
                if kind == "greedy" and not eager:
                    accepted[label] = llm.engine.stats()["spec"]["mean_accepted_length"]
            del llm
            free_memory()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--rate", type=float, default=0.7, help="simulated chance of a node's best child")
    ap.add_argument("--siblings", type=float, nargs="+", default=[0.15, 0.3],
                    help="each further child's chance against the one before")
    ap.add_argument("--chains", type=int, nargs="+", default=[3, 4, 5, 6], help="chain lengths K to time")
    ap.add_argument("--rows", type=int, help="requests in the profiled steps under load (default 64; smoke 8)")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds after which sections are skipped")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "batch1", "loaded"],
                    help="groups of sections not to run")
    args = ap.parse_args()
    begin = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "correctness": {}, "b1": {}, "loaded": {}, "skipped": [],
               "note": f"speed rows: random weights, SIMULATED acceptance {args.rate} (trees: sibling factors "
                       f"{args.siblings})"}
    new_tokens = 32 if args.smoke else 256
    # Steps under the profiler: on the CPU its trace of a step is thousands of host ops, and
    # reading 24 steps' back took most of a smoke run (a minute of its two and a half).
    profiled_steps = 3 if args.smoke else 24
    args.rows = args.rows or (8 if args.smoke else 64)
    common = dict(device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
                  max_model_len=1024, max_num_seqs=4)

    def section(name, fn, group):
        if group in args.skip:
            results["skipped"].append(name)
            return
        # A smoke run skips nothing for time: it is there to show that every section runs.
        if not args.smoke and time.perf_counter() - begin > args.deadline:
            results["skipped"].append(name)
            print(f"[{name}] skipped: past the deadline", flush=True)
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), shape)
        head_dir = write_eagle_dir(Path(tmp), shape)
        one = random_prompts(1, 128, shape["vocab_size"], seed=3)

        def b1(label, spec, profiled=False):
            llm = LLM(model=str(model_dir), speculative_config=spec, **common)
            rate = decode_rate(llm, one, new_tokens)
            if spec:
                rate["mean_accepted_length"] = llm.engine.stats()["spec"]["mean_accepted_length"]
            if profiled:  # where a step's time goes: the GPU's kernels, or the host between them
                rate["profile"] = where_time_goes(llm, one, steps=profiled_steps, top_kernels=12)
            results["b1"][label] = rate
            del llm
            free_memory()

        def loaded(label, spec):
            llm = LLM(model=str(model_dir), speculative_config=spec, **{**common, "max_num_seqs": args.rows})
            prompts = random_prompts(args.rows, 128, shape["vocab_size"], seed=4)
            results["loaded"][label] = where_time_goes(llm, prompts, profiled_steps, top_kernels=24, params=lambda n: SamplingParams(
                temperature=0.7, max_tokens=n, ignore_eos=True, seed=0))
            del llm
            free_memory()

        # (smoke: 3 prompts, a greedy one among the sampled, of 20 tokens)
        section("correctness", lambda: check_correctness(device, results, *((3, 20) if args.smoke else ())),
                "correctness")
        section("plain", lambda: b1("plain", None), "batch1")
        eagle = {"method": "eagle3", "model": str(head_dir), "policy": "fixed"}
        for k in args.chains:
            section(f"chain K={k}", lambda k=k: b1(f"chain K={k}", {
                **eagle, "num_speculative_tokens": k, "simulate_acceptance": args.rate}, profiled=k == 5), "batch1")
        for sibling in args.siblings:
            for topk, depth, nodes in TREES:
                label = f"tree {topk}x{depth}, {nodes} nodes, sibling {sibling}"
                section(label, lambda label=label, topk=topk, depth=depth, nodes=nodes, sibling=sibling: b1(label, {
                    **eagle, "num_speculative_tokens": depth, "topk": topk, "num_draft_tokens": nodes,
                    "simulate_acceptance": {"mean": args.rate, "sibling": sibling}}, profiled=nodes == 16), "batch1")

        for engine, shape_of in (("chain", {"num_speculative_tokens": 2}),
                                 ("tree", {"num_speculative_tokens": 5, "topk": 4, "num_draft_tokens": 16})):
            for k in (0, 1, 2):
                label = f"{engine} engine, K = {k}"
                section(label, lambda label=label, spec={**eagle, **shape_of, "policy": "table", "table": {"1": k},
                                                        "simulate_acceptance": {"mean": args.rate, "sibling": 0.3}
                                                        if engine == "tree" else args.rate}: loaded(label, spec), "loaded")

    (out_dir / "trees_gpu.json").write_text(json.dumps(results, indent=1))
    b1_rates = results["b1"]
    chains = [v["decode_tok_s"] for k, v in b1_rates.items() if k.startswith("chain")]
    best_chain = max(chains, default=float("nan"))
    print("\n| check | result |\n| --- | --- |")
    for k, v in results["correctness"].items():
        print(f"| {k} | {v} |")
    for k, v in results.get("demo_accepted_length", {}).items():
        print(f"| demo pair mean accepted length, {k} | {v:.3f} |")
    print("\n| batch 1 | decode tok/s | accepted length | / plain | / best chain |\n| --- | --- | --- | --- | --- |")
    plain = b1_rates.get("plain", {}).get("decode_tok_s", float("nan"))
    for k, v in b1_rates.items():
        print(f"| {k} | {v['decode_tok_s']:.1f} | {v.get('mean_accepted_length', 1.0):.2f} | "
              f"{v['decode_tok_s'] / plain:.2f} | {v['decode_tok_s'] / best_chain:.3f} |")
    print("\n| batch 1, under the profiler | step ms | GPU busy ms | kernels a step |\n| --- | --- | --- | --- |")
    for k, v in b1_rates.items():
        if "profile" in v:
            prof = v["profile"]
            print(f"| {k} | {prof['step_ms']:.2f} | {prof['gpu_busy_ms']:.2f} | {prof['kernels_per_step']:.0f} |")
    print(f"\n| {args.rows} rows, temperature 0.7, under the profiler | step ms | GPU busy ms | kernels a step |"
          "\n| --- | --- | --- | --- |")
    for k, prof in results["loaded"].items():
        print(f"| {k} | {prof['step_ms']:.2f} | {prof['gpu_busy_ms']:.2f} | {prof['kernels_per_step']:.0f} |")
    if results.get("errors") or results["skipped"]:
        print("errors in:", list(results.get("errors", {})), "skipped:", results["skipped"])


if __name__ == "__main__":
    main()
