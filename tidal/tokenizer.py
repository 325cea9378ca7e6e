"""Tokenizer wrapper and incremental (streaming) detokenization with stop strings."""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

# Prompt tokens decoded ahead of the first output token, so that the first token's text
# (e.g. a SentencePiece leading space) comes out as it would in context.
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """A Hugging Face tokenizer loaded from a local model directory, with the few
    operations the engine needs."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        # The Rust tokenizer decodes several times faster than the Python wrapper around it;
        # use it directly when the wrapper would add nothing (no space clean-up).
        fast = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._decoder = fast if fast is not None and not hf_tokenizer.clean_up_tokenization_spaces else None
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        """Load from local files only (never downloads). End-of-sequence ids are the
        tokenizer's EOS plus generation_config.json's `eos_token_id` (instruct models often
        list several there, e.g. an end-of-turn token)."""
        # transformers is imported here, not with the module: it is a second and more of
        # start-up that processes without text (an engine core's, a tensor-parallel rank's)
        # do not need.
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return cls(hf, _generation_eos_ids(model_dir))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (its vocabulary entry is at
        least as long): a text of n characters is at least n / max_token_chars tokens."""
        return max(1, max(len(t) for t in self.hf.get_vocab()))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._decoder is not None:
            return self._decoder.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True,
                            add_generation_prompt: bool = True) -> list[int] | str:
        """Render messages with the model's chat template; token ids, or the text when
        tokenize=False. The rendered text already holds any BOS, so none is added."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use a completion prompt instead")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _generation_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string that completes first in text[start:] (ties: the longer one), as
    (index where it begins, the string). "First to complete" is what token-by-token
    streaming would see, so the answer does not depend on how tokens were batched."""
    best = None
    for s in stop:
        i = text.find(s, start)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    return None if best is None else (best[1], best[2])


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string:
    text a stream must hold back because the next tokens may complete the stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they are committed.

    Each call decodes only a short window: tokens already emitted as text that give the
    context (`prefix`), plus those not yet emitted, and returns the text the new tokens
    added. This handles tokenizers whose token text depends on its neighbours
    (SentencePiece leading spaces, byte-level BPE). Tokens that end in an incomplete UTF-8
    character (decoded as U+FFFD) are held back until a later token completes it.

    With stop strings, `add` also cuts the text at the first stop string (see
    `find_stop`) and holds back a tail that could be the start of one. When the request
    ends for another reason, `flush` returns whatever was held back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0              # window start: first context token
        self._read_offset = len(self._ids)   # first token whose text is not out yet
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""                       # all output text so far (cut at a stop string)
        self._emitted = 0                    # chars of self.text returned by add/flush
        self.stop_str: str | None = None     # the stop string that ended the text, if any

    @property
    def released_text(self) -> str:
        """The text handed out by `add` and `flush` so far."""
        return self.text[:self._emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def add(self, token_ids: Sequence[int]) -> str:
        """Append committed tokens; return the text that is now safe to stream."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._append(self._decode_window(final=False))
        return self._release()

    def flush(self) -> str:
        """The request has ended: return the text still held back (an incomplete
        character decodes as U+FFFD, as in a full decode; a partial stop string is output)."""
        if not self.stopped:
            self._append(self._decode_window(final=True))
        out = self.text[self._emitted:]
        self._emitted = len(self.text)
        return out

    def _decode_window(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if full == prefix and prefix:
            # Tokens without text after some (skipped special tokens, ids beyond the
            # tokenizer's vocabulary) give none beside later ones either: drop them, or every
            # later call would decode them again, in a window growing with them. (At the start
            # of the text, a SentencePiece space token decodes to nothing yet counts.)
            del self._ids[self._read_offset:]
            return ""
        if len(full) < len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def _append(self, delta: str) -> None:
        if not delta:
            return
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        found = find_stop(self.text, self.stop, search_from) if self.stop else None
        if found is not None:
            index, self.stop_str = found
            self.text = self.text[:index + len(self.stop_str) if self.include_stop_str_in_output else index]

    def _release(self) -> str:
        hold = 0 if self.stopped else partial_stop_len(self.text, self.stop)
        end = max(self._emitted, len(self.text) - hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
