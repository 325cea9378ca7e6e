"""Scheduler host time (schedule / schedule_ahead + commit) per decode step at 256 requests on
the CPU, as `gpu_fastpath.scheduler_overhead` measures it, on the smoke model (the
bookkeeping does not depend on the model's size).

    PYTHONPATH=TREE:benchmarks:tests python benchmarks/results/2026-12-01-cpu/scheduler_host.py
    (from the repository root; TREE is the tree whose `tidal` is measured)
"""
import tempfile
from pathlib import Path

from gpu_fastpath import SMOKE, greedy, random_prompts, timing, write_model_dir
import tidal
from tidal import LLM

with tempfile.TemporaryDirectory() as tmp:
    llm = LLM(model=str(write_model_dir(Path(tmp), SMOKE)), load_format="dummy", max_model_len=512,
              max_num_seqs=256, num_pages=256 * 20 + 64)
    prompts = random_prompts(256, 128, SMOKE["vocab_size"], seed=1)
    llm.generate(prompts[:4], greedy(4), use_tqdm=False)  # warm up
    scheduler = llm.engine.scheduler
    with timing(("schedule", scheduler, "schedule"), ("schedule", scheduler, "schedule_ahead"),
                ("commit", scheduler, "commit"), ("step", llm.engine, "step")) as calls:
        llm.generate(prompts, greedy(64), use_tqdm=False)
    steps = list(zip(calls["schedule"], calls["commit"], calls["step"]))[4:-4]  # decode steps
    host = 1e6 * sum(s + c for s, c, _ in steps) / len(steps)
    print(f"{Path(tidal.__file__).parent}: schedule + commit {host:.0f} us a step")
