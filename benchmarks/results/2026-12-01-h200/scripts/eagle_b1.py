"""A/B: batch-1 plain and EAGLE-3 (sim 0.8, K = 4) decode rates of the tidal tree first on PYTHONPATH."""
import json, os, sys, tempfile
from pathlib import Path
import torch
import tidal
from gpu_fastpath import LLAMA_8B, SMOKE, write_model_dir, write_eagle_dir, random_prompts, decode_rate, free_memory
from tidal import LLM
cuda = torch.cuda.is_available()
shape = LLAMA_8B if cuda else SMOKE
tmp = Path(tempfile.mkdtemp())
model_dir, eagle_dir = write_model_dir(tmp, shape), write_eagle_dir(tmp, shape)
common = dict(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", load_format="dummy",
              max_model_len=2048, max_num_seqs=8, num_pages=512)
one = random_prompts(1, 128, shape["vocab_size"], seed=3)
n = 256 if cuda else 16
out = {"tree": tidal.__file__}
llm = LLM(model=str(model_dir), **common)
out["plain"] = [decode_rate(llm, one, n)["decode_tok_s"] for _ in range(2)]
del llm; free_memory()
sc = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4, "policy": "fixed", "simulate_acceptance": 0.8}
llm = LLM(model=str(model_dir), speculative_config=sc, **common)
import time
from collections import defaultdict
replays = defaultdict(list)
if cuda:
    replay = torch.cuda.CUDAGraph.replay
    def timed(self):
        t = time.perf_counter(); replay(self); replays[id(self)].append(time.perf_counter() - t)
    torch.cuda.CUDAGraph.replay = timed
out["eagle"] = [decode_rate(llm, one, n)["decode_tok_s"] for _ in range(4)]
out["replay_us_per_graph"] = sorted((len(v), round(1e6 * sum(v) / len(v))) for v in replays.values())
print(json.dumps(out), flush=True)
with open(Path(os.environ.get("OUT", "out")) / "ab.jsonl", "a") as f:
    f.write(json.dumps(out) + "\n")
