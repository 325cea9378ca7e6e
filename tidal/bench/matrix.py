"""`tidal bench matrix`: the speculation modes over HTTP on a matrix of workloads (prompt and
output lengths, sampling, SIMULATED acceptance) and closed-loop loads, one server per mode.

Acceptance is simulated (random weights cannot draft well): each workload sends its rates
with every request (`simulate_acceptance`, a benchmark-only field), so one server per mode
serves every workload, and goodput meets each workload as a server meets a change of
traffic. Each cell's figure is output tokens per second while the load was whole (from
the first request sent to the last, `loaded_throughput`): a small cell's drain is as long as
its slowest few requests, and with per-request acceptance that swings the whole run's
figure by a third from one run to the next. The report gives every mode's figure, and
goodput's against the best of the other modes in the same cell, on both measures.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Callable

from tidal.bench.client import run_load, served_model, server_counters
from tidal.bench.datasets import random_requests
from tidal.bench.report import text_table
from tidal.bench.serve import server_process
from tidal.bench.workload import Load, check_warm_up, mode_spec_config, summarize_run, warm_up_load
from tidal.config import SimulatedAcceptance
from tidal.models.config import ModelConfig
from tidal.tokenizer import Tokenizer


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    temperature: float
    acceptance: float | list | dict  # SIMULATED (SimulatedAcceptance's forms)


WORKLOADS = {w.name: w for w in (
    Workload("W1", 128, 128, 0.0, 0.8),
    Workload("W2", 512, 192, 0.7, 0.7),
    Workload("W3", 2048, 256, 0.0, 0.6),
    Workload("W4", 64, 512, 0.7, [0.9, 0.75, 0.6, 0.45]),
    Workload("W5", 256, 256, 0.7, {"mean": 0.6, "std": 0.25}),  # per request, from ~0.1 to ~0.95
)}


def parse_workloads(text: str) -> list[Workload]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"--workloads: unknown {unknown or text!r}; expected some of {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def cell_loads(concurrency: list[int], requests_per_client: float, min_requests: int) -> list[Load]:
    return [Load(f"c={c}", phases=((c, max(min_requests, round(requests_per_client * c))),)) for c in concurrency]


def run_matrix(modes: list[str], workloads: list[Workload], loads: list[Load], *, model: str, spec_config: dict,
               server_args: list[str] = (), num_warmups: int = 2, seed: int = 0,
               server_timeout: float = 600.0, server_log: str | None = None,
               on_cell: Callable[[dict], None] | None = None) -> dict:
    """Every mode on every workload under every load; returns the report (a JSON-able dict).
    `on_cell(report)` sees the report so far after every cell, so that a matrix stopped
    part-way (a time limit) keeps the cells it measured."""
    tokenizer, vocab_size = Tokenizer.from_pretrained(model), ModelConfig.from_pretrained(model).vocab_size
    per_workload = {}  # the same prompts for every mode
    for i, w in enumerate(workloads):
        needed = num_warmups + sum(load.total_requests for load in loads)
        requests, _ = random_requests(tokenizer, needed, w.input_len, w.output_len, seed + 1000 * i, vocab_size)
        cuts = [num_warmups]
        for load in loads:
            cuts.append(cuts[-1] + load.total_requests)
        per_workload[w.name] = requests[:num_warmups], [requests[a:b] for a, b in zip(cuts, cuts[1:])]
    base = {**spec_config, "simulate_acceptance": server_acceptance(workloads[0].acceptance, spec_config)}
    configs = {m: mode_spec_config(m, base) for m in modes}
    rows = []
    report = {"benchmark": "matrix", "model": model, "speculative_config": spec_config, "mode_configs": configs,
              "workloads": [asdict(w) for w in workloads], "modes": modes, "loads": [load.label for load in loads],
              "seed": seed, "note": "acceptance is SIMULATED (simulate_acceptance per workload)", "results": rows}
    for mode in modes:
        with server_process(model, configs[mode], server_args, server_timeout, server_log) as url:
            name = served_model(url)
            for w in workloads:
                extra = {"simulate_acceptance": w.acceptance} if configs[mode] else {}
                warmups, cells = per_workload[w.name]
                warm, _, _ = asyncio.run(run_load(url, name, warm_up_load(warmups), warmups, seed=seed,
                                                  temperature=w.temperature, extra=extra,
                                                  desc=f"{mode} {w.name} warm-up"))
                check_warm_up(mode, warm)
                for j, (load, requests) in enumerate(zip(loads, cells)):
                    before = server_counters(url)
                    records, duration, spans = asyncio.run(run_load(
                        url, name, load, requests, seed=seed + j, temperature=w.temperature, extra=extra,
                        desc=f"{mode} {w.name} {load.label}"))
                    row = summarize_run(mode, load, records, duration, spans, before, server_counters(url))
                    rows.append({"workload": w.name, **row})
                    if on_cell:
                        on_cell(report)
    add_matrix_ratios(report)
    return report


def server_acceptance(acceptance: float | list | dict, spec_config: dict) -> float | list | dict:
    """The servers' simulated acceptance: a workload's, with the sibling factor the user's
    `simulate_acceptance` names, if any (trees: how often a node's further children are the
    target's token). Requests send their workload's rates alone and keep the server's factor."""
    user = SimulatedAcceptance.parse(spec_config.get("simulate_acceptance"))
    if user is None or not user.sibling:
        return acceptance
    return {**(acceptance if isinstance(acceptance, dict) else {"mean": acceptance}), "sibling": user.sibling}


def cell_rate(row: dict) -> float:
    """A cell's figure: output tokens/s while the load was whole (over the whole run where
    every request was sent at once)."""
    loaded = row.get("loaded_output_throughput")
    return row["output_throughput"] if loaded is None else loaded


def add_matrix_ratios(report: dict) -> None:
    """Each goodput row's `vs_best_other`: its `cell_rate` over the best other mode's in the
    same cell (workload, load), and `vs_best_other_whole_run` on the whole run's throughput."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        cells.setdefault((r["workload"], r["load"]), {})[r["mode"]] = r
    for by_mode in cells.values():
        others = [r for m, r in by_mode.items() if m != "goodput"]
        if "goodput" in by_mode and others:
            g = by_mode["goodput"]
            g["vs_best_other"] = cell_rate(g) / max(map(cell_rate, others))
            g["vs_best_other_whole_run"] = g["output_throughput"] / max(r["output_throughput"] for r in others)


def format_matrix(report: dict) -> str:
    """One table per workload: output tokens/s per load and mode (`cell_rate`), goodput / best
    other mode (on it and on the whole run's throughput), goodput's mean K, and the cell's
    failed requests and kernels built while it ran (each a stall: `tidal.compiles`), and
    each mode's preemptions (a mode short of KV pages recomputes what it preempted)."""
    by_key = {(r["workload"], r["mode"], r["load"]): r for r in report["results"]}
    lines = [f"tidal bench matrix: {report['model']}; acceptance is SIMULATED; output tokens/s while the load "
             "was whole (first request sent to last)", ""]
    for w in report["workloads"]:
        lines.append(f"{w['name']}: {w['input_len']} prompt / {w['output_len']} output tokens, temperature "
                     f"{w['temperature']}, SIMULATED acceptance {w['acceptance']}")
        header = ["load", *(f"{m} tok/s" for m in report["modes"])]
        has_goodput = "goodput" in report["modes"]
        header += ["goodput / best other", "(whole run)", "goodput mean K"] if has_goodput else []
        header += ["failed", "kernels built", "preemptions"]
        rows = []
        for load in report["loads"]:
            cell = [by_key[(w["name"], m, load)] for m in report["modes"]]
            row = [load, *(f"{cell_rate(r):.0f}" for r in cell)]
            if has_goodput:
                g = by_key[(w["name"], "goodput", load)]
                row += [f"{g[key]:.3f}" if key in g else "-" for key in ("vs_best_other", "vs_best_other_whole_run")]
                row += [f"{g['mean_k']:.2f}"]
            rows.append(row + [str(sum(r["failed"] for r in cell)), str(sum(r["kernel_compiles"] for r in cell)),
                               "/".join(str(round(r["preemptions"])) for r in cell)])
        lines += [text_table(header, rows), ""]
    return "\n".join(lines)


def plot_matrix(report: dict, path: str) -> None:
    """One panel per workload: each mode's throughput over the best mode's in the cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {(r["workload"], r["mode"], r["load"]): cell_rate(r) for r in report["results"]}
    workloads, loads = report["workloads"], report["loads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.8), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], workloads):
        best = [max(by_key[(w["name"], m, load)] for m in report["modes"]) for load in loads]
        for m in report["modes"]:
            ax.plot(range(len(loads)), [by_key[(w["name"], m, load)] / b for load, b in zip(loads, best)],
                    marker="o", label=m, linewidth=2.5 if m == "goodput" else 1.2)
        ax.set_xticks(range(len(loads)), loads)
        ax.set_title(f"{w['name']}: {w['input_len']}/{w['output_len']}, T={w['temperature']}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tok/s / best mode's")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("tidal bench matrix (SIMULATED acceptance)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
