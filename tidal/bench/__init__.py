"""Benchmarks that compare speculation modes side by side: `tidal bench serve | offline`."""

from tidal.bench.offline import run_offline_sweep
from tidal.bench.serve import run_sweep

__all__ = ["run_sweep", "run_offline_sweep"]
