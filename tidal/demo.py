"""The embedded default: a small target and its EAGLE-3 head, trained by the project
(`scripts/train_demo_pair.py`) and shipped in the package, used when a command gets no
--model. `tidal/demo_pair/MODEL_CARD.md` says how they were trained and what they accept."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo_pair"
DEMO_NAME = "tidal-demo-pair-v1"


def default_model_dir() -> str:
    return str(DEMO_DIR / "target")


def default_speculative_config() -> dict:
    return {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 4}
