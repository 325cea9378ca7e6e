"""Triton kernels built after start-up. A kernel variant that start-up did not build is
built inside the user's step that first needs it, a stall (a compile, or a load from
Triton's disk cache; docs/design.md, "Every kernel is built at start-up", has what they
cost). Start-up builds every variant its steps can reach; this counts and logs any it
missed, so that a miss is seen rather than read off a slow step."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts Triton's in-process cache misses between `serving()` and the next `start_up()`
    (an engine built later in the same process builds its own kernels first)."""

    def __init__(self):
        self.installed = self.is_serving = False
        self.count = 0
        self._started: dict[str, float] = {}

    def start_up(self) -> None:
        """Stop counting; hook Triton's compile entry and exit the first time (its public
        `knobs.runtime` hooks, where this Triton has them). Any hook already there still runs."""
        self.is_serving = False
        if self.installed:
            return
        try:
            from triton import knobs
        except ImportError:
            return
        self.installed = True
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def started(**kwargs):
            self._started[str(kwargs["key"])] = time.perf_counter()
            return before(**kwargs) if before else False

        def finished(**kwargs):
            began = self._started.pop(str(kwargs["key"]), None)
            if self.is_serving and began is not None:
                # The variant: argument types, and what was specialised on (alignments, ones).
                compiled = kwargs.get("compile") or {}
                variant = f"{kwargs['repr'].split('[')[0]} {compiled.get('signature')} {compiled.get('configs')}"
                self._record(variant, time.perf_counter() - began)
            return after(**kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, finished

    def serving(self) -> None:
        self.is_serving = True

    def _record(self, kernel: str, seconds: float) -> None:
        self.count += 1
        logger.warning("Triton built a kernel while serving (%.0f ms; start-up did not reach this variant): %s",
                       seconds * 1e3, kernel)


watch = CompileWatch()
