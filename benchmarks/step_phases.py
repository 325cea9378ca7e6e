"""Where an engine step's time goes, mode against mode on the same load, in-process on one GPU
(Llama-3.1-8B shape, or with `--shape moe` Qwen3-30B-A3B's; random weights, an EAGLE-3-shaped
head, SIMULATED acceptance).

    PYTHONPATH=.:benchmarks python benchmarks/step_phases.py [--workload W5] [--modes fixed:4,goodput]
        [--concurrency 8,32] [--requests-per-client 3] [--min-requests 12] [--shape 8b|moe]
        [--max-model-len 4096] [--piecewise-max-tokens 1024]
    PYTHONPATH=.:benchmarks python benchmarks/step_phases.py --smoke [--shape moe]  # tiny shapes on the CPU

For every step `EngineCore.step` runs: the host's time in each of its parts (learning from
the last step, planning with the policy's choice inside it, drafting, queueing the forward,
waiting for the tokens, committing), and on CUDA the device's span from the step's first
kernel to its last and the idle gap before it (events recorded at the edges of `_launch`;
the stream runs steps in launch order). Also counted: catch-ups that ran eagerly because no
captured graph fits them, and the rows `_absorb` fed. Decode-only steps at full batch are
the ones compared. Also per kind of launch (prompt chunks in it or not, its longest K, `absorb` where the
drafter absorbed a row's missed tokens first, and `sync` where no step was in flight to
hide its host work): the host's time in the steps that
launched it, its device span and gap. Prints both tables; writes $OUT/step_phases.json (and
goodput's decision log, $OUT/decisions_WORKLOAD.jsonl; OUT defaults to ./out, which git ignores).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import statistics
import tempfile
import time
import weakref
from collections import defaultdict
from pathlib import Path

import torch

from common import SHAPES, write_eagle_dir, write_model_dir
from tidal import LLM, graphs
from tidal.bench.datasets import random_requests
from tidal.bench.matrix import WORKLOADS
from tidal.bench.offline import run_load_offline
from tidal.bench.workload import Load, mode_spec_config, warm_up_load
from tidal.runner import PendingStep
from tidal.speculative.proposer import ChainDrafter

PHASES = ("observe", "plan", "choose", "propose", "absorb", "launch", "wait", "commit")


class Trace:
    """Host time per phase of each step, device events per launch, and counters."""

    def __init__(self, core, cuda: bool):
        self.core, self.cuda = core, cuda
        self.steps: list[dict] = []
        self.current = defaultdict(float)
        self.launches: list[tuple] = []  # (plan shape, start event, end event) in launch order
        self.counts = defaultdict(int)
        self.launched: dict | None = None  # the shape of the plan the current step launched
        self.patched: list[tuple[object, str]] = []

    def patch(self, obj, name: str, new) -> None:
        """Shadow obj.name with `new` (an instance attribute, or the class's for a class)."""
        self.patched.append((obj, name, getattr(obj, name)) if isinstance(obj, type) else (obj, name, None))
        setattr(obj, name, new)

    def uninstall(self) -> None:
        for obj, name, original in reversed(self.patched):
            setattr(obj, name, original) if original is not None else delattr(obj, name)
        self.patched = []

    def timed(self, phase, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t
        return wrapper

    def install(self) -> None:
        core = self.core
        sched = core.scheduler
        self.patch(sched.policy, "observe", self.timed("observe", sched.policy.observe))
        self.patch(sched, "schedule", self.timed("plan", sched.schedule))
        self.patch(sched.policy, "choose", self.timed("choose", sched.policy.choose))
        self.patch(sched, "commit", self.timed("commit", sched.commit))
        launch = core._launch

        def traced_launch(plan, after=None):
            start = self._event()
            t, absorbed = time.perf_counter(), self.counts["absorbed_rows"]
            step = launch(plan, after)
            self.current["launch"] += time.perf_counter() - t
            if step is not None:
                shape = {**self._shape(plan), "behind": after is not None,
                         "absorbs": self.counts["absorbed_rows"] > absorbed}
                self.launches.append((shape, start, self._event()))
                self.launched = self.launched or shape  # the step's host time goes to its first launch
            return step
        self.patch(core, "_launch", traced_launch)
        self.patch(core.runner, "launch", self.timed("launch_forward", core.runner.launch))
        if core.speculation is not None:
            proposer = core.speculation.proposer
            self.patch(proposer, "propose", self.timed("propose", proposer.propose))
            absorb = proposer._absorb

            def traced_absorb(reqs, starts, ends):
                tail = proposer.feed_width(core.runner.max_draft_len)
                self.counts["absorbed_rows"] += sum(e - s > tail for s, e in zip(starts, ends))
                return self.timed("absorb", absorb)(reqs, starts, ends)
            self.patch(proposer, "_absorb", traced_absorb)
            run = proposer._run

            def traced_run(feeds, starts, pages, state, input_ids, rejected, sampled):
                self.counts["catch_ups"] += 1
                graphs = proposer.catch_up_graphs.get(sampled)
                if graphs is None or not graphs.fits(len(feeds), max(len(f) for f in feeds)):
                    self.counts["eager_catch_ups"] += 1
                return run(feeds, starts, pages, state, input_ids, rejected, sampled)
            self.patch(proposer, "_run", traced_run)
        result = PendingStep.result

        def traced_result(step):
            t = time.perf_counter()
            try:
                return result(step)
            finally:
                self.current["wait"] += time.perf_counter() - t
        self.patch(PendingStep, "result", traced_result)
        engine_step = core.step

        def traced_step():
            allocs = self._allocator()  # (read outside the step's wall time)
            t = time.perf_counter()
            self.launched = None
            out = engine_step()
            wall = time.perf_counter() - t
            grew = [a < b for a, b in zip(allocs, self._allocator())]  # (cudaMalloc, retry after freeing the cache)
            for name, flag in zip(("malloc_steps", "alloc_retry_steps"), grew):
                self.counts[name] += flag
            if self.launched is not None:
                self.launched["malloc"] = any(grew)
            self.steps.append({"wall": wall, **self.current, "launched": self.launched})
            self.current = defaultdict(float)
            return out
        self.patch(core, "step", traced_step)

    def _allocator(self) -> tuple[int, int]:
        """The caching allocator's cudaMalloc calls and its retries (a retry frees every cached
        block and synchronizes the device): a step that grew either paid for memory mid-flight."""
        if not self.cuda:
            return (0, 0)
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _shape(self, plan) -> dict:
        ks, runner = plan.draft_lens, self.core.runner
        decode_only = all(n == 1 for n in plan.num_new_tokens)
        # As `ModelRunner.forward_step` routes a step with prompt tokens: a tree's drafts, or
        # more tokens than the piecewise graphs' largest bucket, run eagerly.
        eager = runner.pieces is not None and not decode_only and (
            runner.tree_drafts and max(ks) > 0 or runner.pieces.bucket(sum(plan.num_new_tokens) + sum(ks)) is None)
        return {"rows": len(ks), "decode_only": decode_only, "max_k": max(ks), "mean_k": sum(ks) / len(ks),
                "mixed": len(set(ks)) > 1, "eager": bool(eager)}

    def device_spans(self) -> list[dict]:
        """Per launch: its shape, the device's span over its kernels and the idle gap before it (ms)."""
        if not self.cuda:
            return [shape for shape, _, _ in self.launches]
        torch.cuda.synchronize()
        out, last_end = [], None
        for shape, start, end in self.launches:
            span = start.elapsed_time(end)
            gap = last_end.elapsed_time(start) if last_end is not None else None
            out.append({**shape, "span_ms": span, "gap_ms": gap})
            last_end = end
        return out


def step_kind(shape: dict) -> str:
    """A launch's kind for the per-kind table: prompt chunks in it or not, its longest K,
    `absorb` where the drafter first absorbed what a row missed (`ChainDrafter._absorb`: a
    prompt, a K = 0 spell), `sync` where it was launched with no step in flight (the
    device waited for the host), `malloc` where the step that launched it called cudaMalloc,
    and `eager` for a prompt step too long for the piecewise graphs."""
    return (f"{'decode' if shape['decode_only'] else 'prompt'} K={shape['max_k']}{' eager' if shape.get('eager') else ''}"
            f"{' absorb' if shape.get('absorbs') else ''}{'' if shape['behind'] else ' sync'}"
            f"{' malloc' if shape.get('malloc') else ''}")


def summarize(trace: Trace, batch: int) -> dict:
    """Means over the steps, and over the launches that decode every row of a full batch."""
    steps = trace.steps[len(trace.steps) // 10:]  # past the first wave's prompts
    launches = trace.device_spans()
    full = [x for x in launches if x["decode_only"] and x["rows"] == batch]
    host = {p: 1e3 * statistics.fmean(s.get(p, 0.0) for s in steps) for p in PHASES + ("launch_forward", "wall")}
    by_kind = defaultdict(lambda: {"host": [], "spans": [], "gaps": []})  # (kind, K) over every launch
    for s in steps:
        if s["launched"] is not None:
            by_kind[step_kind(s["launched"])]["host"].append(s)
    for x in launches:
        group = by_kind[step_kind(x)]
        if trace.cuda:
            group["spans"].append(x["span_ms"])
            if x["gap_ms"] is not None:
                group["gaps"].append(x["gap_ms"])
    kinds = {}
    for kind, g in sorted(by_kind.items()):
        kinds[kind] = {"launches": len(g["spans"]) or None, "steps": len(g["host"]),
                       **{f"host_{p}_ms": 1e3 * statistics.fmean(s.get(p, 0.0) for s in g["host"])
                          for p in ("wall", "plan", "propose", "launch", "wait") if g["host"]},
                       "span_ms": statistics.median(g["spans"]) if g["spans"] else None,
                       "gap_ms": statistics.median(g["gaps"]) if g["gaps"] else None}
    row = {"steps": len(trace.steps), "host_ms": host, "counts": dict(trace.counts), "by_kind": kinds,
           "full_decode_launches": len(full),
           "full_mixed_share": sum(x["mixed"] for x in full) / max(len(full), 1),
           "full_mean_k": statistics.fmean(x["mean_k"] for x in full) if full else None}
    if trace.cuda and full:
        row["device_span_ms"] = statistics.median(x["span_ms"] for x in full)
        gaps = [x["gap_ms"] for x in full if x["gap_ms"] is not None]
        row["device_gap_ms"] = statistics.median(gaps) if gaps else None
        for k in sorted({x["max_k"] for x in full}):
            spans = [x["span_ms"] for x in full if x["max_k"] == k and not x["mixed"]]
            mixed = [x["span_ms"] for x in full if x["max_k"] == k and x["mixed"]]
            row[f"span_ms_k{k}"] = (statistics.median(spans) if spans else None, len(spans),
                                    statistics.median(mixed) if mixed else None, len(mixed))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="W5", choices=sorted(WORKLOADS))
    p.add_argument("--modes", default="fixed:4,goodput")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--requests-per-client", type=float, default=3)
    p.add_argument("--min-requests", type=int, default=12)
    p.add_argument("--shape", default="8b", choices=("8b", "moe"))
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--piecewise-max-tokens", type=int, default=None,
                   help="the longest step the piecewise graphs serve (default: PIECEWISE_MAX_TOKENS); with "
                        "1024, longer prompt steps run eagerly, to compare")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tries the script)")
    args = p.parse_args()
    if args.piecewise_max_tokens:
        graphs.PIECEWISE_MAX_TOKENS = args.piecewise_max_tokens
    if args.smoke:
        args.concurrency, args.requests_per_client, args.min_requests = "2,4", 1, 4
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    shape = SHAPES[{"8b": "smoke", "moe": "smoke-moe"}[args.shape] if args.smoke else args.shape]
    model, head = write_model_dir(root, shape), write_eagle_dir(root, shape)
    w = WORKLOADS[args.workload]
    if args.smoke:
        w = type(w)(w.name, 16, 16, w.temperature, w.acceptance)
    base = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "simulate_acceptance": w.acceptance}
    cuda = torch.cuda.is_available() and not args.smoke
    engine_args = {"load_format": "dummy", "device": "cuda" if cuda else "cpu", "async_scheduling": True,
                   "max_model_len": args.max_model_len}
    loads = [int(c) for c in args.concurrency.split(",")]
    report = {"workload": vars(w), "args": vars(args), "results": []}
    for mode in args.modes.split(","):
        spec = mode_spec_config(mode, base)
        if spec and spec["policy"] == "goodput":
            spec["decision_log"] = str(out / f"decisions_{args.workload}.jsonl")
            if args.smoke:
                spec["profile_seconds"] = 0.5  # the start-up profile runs, shorter
        engine = LLM(model=str(model), speculative_config=spec, **engine_args).engine
        tokenizer, vocab = engine.tokenizer, shape["vocab_size"]
        warm, _ = random_requests(tokenizer, 2, w.input_len, w.output_len, seed=10**6, model_vocab_size=vocab)
        run_load_offline(engine, warm_up_load(warm), warm, seed=0, temperature=w.temperature)
        for i, c in enumerate(loads):
            n = max(args.min_requests, round(args.requests_per_client * c))
            requests, _ = random_requests(tokenizer, n, w.input_len, w.output_len, seed=i, model_vocab_size=vocab)
            trace = Trace(engine.core, cuda)
            trace.install()
            records, duration, _ = run_load_offline(engine, Load(f"c={c}", ((c, n),)), requests, seed=i,
                                                    temperature=w.temperature)
            trace.uninstall()
            row = {"mode": mode, "concurrency": c, "requests": n,
                   "output_tok_s": sum(r.output_len for r in records) / duration, **summarize(trace, c)}
            del trace  # it holds the engine's parts
            report["results"].append(row)
            print(json.dumps(row), flush=True)
        core = weakref.ref(engine.core)
        del engine, warm, requests, records
        gc.collect()  # the engine's reference cycles hold its GPU memory until collected
        assert core() is None, "an engine outlived its mode"
        if cuda:
            torch.cuda.empty_cache()
    (out / "step_phases.json").write_text(json.dumps(report, indent=1))
    print_table(report["results"])


