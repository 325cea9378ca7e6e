"""`tidal bench offline`'s modes and loads, interleaved: one engine per mode, built once, and
rounds in which every mode runs every load on fresh prompts, the modes' order rotating from
round to round. On a shared machine whose speed drifts by 10-30% from minute to minute (this
project's development CPU), a sequential sweep ranks modes by when they ran; here each round
gives one ratio per mode and load, and their median is robust to the drift.

    PYTHONPATH=. python benchmarks/offline_interleaved.py [--modes off,goodput] [--concurrency 1,8]
        [--num-prompts 16] [--random-input-len 32] [--random-output-len 32] [--rounds 7]

Engines of every mode are resident at once: for small models only (the demo pair by default).
"""

from __future__ import annotations

import argparse
import json
import statistics

from tidal import LLM
from tidal.bench.datasets import random_requests
from tidal.bench.offline import engine_counters, run_load_offline
from tidal.bench.workload import build_loads, mode_spec_config, parse_modes, summarize_run, warm_up_load
from tidal.demo import default_model_dir, default_speculative_config
from tidal.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the demo pair's target, with its EAGLE-3 head")
    p.add_argument("--speculative-config", type=json.loads, default=None)
    p.add_argument("--modes", default="off,goodput")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    model = args.model or default_model_dir()
    spec = args.speculative_config or default_speculative_config()
    modes = parse_modes(args.modes)
    loads = build_loads(args.concurrency, None, None, 1, args.num_prompts)
    tokenizer = Tokenizer.from_pretrained(model)
    engines = {m: LLM(model=model, speculative_config=mode_spec_config(m, spec)).engine for m in modes}
    warm, _ = random_requests(tokenizer, 2, args.random_input_len, args.random_output_len, seed=10**6)
    for engine in engines.values():  # first steps, allocator
        run_load_offline(engine, warm_up_load(warm), warm, seed=0)
    rows = []
    for r in range(args.rounds):
        for i, load in enumerate(loads):
            # Fresh prompts for each round and load: a prompt served twice would come from the prefix cache.
            requests, _ = random_requests(tokenizer, load.total_requests, args.random_input_len,
                                          args.random_output_len, seed=1000 * r + i)
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                engine = engines[mode]
                before = engine_counters(engine)
                records, duration, spans = run_load_offline(engine, load, requests, seed=r)
                rows.append({"round": r, **summarize_run(mode, load, records, duration, spans, before,
                                                           engine_counters(engine))})
    base = modes[0]
    summary = []
    for load in loads:
        cells = {m: [x for x in rows if x["mode"] == m and x["load"] == load.label] for m in modes}
        for m in modes:
            ratios = [a["output_throughput"] / b["output_throughput"] for a, b in zip(cells[m], cells[base])]
            summary.append({"mode": m, "load": load.label,
                            "median_tok_s": statistics.median(x["output_throughput"] for x in cells[m]),
                            "ratios": ratios, "median_ratio": statistics.median(ratios),
                            "mean_k": statistics.mean(x["mean_k"] for x in cells[m])})
    print(f"{'mode':<10} {'load':<6} {'median tok/s':>12} {'median ratio to ' + base:>22} {'mean K':>6}  ratio per round")
    for s in summary:
        print(f"{s['mode']:<10} {s['load']:<6} {s['median_tok_s']:>12.1f} {s['median_ratio']:>22.3f} {s['mean_k']:>6.2f}  "
              + " ".join(f"{x:.2f}" for x in s["ratios"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "offline_interleaved", "model": model, "speculative_config": spec,
                       "args": vars(args), "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
