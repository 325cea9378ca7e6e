"""Unprofiled host time per step by phase (inclusive, perf_counter), batch-1 EAGLE-3 sim 0.8 K=4."""
import json, os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import torch
import tidal, tidal.runner, tidal.graphs, tidal.batch, tidal.scheduler, tidal.spec.proposer, tidal.engine, tidal.spec.eagle3
from gpu_fastpath import LLAMA_8B, SMOKE, write_model_dir, write_eagle_dir, random_prompts, decode_rate, greedy
from tidal import LLM
acc = defaultdict(float); cnt = defaultdict(int)
def wrap(owner, name, label, static=False):
    fn = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(owner, name, staticmethod(w) if static else w)
for owner, name in [(tidal.engine.LLMEngine, "step"), (tidal.runner.PendingStep, "result"), (tidal.scheduler.Scheduler, "commit"),
                    (tidal.scheduler.Scheduler, "schedule"), (tidal.scheduler.Scheduler, "choose_ahead"),
                    (tidal.engine.LLMEngine, "_observe_last"), (tidal.spec.proposer.ChainDrafter, "propose"),
                    (tidal.spec.proposer.ChainDrafter, "_sample"), (tidal.spec.eagle3.Eagle3Proposer, "catch_up"),
                    (tidal.spec.proposer.ChainDrafter, "_draft_steps"), (tidal.runner.ModelRunner, "launch"),
                    (tidal.runner.ModelRunner, "_with_drafts"), (tidal.runner.ModelRunner, "sampling_tensors"),
                    (tidal.graphs.CudaGraphs, "load"), (tidal.graphs.CudaGraphs, "replay"), (tidal.runner.PendingStep, "copy_to_host")]:
    wrap(owner, name, f"{owner.__name__}.{name}")
import tidal.spec.verify
v = tidal.runner.verify
def vw(*a, **k):
    t = time.perf_counter(); r = v(*a, **k); acc["verify()"] += time.perf_counter() - t; cnt["verify()"] += 1; return r
tidal.runner.verify = vw
cuda = torch.cuda.is_available()
shape = LLAMA_8B if cuda else SMOKE
tmp = Path(tempfile.mkdtemp())
model_dir, eagle_dir = write_model_dir(tmp, shape), write_eagle_dir(tmp, shape)
common = dict(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", load_format="dummy",
              max_model_len=2048, max_num_seqs=8, num_pages=512)
one = random_prompts(1, 128, shape["vocab_size"], seed=3)
res = {}
for name, sc in [("plain", None), ("eagle", {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4,
                                             "policy": "fixed", "simulate_acceptance": 0.8})]:
    llm = LLM(model=str(model_dir), speculative_config=sc, **common)
    llm.generate(one, greedy(8), use_tqdm=False)
    acc.clear(); cnt.clear()
    rate = decode_rate(llm, one, 256 if cuda else 16)
    steps = cnt["LLMEngine.step"]
    res[name] = {"decode_tok_s": rate["decode_tok_s"], "steps": steps,
                 "us_per_step": {k: round(1e6 * v / steps, 1) for k, v in sorted(acc.items(), key=lambda x: -x[1])},
                 "calls_per_step": {k: round(c / steps, 2) for k, c in cnt.items()}}
    print(name, json.dumps(res[name]), flush=True)
    del llm
out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True)
(out / "phases.json").write_text(json.dumps(res, indent=1))