def print_table(rows: list[dict]) -> None:
    head = ["load", "mode", "tok/s", "wall", *PHASES, "dev span", "dev gap", "mixed", "mean K", "eager cu"]
    print(" | ".join(head))
    for r in rows:
        h = r["host_ms"]
        print(" | ".join([f"c={r['concurrency']}", r["mode"], f"{r['output_tok_s']:.0f}", f"{h['wall']:.2f}",
                          *(f"{h[p]:.2f}" for p in PHASES),
                          f"{r.get('device_span_ms') or 0:.2f}", f"{r.get('device_gap_ms') or 0:.2f}",
                          f"{r['full_mixed_share']:.2f}", f"{r['full_mean_k'] or 0:.2f}",
                          str(r["counts"].get("eager_catch_ups", 0))]))
    print("\nper kind of launch (every batch size): host ms per step that launched it, device span and gap ms")
    print(" | ".join(["load", "mode", "kind", "steps", "wall", "plan", "propose", "launch", "wait", "span", "gap"]))
    for r in rows:
        for kind, k in r["by_kind"].items():
            print(" | ".join([f"c={r['concurrency']}", r["mode"], kind, str(k["steps"]),
                              *(f"{k.get(f'host_{p}_ms', 0):.2f}" for p in ("wall", "plan", "propose", "launch", "wait")),
                              f"{k['span_ms'] or 0:.2f}", f"{k['gap_ms'] or 0:.2f}"]))


if __name__ == "__main__":
    main()
