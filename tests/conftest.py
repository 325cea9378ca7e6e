import os

# Triton kernels run through the interpreter on CPU-only machines; triton reads this at import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from checkpoints import make_checkpoint


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
