"""A/B: offline 256 x (128 prompt, 128 new) with top-p 0.95 sampling, and greedy, for the tidal tree first on PYTHONPATH."""
import json, os, tempfile
from pathlib import Path
import torch
import tidal
from gpu_fastpath import LLAMA_8B, SMOKE, write_model_dir, random_prompts, decode_rate, greedy, top_p
from tidal import LLM
cuda = torch.cuda.is_available()
shape = LLAMA_8B if cuda else SMOKE
n, new = (256, 128) if cuda else (8, 16)
model_dir = write_model_dir(Path(tempfile.mkdtemp()), shape)
llm = LLM(model=str(model_dir), device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
          load_format="dummy", max_model_len=2048, max_num_seqs=n, num_pages=n * 272 // 16 + 64)
many = random_prompts(n, 128 if cuda else 16, shape["vocab_size"], seed=4)
out = {"tree": tidal.__file__}
out["top_p"] = [decode_rate(llm, many, new, top_p(new))["tok_s"] for _ in range(3)]
out["greedy"] = [decode_rate(llm, many, new, greedy(new))["tok_s"] for _ in range(2)]
print(json.dumps(out), flush=True)
with open(Path(os.environ.get("OUT", "out")) / "sampling_ab.jsonl", "a") as f:
    f.write(json.dumps(out) + "\n")
