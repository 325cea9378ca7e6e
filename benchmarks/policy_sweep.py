"""Speculation policies side by side on one GPU: off, fixed K in {1, 2, 4}, goodput.

    PYTHONPATH=. python benchmarks/policy_sweep.py            # H200: Llama-3.1-8B shape, bf16
    PYTHONPATH=. python benchmarks/policy_sweep.py --smoke    # tiny shapes on the CPU

Random weights with an EAGLE-3-shaped head; acceptance is SIMULATED (each draft accepted
with probability a, whatever its value), so the numbers measure cost, not drafting skill.
Concurrency c means c clients in a closed loop (in-process): each sends its next request
(128 prompt + 128 output tokens) as soon as its last one finishes (`requests_for(c)` in
all). The figure is output tokens per second while all c clients are busy (from the first
request's end to the last request's start): the steady state at that concurrency. A batch
of c requests sent at once (what runs 6-17 measured) ends with a tail in which fewer and
fewer requests run; speculation spreads the requests' ends over more steps, so the tail
penalises it for something a loaded server does not see. The bursty load alternates
phases of 1 and 128 clients (2 and 256 requests), and its figure is over the whole load:
ramps and drains are what a bursty load is made of.
All policies of one acceptance level share one engine (the policy object is swapped), so
ratios compare like with like; goodput keeps what it learned from one cell to the next.

A single pass differs from the next by 5-20% per cell, so every (policy, load) cell runs
twice: the policies in one order, then in the reverse one (drift over the run falls on
each policy alike; no prompt is ever sent twice, so no cell finds another's in the prefix
cache), and within a pass every policy meets the same accept/reject draws (fixed request
seeds; the second pass draws others). The table gives each cell's mean with its spread
(half the distance between the two runs, in % of the mean) and goodput / best fixed
policy from the means; the JSON keeps both runs. Writes $OUT/policy_sweep.json and
goodput's decision log per acceptance level ($OUT/decisions_a*.jsonl: one JSON line per
step, both passes; written on local disk during the run, then copied), and the same lines
for the other policies ($OUT/steps_a*.jsonl, with the policy and load named), so that a
cell's time can be taken apart step by step for every policy alike. Each cell also
records the host time per step in the engine's phases (`gpu_fastpath.phase_timing`:
whether a policy's own host work lands on the step's critical path) and the garbage
collector's pauses. Prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from gpu_fastpath import (LLAMA_8B, SMOKE, free_memory, per_step_us, phase_timing, random_prompts, write_eagle_dir,
                          write_model_dir)
from tidal import LLM, SamplingParams
from tidal.engine import frozen_heap
from tidal.speculative.policy import Fixed, Off


PROMPT_SEEDS = itertools.count(100)


@contextlib.contextmanager
def collector_pauses():
    """Yields a dict that, when the block ends, holds the garbage collector's pauses in it:
    how many full (generation 2) collections ran, the longest, and all collections' time."""
    pauses, started, out = [], [0.0], {}

    def timer(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))
    gc.callbacks.append(timer)
    try:
        yield out
    finally:
        gc.callbacks.remove(timer)
        full = [t for g, t in pauses if g == 2]
        out.update(full=len(full), full_max_ms=1e3 * max(full, default=0.0), total_ms=1e3 * sum(t for _, t in pauses))


def full_collection_ms() -> dict:
    """One full collection's time now, with the heap as it is and frozen (`frozen_heap`)."""
    def timed():
        start = time.perf_counter()
        gc.collect()
        return 1e3 * (time.perf_counter() - start)
    gc.collect()
    thawed = timed()
    with frozen_heap():
        frozen = timed()
    return {"thawed": thawed, "frozen": frozen, "tracked_objects": len(gc.get_objects())}


