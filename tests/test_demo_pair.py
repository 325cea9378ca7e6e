"""The shipped demo pair (scripts/train_demo_pair.py): it loads, EAGLE-3 speculation on it is
lossless under greedy decoding, and its head's drafts do get accepted."""

from pathlib import Path

import tidal
from tidal import LLM, SamplingParams

PAIR = Path(tidal.__file__).parent / "demo_pair"

CHATS = [
    [{"role": "user", "content": "How do I sort a list in Python?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


def test_demo_pair_is_lossless_and_accepts():
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = LLM(model=str(PAIR / "target"), dtype="float32")
    prompts = [plain.tokenizer.apply_chat_template(c) for c in CHATS]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=str(PAIR / "target"), dtype="float32", speculative_config={
        "method": "eagle3", "model": str(PAIR / "eagle3"), "num_speculative_tokens": 4, "policy": "fixed"})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = spec.engine.stats()["spec"]
    assert stats["num_drafted"] > 0 and stats["num_accepted"] > 0
