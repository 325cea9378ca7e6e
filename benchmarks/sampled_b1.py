"""Batch-1 decode rate with sampling (temperature 0.7, top-p 0.95), plain and with an
EAGLE-3-shaped head (K = 4, fixed, SIMULATED acceptance 0.8): the Llama-3.1-8B shape with
random weights, so the figures are the cost of a step, not of drafting skill. Runs with
whatever `tidal` is importable, so that two source trees compare in one session:

    PYTHONPATH=.:benchmarks python benchmarks/sampled_b1.py            # this tree
    PYTHONPATH=OLD:benchmarks python benchmarks/sampled_b1.py          # another one
Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from common import LLAMA_8B, write_eagle_dir, write_model_dir

import tidal
from tidal import LLM, SamplingParams

TOKENS = 256


def rate(llm) -> dict:
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=TOKENS, ignore_eos=True, seed=0)
    prompt = list(range(1000, 1128))
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    return {"tok_s": len(out.outputs[0].token_ids) / seconds, "seconds": seconds}


def main() -> None:
    root = Path(tempfile.mkdtemp())
    target, head = write_model_dir(root, LLAMA_8B), write_eagle_dir(root, LLAMA_8B)
    common = dict(device="cuda", load_format="dummy", max_model_len=4096, max_num_seqs=8)
    results = {"tidal": str(Path(tidal.__file__).parent)}
    llm = LLM(model=str(target), **common)
    results["plain"] = rate(llm)
    del llm
    gc.collect()  # the engine's reference cycles hold its GPU memory until collected
    torch.cuda.empty_cache()
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "policy": "fixed",
            "simulate_acceptance": 0.8}
    llm = LLM(model=str(target), speculative_config=spec, **common)
    results["eagle3_k4_sim0.8"] = rate(llm)
    results["eagle3_k4_sim0.8"]["vs_plain"] = results["eagle3_k4_sim0.8"]["tok_s"] / results["plain"]["tok_s"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