def throughput(llm, phases, prompt_len, new_tokens, vocab, seed=0):
    """Output tokens per second over a sequence of phases of (clients, requests), each a
    closed loop. Request j of phase i has seed (seed, i, j): with simulated acceptance the
    seed and the output index decide every accept test, so policies run with the same seed
    meet the same luck. Every phase draws prompts no earlier one sent: a repeated prompt
    would hit the prefix cache as far as the cells before had left it there (run48: off's
    c = 250 cell computed 38,304 of its 64,128 prompt tokens, fixed K = 4's 44,447), and
    prompt content costs nothing else here (random weights, simulated acceptance).
    `steady_tok_s` is the rate while every client of a single phase is busy; `tok_s` is
    over everything; `prefix_hit_pages` should stay 0; `collector`: the garbage collector's
    pauses meanwhile (the heap frozen as the engine's own loops freeze it)."""
    engine = llm.engine
    drafted, hits = engine.stats()["spec"]["num_drafted"], engine.core.pool.prefix_hits
    generated, start = engine.core.num_generated_tokens, time.perf_counter()
    window = []  # (time, tokens generated) at the first request's end and at the last start
    with frozen_heap(), collector_pauses() as pauses:  # as `LLM.generate` and the server run
        for i, (clients, total) in enumerate(phases):
            prompts = random_prompts(total, prompt_len, vocab, seed=next(PROMPT_SEEDS))
            submitted = 0

            def submit():
                nonlocal submitted
                params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                        seed=(seed * 8 + i) * 1024 + submitted)
                engine.add_request(engine.make_request(prompts[submitted], params))
                submitted += 1

            for _ in range(min(clients, total)):
                submit()
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished and submitted < total:
                        if not window:
                            window.append((time.perf_counter(), engine.core.num_generated_tokens))
                        submit()
                        if submitted == total:
                            window.append((time.perf_counter(), engine.core.num_generated_tokens))
    seconds = time.perf_counter() - start
    tokens = engine.core.num_generated_tokens - generated
    (t0, n0), (t1, n1) = window[0], window[-1]
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "steady_tok_s": (n1 - n0) / (t1 - t0) if len(phases) == 1 and t1 > t0 else None,
            "drafted": engine.stats()["spec"]["num_drafted"] - drafted,
            "prefix_hit_pages": engine.core.pool.prefix_hits - hits, "collector": pauses}


class StepLog:
    """Wraps a policy without a decision log: each step it observes is written as goodput
    writes its own (batch, K per row, prefill tokens, accepted drafts, seconds)."""

    def __init__(self, policy, file, label: str):
        self.policy, self.file, self.label = policy, file, label
        self.name = policy.name
        self.load = ""  # the load running now, set by the sweep
        self.decode_steps: list[tuple[int, float]] = []  # (batch, seconds) of the cell's steps without prefill

    def choose(self, requests, limits, num_waiting, kv_room=None):
        return self.policy.choose(requests, limits, num_waiting, kv_room)

    def observe(self, plan, result, step_time, catch_up_time=None):
        self.policy.observe(plan, result, step_time, catch_up_time)
        decoding = [i for i, n in enumerate(plan.num_new_tokens) if plan.samples(i)]
        if len(decoding) == sum(plan.num_new_tokens):
            self.decode_steps.append((len(plan.requests), step_time))
        self.file.write(json.dumps({
            "policy": self.label, "load": self.load, "batch": len(plan.requests), "k": list(plan.draft_lens),
            "prefill": sum(plan.num_new_tokens) - len(decoding), "observed_s": step_time,
            "accepted": [n - 1 for n in result.accept_lens.tolist()]}) + "\n")

    def stats(self):
        return self.policy.stats()


def predicted_uniform(goodput, clients: int, length: int, max_draft_len: int = 4) -> dict:
    """Goodput's cost model after a cell: its price (ms) of a decode step of `clients`
    requests of `length` tokens each, all at the same K, with and without its draft
    premium, to set beside what the fixed policies' steps took."""
    cost = goodput.cost
    out = {}
    for k in range(max_draft_len + 1):
        raw = float(cost.step_time(clients, clients * k, k, clients if k else 0, clients * length))
        plain = float(cost.step_time(clients, 0, 0, 0, clients * length))
        out[k] = {"ms": 1e3 * raw, "with_premium_ms": 1e3 * (raw + goodput.draft_premium * max(raw - plain, 0.0))}
    return out


