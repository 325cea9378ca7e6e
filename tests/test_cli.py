"""The command line as a user meets it: flags in vLLM's names, one-line errors that name the
flag, speculation on the demo model unless turned off, and a bench server that gets the
engine its flags describe."""

import argparse
import subprocess
import sys

import pytest

from tidal.cli import build_parser, main
from tidal.demo import DEMO_DIR
from tidal.engine_args import add_engine_args, engine_flags, engine_kwargs

ENGINE_FLAGS = ("--model", "--device", "--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--gpu-memory-utilization", "--kv-cache-memory-gb", "--num-pages", "--enforce-eager",
                "--load-format", "--seed", "--no-enable-prefix-caching", "--speculative-config", "--no-speculation")


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "serve"], ["bench", "offline"]])
def test_help_lists_the_engine_flags(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert [f for f in ENGINE_FLAGS if f not in text] == []
    assert str(DEMO_DIR / "eagle3") in text.replace("\n", "").replace(" ", "")  # where the demo's head is


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("tidal 0.")


def test_demo_speculates_unless_turned_off(checkpoint):
    assert engine_kwargs(engine_args())["speculative_config"]["method"] == "eagle3"
    assert engine_kwargs(engine_args("--no-speculation"))["speculative_config"] is None
    assert engine_kwargs(engine_args("--speculative-config", "none"))["speculative_config"] is None
    assert engine_kwargs(engine_args("--model", checkpoint("llama")))["speculative_config"] is None
    ngram = engine_kwargs(engine_args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'))
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}


def test_engine_flags_give_back_the_same_engine():
    kwargs = engine_kwargs(engine_args("--device", "cpu", "--max-model-len", "300", "--num-pages", "99",
                                       "--enforce-eager", "--no-enable-prefix-caching", "--load-format", "dummy",
                                       "--seed", "7", "--tensor-parallel-size", "2",
                                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert engine_kwargs(engine_args(*engine_flags(kwargs))) == kwargs
    plain = engine_kwargs(engine_args("--no-speculation"))
    assert engine_kwargs(engine_args(*engine_flags(plain))) == plain


@pytest.mark.parametrize("argv, error", [
    (["--max-model-len", "100000"], "error: --max-model-len: 100000 is more than the model's context of"),
    (["--max-tokens", "1000"], "error: --max-tokens: 2 prompt tokens + max_tokens 1000 are more than max_model_len"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs must be a positive integer, got 0"),
    (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--tensor-parallel-size", "3"], "error: --tensor-parallel-size: 3 does not divide num_attention_heads 4"),
    (["--num-pages", "5"], "error: the KV cache has 4 pages of 16 tokens, fewer than one request of max_model_len 512"),
    (["--speculative-config", "{}"], "error: --speculative-config: needs 'method' and 'num_speculative_tokens'"),
    (["--speculative-config", '{"method": "eagle4", "num_speculative_tokens": 2}'],
     "error: --speculative-config.method: unknown method 'eagle4'"),
    (["--model", "meta-llama/Llama-3.2-1B"], "error: model folder 'meta-llama/Llama-3.2-1B' does not exist"),
])
def test_bad_values_get_one_line_naming_the_flag(argv, error, checkpoint, capsys):
    model = [] if "--model" in argv else ["--model", checkpoint("llama")]
    assert main(["generate", *model, "--device", "cpu", *argv, "hi"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith(error), err


def test_bad_json_names_its_position(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": ngram}'])
    assert "argument --speculative-config: not valid JSON (Expecting value: line 1 column 12 (char 11))" \
        in capsys.readouterr().err


def test_generate_prints_completions(checkpoint):
    proc = subprocess.run([sys.executable, "-m", "tidal", "generate", "--model", checkpoint("llama"), "--device", "cpu",
                           "--max-tokens", "5", "--ignore-eos", "Hello"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[5 tokens, finish_reason=length]" in proc.stdout
    assert "speculation: none" in proc.stderr  # the start-up line says what was loaded
