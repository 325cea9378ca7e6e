"""A sweep's report as text tables, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path


def text_table(header: list[str], rows: list[list[str]], labels: int = 1) -> str:
    """Aligned columns: the first `labels` to the left, the numbers after them to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def format_report(report: dict) -> str:
    """The comparison table (output tokens/s per load and mode, with the ratio to the
    baseline mode), then one detail line per run (and per phase of a bursty load)."""
    modes, baseline = report["modes"], report["baseline"]
    by_key = {(r["mode"], r["load"]): r for r in report["results"]}
    header = ["load"]
    for mode in modes:
        header += [f"{mode} tok/s"] + ([f"{mode} ratio"] if baseline and mode != baseline else [])
    rows = []
    for load in report["loads"]:
        row = [load]
        for mode in modes:
            r = by_key[(mode, load)]
            row.append(f"{r['output_throughput']:.1f}")
            if baseline and mode != baseline:
                row.append("-" if r["ratio"] is None else f"{r['ratio']:.2f}")
        rows.append(row)
    lines = [f"tidal bench {report['benchmark']}: {report['model']}, dataset {describe_dataset(report['dataset'])}"]
    if report["simulated_acceptance"] is not None:
        lines.append(f"SIMULATED acceptance: each draft accepted with probability {report['simulated_acceptance']}")
    lines += ["", "output throughput (tokens/s)" + (f", ratio = mode / {baseline}" if baseline else ""),
              text_table(header, rows), "", text_table(*detail_table(report), labels=2)]
    return "\n".join(lines)


def detail_table(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["mode", "load", "done", "failed", "out tokens", "req/s", "tok/s", "TTFT mean/med/p99 ms",
              "TPOT mean/med/p99 ms", "ITL mean/med/p99 ms", "acc len", "accept", "mean K", "preempted"]
    rows = []
    for r in report["results"]:
        rows.append([r["mode"], r["load"], str(r["completed"]), str(r["failed"]), str(r["output_tokens"]),
                     f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}", _latency(r, "ttft"),
                     _latency(r, "tpot"), _latency(r, "itl"), f"{r['mean_accepted_length']:.2f}",
                     f"{r['acceptance_rate']:.2f}", f"{r['mean_k']:.2f}", str(round(r["preemptions"]))])
        for i, p in enumerate(r.get("phases", [])):
            clients = f"{p['clients']} client" + ("s" if p["clients"] > 1 else "")
            rows.append(["", f"  phase {i + 1}: {clients}", str(p["completed"]), str(p["failed"]),
                         str(p["output_tokens"]), f"{p['request_throughput']:.2f}", f"{p['output_throughput']:.1f}",
                         _latency(p, "ttft"), _latency(p, "tpot"), _latency(p, "itl"), "", "", "", ""])
    return header, rows


def _latency(r: dict, name: str) -> str:
    return "/".join(f"{r[f'{stat}_{name}_ms']:.1f}" for stat in ("mean", "median", "p99"))


def describe_dataset(dataset: dict | None) -> str:
    if not dataset:
        return "given requests"
    if dataset["name"] == "random":
        return f"random ({dataset['input_len']} in, {dataset['output_len']} out)"
    return f"sharegpt ({dataset['records_read']} records read from {Path(dataset['path']).name})"


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict, path: str | Path) -> None:
    """Output throughput, median TPOT and mean chosen K against the load, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = report["loads"]
    by_key = {(r["mode"], r["load"]): r for r in report["results"]}
    panels = [("output_throughput", "output tokens/s"), ("median_tpot_ms", "median TPOT (ms)"),
              ("mean_k", "mean chosen K")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (key, title) in zip(axes, panels):
        for mode in report["modes"]:
            ax.plot(range(len(loads)), [by_key[(mode, load)][key] for load in loads], marker="o", label=mode)
        ax.set_xticks(range(len(loads)), loads, rotation=20, ha="right")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    title = f"tidal bench {report['benchmark']}: {Path(str(report['model'])).name}, " \
            f"{describe_dataset(report['dataset'])}"
    if report["simulated_acceptance"] is not None:
        title += f" (SIMULATED acceptance {report['simulated_acceptance']})"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
