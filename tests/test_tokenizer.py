import json
import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tidal.tokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len

CORPUS = [
    "héllo wörld 日本語 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "hello world, hello tidal!",
    "naïve café résumé",
    "日本語のテキスト",
    "emoji 🙂🙃 and more 🙂",
]
TEXTS = CORPUS + ["日本 fox 🙃 wörld", "  two  spaces\nand a newline 🙂🙂", "x"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_hf_dir(path, raw: RawTokenizer, config: dict, generation_config: dict | None = None):
    path.mkdir()
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    """A tiny GPT-2 style byte-level BPE: rare characters span several tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(CORPUS * 3, trainer)
    config = {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    return save_hf_dir(tmp_path_factory.mktemp("tok") / "byte_level", raw, config, {"eos_token_id": [2, 0]})


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A Llama-2 style tokenizer: "▁" marks spaces, the first one is stripped on decode,
    and characters outside the vocabulary fall back to <0xXX> byte tokens."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    raw.train_from_iterator(["hello world, hello tidal!", "The quick brown fox jumps over the lazy dog."] * 3, trainer)
    trained = json.loads(raw.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in trained["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    sp = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    return save_hf_dir(tmp_path_factory.mktemp("tok") / "sentencepiece", sp, {"eos_token": "</s>", "bos_token": "<s>"})


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request):
    return Tokenizer.from_pretrained(request.getfixturevalue(f"{request.param}_dir"))


def stream(tok, ids, chunks, **kwargs):
    """Feed ids in chunks of the given sizes, then flush; return the deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas, i = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[i:i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas, detok


def chunkings(n, seed):
    rng = random.Random(seed)
    yield [1] * n
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 3))
    yield sizes


def test_incremental_detokenization_matches_full_decode(tokenizer):
    split_characters_seen = False
    for seed, text in enumerate(TEXTS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        split_characters_seen |= any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(len(ids)))
        for chunks in chunkings(len(ids), seed):
            deltas, detok = stream(tokenizer, ids, chunks)
            assert "".join(deltas) == tokenizer.decode(ids) == detok.text
            assert not any("\ufffd" in d for d in deltas)
    assert split_characters_seen  # the test really covers characters split over tokens


def test_prompt_context_keeps_leading_space(tokenizer):
    prompt = tokenizer.encode("The quick brown", add_special_tokens=False)
    output = tokenizer.encode("The quick brown fox 🙂 jumps", add_special_tokens=False)[len(prompt):]
    deltas, _ = stream(tokenizer, output, [1] * len(output), prompt_ids=prompt)
    full = tokenizer.decode(prompt + output)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)):]
    assert "".join(deltas).startswith(" fox")


def test_special_tokens_are_skipped(byte_level_dir):
    tok = Tokenizer.from_pretrained(byte_level_dir)
    ids = tok.encode("hello", add_special_tokens=False) + [2] + tok.encode(" world", add_special_tokens=False)
    deltas, _ = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == "hello world"


def test_tokens_without_text_do_not_widen_the_window(byte_level_dir):
    """Special tokens (skipped) and ids beyond the tokenizer's vocabulary (a model's padded
    embedding) decode to nothing: a long run of them must not make each later step decode
    them all again."""
    tok = Tokenizer.from_pretrained(byte_level_dir)
    ids = tok.encode("hello", add_special_tokens=False) + [2] * 300 + [len(tok.hf) + 5] * 300 \
        + tok.encode(" world", add_special_tokens=False)
    decoded, decode = [], tok.decode
    tok.decode = lambda window, skip=True: decoded.append(len(window)) or decode(window, skip)
    deltas, _ = stream(tok, ids, [1] * len(ids), prompt_ids=tok.encode("say", add_special_tokens=False))
    assert "".join(deltas) == decode(ids) == "hello world"
    assert max(decoded) <= 2 * PROMPT_CONTEXT_TOKENS


def test_trailing_incomplete_character_is_held_until_flush(byte_level_dir):
    tok = Tokenizer.from_pretrained(byte_level_dir)
    ids = tok.encode("ok 🚀", add_special_tokens=False)  # not in the corpus: 4 byte tokens
    partial = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    streamed = detok.add(ids[:partial])
    assert "\ufffd" not in streamed
    # the request ended mid-character: flush shows it broken, as a full decode does
    assert streamed + detok.flush() == tok.decode(ids[:partial]) == detok.text


def test_find_stop_and_partial_stop_len():
    assert find_stop("hello world", ["wor", "lo"]) == (3, "lo")  # "lo" completes first
    assert find_stop("xab", ["ab", "a"]) == (1, "a")
    assert find_stop("xab", ["ab", "xabc"]) == (1, "ab")
    assert find_stop("aXa", ["a"], start=1) == (2, "a")
    assert find_stop("hello", ["z"]) is None
    assert partial_stop_len("hello wor", ["world", "x"]) == 3
    assert partial_stop_len("hello w", ["wx", "lo wz"]) == 4
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("ab", ["ab"]) == 0  # a complete stop string is find_stop's business


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_holds_back_prefixes(tokenizer, include):
    text = "héllo wörld 日本語 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["wörld", "zzz"], include_stop_str_in_output=include)
    streamed = ""
    for t in ids:
        streamed += detok.add([t])
        assert not streamed.endswith(("w", "wö", "wör", "wörl"))  # possible stop prefixes are held
        assert text.startswith(streamed)
    streamed += detok.flush()
    expected = "héllo wörld" if include else "héllo "
    assert streamed == detok.text == expected
    assert detok.stopped and detok.stop_str == "wörld"
    assert detok.add(ids[:2]) == "" and detok.flush() == ""


def test_held_back_prefix_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("hello wor", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["world"])
    streamed = detok.add(ids)
    assert streamed == "hello " and not detok.stopped
    assert detok.flush() == "wor"


def test_stop_string_found_across_a_multi_token_step(tokenizer):
    ids = tokenizer.encode("hello world, hello tidal!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[", hello", "tidal"])
    assert detok.add(ids) == "hello world"
    assert detok.stop_str == ", hello"


def test_chat_template_and_metadata(byte_level_dir):
    tok = Tokenizer.from_pretrained(byte_level_dir)
    messages = [{"role": "user", "content": "héllo"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1  # special tokens are single ids
    assert tok.eos_token_ids == {0, 2}  # tokenizer EOS + generation_config.json
    assert tok.vocab_size == 320
    assert tok.decode(tok.encode("日本語 🙂")) == "日本語 🙂"


def test_missing_chat_template_is_a_clear_error(sentencepiece_dir):
    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    assert tok.eos_token_ids == {2}
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