def requests_for(clients: int) -> int:
    """Requests a closed loop of `clients` sends. Its window (first end to last start) then
    spans 3c + 1 of them ending, c at c > 70: a window of few requests is decided by their
    acceptance luck (run18's spanned c, and at c = 1 its cells' two runs differed by up to
    18%)."""
    return 4 * clients + 2 if clients <= 70 else 2 * clients + 1


def rate(run):
    """A cell's figure: the steady state of a single phase, the whole of a bursty load."""
    return run["steady_tok_s"] or run["tok_s"]


NAMES = ("off", "fixed:1", "fixed:2", "fixed:4", "goodput")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8],
                    help="simulated acceptance levels (one device call each fits its time limit)")
    ap.add_argument("--loads", nargs="+", help="only these loads (e.g. c=70 bursty)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    levels = (1, 4) if args.smoke else (1, 10, 70, 250)
    bursty = [(c, 2 * c) for c in ((1, 4, 1, 4) if args.smoke else (1, 128, 1, 128))]
    prompt_len, new_tokens = (24, 8) if args.smoke else (128, 128)  # smoke: a prompt past one page
    # (smoke: 2c + 1 requests, the fewest whose window, first end to last start, is not empty)
    loads = {**{f"c={c}": [(c, 2 * c + 1 if args.smoke else requests_for(c))] for c in levels}, "bursty": bursty}
    if args.loads:
        if set(args.loads) - set(loads):
            ap.error(f"--loads: choose from {list(loads)}")
        loads = {name: loads[name] for name in args.loads}
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"note": "random weights, EAGLE-3-shaped head, SIMULATED acceptance; closed-loop clients; "
                       "each cell run twice", "runs": {}}
    max_seqs = max(c for phases in loads.values() for c, _ in phases)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, eagle_dir = write_model_dir(Path(tmp), shape), write_eagle_dir(Path(tmp), shape)
        for acc in args.acceptance:
            sc = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4,
                  "policy": "goodput", "simulate_acceptance": acc,
                  "decision_log": str(Path(tmp) / f"decisions_a{acc}.jsonl"),  # local disk: $OUT may be slow
                  **({"profile_seconds": 0.5} if args.smoke else {})}
            llm = LLM(model=str(model_dir), speculative_config=sc, device=device, load_format="dummy",
                      dtype="bfloat16" if device == "cuda" else "float32", max_model_len=1024,
                      max_num_seqs=max_seqs, num_pages=max_seqs * (prompt_len + new_tokens + 16) // 16 + 64)
            goodput = llm.engine.core.scheduler.policy
            results[f"full_collection_ms a={acc}"] = full_collection_ms()
            steps = open(Path(tmp) / f"steps_a{acc}.jsonl", "w")
            logged = {name: StepLog(policy, steps, name) for name, policy in
                      zip(NAMES, (Off(), Fixed(1), Fixed(2), Fixed(4)))}
            policies = {**logged, "goodput": goodput}
            for warm in (Fixed(4), Off()):  # compile every kernel shape before timing
                llm.engine.core.scheduler.policy = warm
                throughput(llm, bursty, prompt_len, min(16, new_tokens), shape["vocab_size"])
            # (smoke: one pass; the second only reverses the order, for drift on a GPU)
            for repeat, order in enumerate((NAMES,) if args.smoke else (NAMES, NAMES[::-1])):
                for name in order:
                    llm.engine.core.scheduler.policy = policies[name]
                    for load, phases in loads.items():
                        if name in logged:
                            logged[name].load, logged[name].decode_steps = load, []
                        with phase_timing(llm.engine) as calls:
                            r = throughput(llm, phases, prompt_len, new_tokens, shape["vocab_size"], 1 + repeat)
                        r["host_us_per_step"] = per_step_us(calls)
                        clients = phases[0][0]
                        if name == "goodput" and len(phases) == 1:
                            r["predicted_uniform_step"] = predicted_uniform(goodput, clients,
                                                                            prompt_len + new_tokens // 2)
                        elif name in logged and len(phases) == 1:
                            full = [t for b, t in logged[name].decode_steps if b == clients]
                            r["decode_step_ms_at_full_batch"] = 1e3 * statistics.median(full) if full else None
                        results["runs"].setdefault(f"a={acc} {name} {load}", []).append(r)
                        print(f"a={acc} {name:8} {load:6} {rate(r):9.0f} tok/s", flush=True)
            results[f"goodput_stats a={acc}"] = goodput.stats()
            steps.close()
            del llm, goodput, policies, logged
            free_memory()
            for log in ("decisions", "steps"):
                shutil.copy(Path(tmp) / f"{log}_a{acc}.jsonl", out_dir)
    results["seconds"] = time.perf_counter() - start

    table = []
    for acc in args.acceptance:
        for load in loads:
            runs = {n: [rate(r) for r in results["runs"][f"a={acc} {n} {load}"]] for n in NAMES}
            mean = {n: sum(v) / len(v) for n, v in runs.items()}
            best = max(v for n, v in mean.items() if n != "goodput")
            table.append({"acceptance": acc, "load": load, **mean, "goodput_vs_best_fixed": mean["goodput"] / best,
                          "min": {n: min(v) for n, v in runs.items()}, "max": {n: max(v) for n, v in runs.items()}})
    results["table"] = table
    (out_dir / "policy_sweep.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\noutput tok/s (steady state of c clients; bursty: whole load), mean of 2 runs +- half their spread; "
          f"gp/best from the means ({results['seconds']:.0f} s in all)")
    print("host us per step (mean of both runs): step / propose / launch / choose / observe / commit / wait")
    for key, runs in results["runs"].items():
        if not key.endswith("bursty") and key.split()[1] in ("fixed:4", "goodput", "off"):
            us = {p: sum(r["host_us_per_step"].get(p, 0) for r in runs) / len(runs)
                  for p in ("step", "propose", "launch", "choose", "observe", "commit", "wait")}
            print(f"  {key:<22} " + " / ".join(f"{v:6.0f}" for v in us.values()))
    for acc in args.acceptance:
        full = results[f"full_collection_ms a={acc}"]
        cells = {key: r["collector"] for key, runs in results["runs"].items() if key.startswith(f"a={acc} ")
                 for r in runs}
        print(f"garbage collector, a={acc}: a full collection at start-up {full['thawed']:.0f} ms "
              f"({full['tracked_objects']} objects), frozen {full['frozen']:.1f} ms; during the cells "
              f"{sum(c['full'] for c in cells.values())} full ones, the longest "
              f"{max(c['full_max_ms'] for c in cells.values()):.1f} ms")
    print("decode step at c rows (ms): fixed K's median observed / goodput's price of the same K at the end of "
          "its cell, mean of both runs (K = 0 is off)")
    for acc in args.acceptance:
        for load, phases in loads.items():
            if len(phases) > 1:
                continue
            cells = []
            for k, name in {0: "off", 1: "fixed:1", 2: "fixed:2", 4: "fixed:4"}.items():
                seen = [r.get("decode_step_ms_at_full_batch") for r in results["runs"][f"a={acc} {name} {load}"]]
                priced = [r["predicted_uniform_step"][k]["ms"] for r in results["runs"][f"a={acc} goodput {load}"]]
                seen = [x for x in seen if x is not None]
                cells.append(f"K={k} {sum(seen) / len(seen) if seen else float('nan'):6.2f} / "
                             f"{sum(priced) / len(priced):6.2f}")
            print(f"  a={acc} {load:6} " + "   ".join(cells))
    print(f"{'acc':>4} {'load':>7} " + " ".join(f"{n:>13}" for n in NAMES) + f" {'gp/best':>8}")
    for row in table:
        cells = (f"{row[n]:9.0f} {50 * (row['max'][n] - row['min'][n]) / row[n]:2.0f}%" for n in NAMES)
        print(f"{row['acceptance']:>4} {row['load']:>7} " + " ".join(cells) + f" {row['goodput_vs_best_fixed']:8.3f}")


if __name__ == "__main__":
    main()
