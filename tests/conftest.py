import os
import tempfile

# Triton kernels run through the interpreter on CPU-only machines; triton reads this at import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Cost profiles are kept for the session's engines (and servers it starts), not the user's.
os.environ["TIDAL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tidal-cache-")

import gc

import pytest

from checkpoints import make_checkpoint


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


_resident_after_collect = 0


@pytest.fixture(autouse=True)
def collect_dropped_engines():
    """Engines the tests drop are freed before they pile up: an engine's KV cache is a
    gigabyte on the CPU (resident as far as its pages were touched), and its reference
    cycles wait for the collector, which a few tests' objects seldom trigger, so the suite
    could outgrow a 24 GB machine. A collection takes a fifth of a second, so it runs once
    the process has grown 2 GB since the last."""
    global _resident_after_collect
    yield
    resident = _resident_bytes()
    if resident is None or resident > _resident_after_collect + (2 << 30):
        gc.collect()
        _resident_after_collect = _resident_bytes() or 0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny random checkpoint per architecture, written once per session."""
    made = {}

    def get(arch: str = "llama", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            made[key] = str(make_checkpoint(tmp_path_factory.mktemp(name), arch, **kwargs))
        return made[key]

    return get


@pytest.fixture
def bf16_rounds_to_nearest(monkeypatch):
    """The Triton interpreter (triton 3.9) truncates float32 -> bf16; the GPU rounds to
    nearest even, as torch does. Patch the cast so that checks of bf16 results that must
    equal torch's are meaningful."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    if not isinstance(tl.max, interpreter.InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", patched)
