"""Worker ranks that fail on purpose, for the tests of tensor parallelism. A spawned process
finds its main by name, so they live in a module of their own, a small one that each worker
imports."""

from tidal import parallel
from tidal.runner import ModelRunner


def fail(*args):
    raise RuntimeError("a failure injected into this rank")


def failing_at_start(*args):
    """`run_worker` whose runner cannot be built."""
    ModelRunner.__init__ = fail
    parallel.run_worker(*args)


def failing_in_a_step(*args):
    """`run_worker` whose first step's forward raises."""
    ModelRunner.forward_step = fail
    parallel.run_worker(*args)
