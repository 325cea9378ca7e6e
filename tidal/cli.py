"""Command line: `tidal generate | serve | bench` (also `python -m tidal`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import time

from tidal.engine_args import add_engine_args, engine_kwargs, flag_message


def cmd_generate(args: argparse.Namespace) -> int:
    from tidal import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, ignore_eos=args.ignore_eos)
    start = time.monotonic()
    outputs = llm.generate(args.prompts, params)
    elapsed = time.monotonic() - start
    llm.shutdown()
    total = 0
    for out in outputs:
        completion = out.outputs[0]
        total += len(completion.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        print(completion.text)
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    stats = llm.engine.stats()
    print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s), {stats['num_steps']} steps")
    if llm.engine.config.speculative_config:
        spec = stats["spec"]
        print(f"speculation: mean accepted length {spec['mean_accepted_length']:.2f}, "
              f"acceptance per position {[round(a, 2) for a in spec['acceptance_per_position']]}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tidal.server import run_server

    return run_server(args)


def version() -> str:
    """The installed distribution's version (without importing the engine), or the source
    tree's when it runs uninstalled."""
    try:
        return importlib.metadata.version("tidal")
    except importlib.metadata.PackageNotFoundError:
        from tidal.version import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from tidal.bench.commands import add_bench_parser

    parser = argparse.ArgumentParser(prog="tidal", description="LLM serving with load-adaptive speculative decoding")
    parser.add_argument("--version", action="version", version=f"tidal {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 endpoints")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--drain-s", type=float, default=30.0,
                       help="on SIGTERM, seconds running requests may take to finish before they end with an error")
    serve.add_argument("--max-request-body-mb", type=float, default=8.0,
                       help="larger request bodies get 413 before anything parses them")
    serve.set_defaults(func=cmd_serve)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request a benchmark sends
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {flag_message(str(e), args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
