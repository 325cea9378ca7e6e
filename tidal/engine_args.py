"""The engine's command-line flags, in vLLM's names, shared by `tidal generate | serve | bench`.

Each flag is an `EngineConfig` field with `_` as `-`, so an error that names a field can be
shown with the flag's name (`flag_message`), and a server started by `tidal bench serve` gets
the same engine as flags again (`engine_flags`)."""

from __future__ import annotations

import argparse
import json
import re

from tidal.demo import DEMO_DIR, default_model_dir, default_speculative_config

NO_SPECULATION = "none"


def json_or_none(text: str) -> dict | str:
    """--speculative-config: a JSON object, or `none` for no speculation."""
    if text.strip().lower() in (NO_SPECULATION, "null"):
        return NO_SPECULATION
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"want a JSON object or 'none', got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help=f"a local model folder in the Hugging Face layout (default: the embedded demo target, "
                        f"{DEMO_DIR / 'target'}, speculating with its EAGLE-3 head, {DEMO_DIR / 'eagle3'})")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on cpu; on cuda the checkpoint's half type, else bfloat16")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default and upper bound: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step: prompt chunks, decodes, drafts and drafter catch-ups")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="cuda: the share of GPU memory the engine may use; the KV cache gets what the weights and "
                        "the largest step leave")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="cpu: GiB for the KV cache")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV cache pages of 16 tokens, instead of sizing the cache from memory "
                        "(vLLM: --num-gpu-blocks-override)")
    g.add_argument("--enforce-eager", action="store_true", help="cuda: no CUDA graphs")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks, one process each (one GPU each on cuda)")
    g.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights from config.json alone (speed runs)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the engine's sampling of requests without a seed of their own")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes already computed")
    g.add_argument("--speculative-config", type=json_or_none, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\', or none '
                        "(default: none, except on the demo target, which speculates with its EAGLE-3 head)")
    g.add_argument("--no-speculation", action="store_true", help="the same as --speculative-config none")


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The one given; else, on the embedded demo model, its EAGLE-3 head."""
    given = args.speculative_config
    if args.no_speculation or given == NO_SPECULATION:
        return None
    if given is not None or args.model is not None:
        return given
    return default_speculative_config()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from the flags."""
    return dict(model=args.model or default_model_dir(), device=args.device, dtype=args.dtype,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_gb=args.kv_cache_memory_gb,
                num_pages=args.num_pages, enforce_eager=args.enforce_eager, load_format=args.load_format,
                tensor_parallel_size=args.tensor_parallel_size,
                seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
                speculative_config=speculative_config(args))


def engine_flags(kwargs: dict) -> list[str]:
    """The flags that give `tidal serve` the engine of these EngineConfig keyword arguments."""
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if name == "speculative_config":
            flags += [flag, NO_SPECULATION if value is None else json.dumps(value)]
        elif name == "enable_prefix_caching":
            flags += [] if value else ["--no-enable-prefix-caching"]
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def flag_message(message: str, args: argparse.Namespace) -> str:
    """An error that begins with the name of a field these flags set, with the flag's name
    instead (`max_model_len: ...` -> `--max-model-len: ...`)."""
    field = re.match(r"[a-z][a-z_]*(?=[.:]| must )", message)
    if field and hasattr(args, field[0]):
        return "--" + field[0].replace("_", "-") + message[field.end():]
    return message
