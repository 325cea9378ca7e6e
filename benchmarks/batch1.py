"""Batch-1 greedy decode of random-weight models against their floors: the quick side-by-side
of two builds' kernels. The floor is the weights a decode step reads (`moe_gpu.bytes_per_decode_step`:
for an MoE its k experts of E per layer) at the measured copy bandwidth. Run it once per
build on one warm machine, tidal taken from PYTHONPATH; equal `tokens_sha1` says two builds
produced the same tokens.

    cd benchmarks && PYTHONPATH=<a build's root> python batch1.py --label pdl [--shapes moe 8b]

Prints a table; writes JSON to $OUT/batch1_<label>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from common import SHAPES, write_model_dir
from gpu_fastpath import decode_rate, free_memory, greedy, random_prompts
from moe_gpu import bytes_per_decode_step, copy_bandwidth
from tidal import LLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="names the build in the JSON's file name")
    ap.add_argument("--shapes", nargs="+", default=["moe", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded in the timed run")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth(device)
    result = {"label": args.label, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "copy_bytes_per_s": bandwidth, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            llm = LLM(model=str(write_model_dir(Path(tmp) / name, shape)), device=device, load_format="dummy",
                      dtype="bfloat16" if device == "cuda" else "float32", max_model_len=2048, max_num_seqs=8)
            prompt = random_prompts(1, args.prompt_len, shape["vocab_size"], seed=3)
            llm.generate(prompt, greedy(8), use_tqdm=False)  # builds the kernels
            weights = bytes_per_decode_step(llm.engine.core.runner.model)
            rate = decode_rate(llm, prompt, args.tokens)
            floor = bandwidth / weights["active_bytes"]
            result["shapes"][name] = {**rate, "weights": weights, "floor_tok_s": floor,
                                      "of_floor": rate["decode_tok_s"] / floor}
            llm.shutdown()
            del llm
            free_memory()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"batch1_{args.label}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.label} on {result['device']}: batch-1 decode tok/s, floor, share of floor, tokens digest")
    for name, r in result["shapes"].items():
        print(f"{name:<6} {r['decode_tok_s']:8.1f} {r['floor_tok_s']:8.1f} {r['of_floor']:6.3f}  {r['tokens_sha1']}")


if __name__ == "__main__":
    main()
