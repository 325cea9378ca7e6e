"""Where goodput's choose spends its host time at 256 requests (this CPU, not the GPU's host):
median of 200 calls after 20 steps of learning, then cProfile of 200 more.

    python benchmarks/results/2026-12-01-cpu/choose_profile.py [requests]   (from the repository root)
"""
import random, statistics, time, cProfile, pstats, sys
sys.path[:0] = [".", "benchmarks", "tests"]  # run from the repository root
from test_policy import make_requests, step
from tidal.spec.cost_model import CostModel, grid_axes
from tidal.spec.policy import Goodput
b = int(sys.argv[1]) if len(sys.argv) > 1 else 256
policy = Goodput(CostModel.from_function(lambda bb, w: 0.005 + 1e-6 * bb * w, *grid_axes(256, 4)), 4)
reqs, rng = make_requests(b), random.Random(0)
for _ in range(20):
    step(policy, reqs, [0.8] * b, rng, 4)
times = []
for _ in range(200):
    t = time.perf_counter(); policy.choose(reqs, [4] * b, 0); times.append(time.perf_counter() - t)
print(f"choose at {b}: {1e6*statistics.median(times):.0f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): policy.choose(reqs, [4] * b, 0)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
