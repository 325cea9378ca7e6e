"""Two host costs, measured on the CPU (this machine, not the GPU's host):
- goodput's `choose` per call at 1, 10, 64 and 256 requests, under a cost model that makes
  K = 4 pay (median of 300 calls after 20 steps of learning);
- sampling tensors built per step in the smoke shapes' closed loop (10 clients, 42 requests
  of 16 + 16 tokens, simulated acceptance 0.8), for fixed:4 and goodput.

    PYTHONPATH=.:benchmarks:tests python benchmarks/results/2026-12-01-h200/scripts/host_costs_cpu.py
    (from the repository root; put another tree's `tidal` first on PYTHONPATH to measure it)

With `--profile B` it profiles `choose` at B requests instead (cProfile of 200 calls after
the same learning), to show where its time goes.
"""
import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

from gpu_fastpath import SMOKE, timing, write_eagle_dir, write_model_dir
from policy_sweep import throughput
from test_policy import make_requests, step
from tidal import LLM
from tidal.layers import sampler
from tidal.spec.cost_model import CostModel, grid_axes
from tidal.spec.policy import Fixed, Goodput

import tidal


def learned_goodput(b):
    """Goodput after 20 steps of b requests, under a cost model that makes K = 4 pay."""
    policy = Goodput(CostModel.from_function(lambda bb, w: 0.005 + 1e-6 * bb * w, *grid_axes(256, 4)), 4)
    reqs, rng = make_requests(b), random.Random(0)
    for _ in range(20):
        step(policy, reqs, [0.8] * b, rng, 4)
    return policy, reqs


ap = argparse.ArgumentParser()
ap.add_argument("--profile", type=int, metavar="B", help="profile choose at B requests instead")
args = ap.parse_args()
print("tidal from", Path(tidal.__file__).parent)
if args.profile:
    policy, reqs = learned_goodput(args.profile)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        policy.choose(reqs, [4] * args.profile, 0)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    raise SystemExit
for b in (1, 10, 64, 256):
    policy, reqs = learned_goodput(b)
    times = []
    for _ in range(300):
        t = time.perf_counter()
        policy.choose(reqs, [4] * b, 0)
        times.append(time.perf_counter() - t)
    print(f"goodput choose at {b:3} requests: {1e6 * statistics.median(times):5.0f} us")

with tempfile.TemporaryDirectory() as tmp:
    model, eagle = write_model_dir(Path(tmp), SMOKE), write_eagle_dir(Path(tmp), SMOKE)
    llm = LLM(model=str(model), load_format="dummy", max_model_len=1024, max_num_seqs=16, num_pages=400,
              speculative_config={"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 4,
                                  "simulate_acceptance": 0.8})
    for name, policy in (("fixed:4", Fixed(4)), ("goodput", llm.engine.scheduler.policy)):
        llm.engine.scheduler.policy = policy
        with timing(("build", sampler.SamplingTensors, "build"), ("step", llm.engine, "step")) as calls:
            throughput(llm, [(10, 42)], 16, 16, SMOKE["vocab_size"])
        print(f"{name}: {len(calls['step'])} steps, {len(calls['build'])} sampling-tensor builds, "
              f"{len(calls['build']) / len(calls['step']):.2f} per step")
