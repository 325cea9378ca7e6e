"""What a benchmark runs (speculation modes, loads) and how one run is summarised.

A mode is a speculation policy: "none" (no speculation at all), "off" (the speculative
method loaded, policy off), "fixed:K", "table" or "goodput". A load is either closed loop
(phases of N clients, each sending its next request when the last one ends) or open loop
(Poisson arrivals at a request rate).
"""

from __future__ import annotations

import random
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from tidal.config import SpecConfig

DEFAULT_CONCURRENCY = (1, 10, 70, 250)
BASELINES = ("off", "none")  # ratios are taken against the first of these in the run


@dataclass(frozen=True)
class Load:
    label: str
    phases: tuple[tuple[int, int], ...] = ()  # closed loop: (clients, requests), run in order
    cycles: int = 1                           # closed loop: how often the phases repeat
    rate: float | None = None                 # open loop: requests per second (Poisson)
    num_requests: int = 0                     # open loop: how many

    @property
    def total_requests(self) -> int:
        return self.num_requests if self.rate is not None else self.cycles * sum(n for _, n in self.phases)

    def arrival_offsets(self, count: int, seed: int) -> list[float]:
        """Open loop: seconds after the start at which each request is sent (Poisson)."""
        rng, offset, offsets = random.Random(seed), 0.0, []
        for _ in range(count):
            offsets.append(offset)
            offset += rng.expovariate(self.rate)
        return offsets

    def phase_queues(self, requests: list) -> Iterator[tuple[int, int, deque]]:
        """Closed loop: (phase, clients, its requests in order) for each phase of each cycle."""
        queue = iter(requests)
        for _ in range(self.cycles):
            for phase, (clients, n) in enumerate(self.phases):
                yield phase, clients, deque(next(queue) for _ in range(n))


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, one clock)."""

    phase: int
    prompt_len: int
    output_len: int               # tokens asked for
    start: float
    chunk_times: list[float] = field(default_factory=list)  # each arrival of new tokens
    output_tokens: int = 0        # tokens received
    end: float = 0.0
    error: str | None = None


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in ("none", "off", "table", "goodput") and not re.fullmatch(r"fixed:[1-9]\d*", m):
            raise ValueError(f"--modes: unknown mode {m!r}; expected none, off, fixed:K (K >= 1), table or goodput")
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--modes: need distinct modes, got {text!r}")
    return modes


def mode_spec_config(mode: str, base: dict | None) -> dict | None:
    """The speculative config of one mode, from the user's base config (method, drafter)."""
    if mode == "none":
        return None
    if not base:
        raise ValueError(f"--speculative-config: mode {mode!r} needs a base config with the method, "
                         'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    config = {**base, "policy": mode.split(":")[0]}
    if mode.startswith("fixed:"):  # K drafts: a chain's length, or a tree's nodes
        config["num_draft_tokens" if config.get("topk", 1) > 1 else "num_speculative_tokens"] = int(mode.split(":")[1])
    if config["policy"] != "table":
        config.pop("table", None)
    SpecConfig.from_dict(config)  # a bad config fails here, before any server starts
    return config


def positive_list(option: str, text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{option}: values must be > 0, got {text!r}")
    return values


def parse_bursty(text: str) -> tuple[tuple[int, int], ...]:
    """"1:20,128:200" -> ((1, 20), (128, 200)): 1 client for 20 requests, then 128 for 200."""
    phases = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+):(\d+)\s*", part)
        if not m or int(m[1]) < 1 or int(m[2]) < 1:
            raise ValueError(f"--bursty: expected CLIENTS:REQUESTS pairs like 1:20,128:200, got {text!r}")
        phases.append((int(m[1]), int(m[2])))
    return tuple(phases)


def build_loads(concurrency: str | None = None, request_rate: str | None = None, bursty: str | None = None,
                bursty_cycles: int = 2, num_prompts: int | None = None) -> list[Load]:
    """The loads of a sweep; concurrency levels default to 1,10,70,250 when no load is given.
    A closed-loop level of c clients runs `num_prompts` requests (default max(100, 4c)),
    an open-loop rate `num_prompts` (default 200)."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if bursty_cycles < 1:
        raise ValueError(f"--bursty-cycles must be >= 1, got {bursty_cycles}")
    if concurrency is None and request_rate is None and bursty is None:
        concurrency = ",".join(map(str, DEFAULT_CONCURRENCY))
    loads = []
    for c in positive_list("--concurrency", concurrency, int) if concurrency else []:
        loads.append(Load(f"c={c}", phases=((c, num_prompts or max(100, 4 * c)),)))
    for r in positive_list("--request-rate", request_rate, float) if request_rate else []:
        loads.append(Load(f"rate={r:g}/s", rate=r, num_requests=num_prompts or 200))
    if bursty:
        loads.append(Load(f"bursty {bursty}x{bursty_cycles}", phases=parse_bursty(bursty), cycles=bursty_cycles))
    return loads


def split_requests(loads: list[Load], requests: list, num_warmups: int) -> tuple[list, list[list]]:
    """(warm-up requests, each load's requests): disjoint slices of `requests`, so that no
    prompt is served twice by one server (its prefix cache would flatter the later load),
    and the same slices for every mode, so that modes compare like with like."""
    needed = num_warmups + sum(load.total_requests for load in loads)
    if len(requests) < needed:
        raise ValueError(f"{needed} requests needed ({num_warmups} warm-up + the loads'), {len(requests)} given")
    slices, start = [], num_warmups
    for load in loads:
        slices.append(requests[start:start + load.total_requests])
        start += load.total_requests
    return requests[:num_warmups], slices


def warm_up_load(requests: list) -> Load:
    """All warm-up requests at once (they also check that the requests are valid)."""
    return Load("warm-up", phases=((max(len(requests), 1), len(requests)),))


def check_warm_up(mode: str, records: list[RequestRecord]) -> None:
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"mode {mode}: a warm-up request failed: {errors[0]}")


# -- summaries ----------------------------------------------------------------------------

def _stats(name: str, seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1000 if seconds else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def loaded_throughput(records: list[RequestRecord]) -> tuple[float | None, float]:
    """Output tokens per second while the load was whole, and that window's seconds: from
    the first request sent to the last. After the last one is sent, a run drains: fewer and
    fewer requests remain, and how long that takes is set by its slowest few requests (with
    acceptance that differs per request, their luck), not by the load it was meant to put
    on the server. A request's tokens count in the window in proportion to its chunks that
    arrived in it (chunks are what a client sees; their token counts it does not). None
    when no request was sent after another had ended (all at once: there is no window)."""
    done = [r for r in records if r.error is None and r.chunk_times]
    if not done:
        return None, 0.0
    first, last = min(r.start for r in records), max(r.start for r in records)
    if last <= min(r.end for r in done):
        return None, 0.0
    tokens = sum(r.output_tokens * sum(t <= last for t in r.chunk_times) / len(r.chunk_times) for r in done)
    return tokens / (last - first), last - first


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """Throughput and latency of the requests of one run (or one phase) over `duration`.
    TPOT is per request (time after the first token / tokens after the first); ITL is
    the time between token arrivals, which may bring several tokens with speculation."""
    ok = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in records if r.error is not None)
    loaded, loaded_s = loaded_throughput(records)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors.most_common(5)),  # the commonest failures, with their counts
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r in records),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "loaded_output_throughput": loaded,
        "loaded_s": loaded_s,
        **_stats("ttft", [r.chunk_times[0] - r.start for r in ok]),
        **_stats("tpot", [(r.end - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        **_stats("itl", [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]),
        **_stats("e2el", [r.end - r.start for r in ok]),
    }


def request_times(records: list[RequestRecord]) -> list[list[float]]:
    """[sent, first token, end] of each request, in ms from the first one sent (None where it
    failed): when each request got its tokens, so that a run's first wave, its steady state
    and its tail can be told apart."""
    zero = min((r.start for r in records), default=0.0)

    def ms(t):
        return round(1000 * (t - zero), 1)

    return [[ms(r.start), ms(r.chunk_times[0]) if r.chunk_times else None, ms(r.end) if r.error is None else None]
            for r in records]


def counters_delta(before: dict, after: dict) -> dict:
    """Speculation during a run, from two `server_counters` snapshots: the acceptance rate,
    the mean accepted length (accepted drafts + 1 per request-step that verified drafts),
    the share of each K the policy chose for decoding requests (a proposer may draft fewer,
    as n-gram does when it finds nothing), the kernels built and the requests preempted
    while it ran."""
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    drafting_steps = after["draft_steps"] - before["draft_steps"]
    counts = [a - b for a, b in zip(after["k_counts"], before["k_counts"])]
    steps = sum(counts)
    return {
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafting_steps if drafting_steps else 1.0,
        "mean_k": sum(k * n for k, n in enumerate(counts)) / steps if steps else 0.0,
        "k_share": [n / steps for n in counts] if steps else [],
        "kernel_compiles": after["kernel_compiles"] - before["kernel_compiles"],
        "preemptions": after["preemptions"] - before["preemptions"],
    }


def summarize_run(mode: str, load: Load, records: list[RequestRecord], duration: float,
                  spans: list[tuple[int, float]], before: dict, after: dict) -> dict:
    """One row of the report: a mode under a load. `spans` are (phase, seconds) of each
    closed-loop phase as it ran; a load of several phases also gets a summary per phase."""
    row = {"mode": mode, "load": load.label, **summarize(records, duration), **counters_delta(before, after),
           "request_times_ms": request_times(records)}
    if len(load.phases) > 1 or load.cycles > 1:
        row["phases"] = [
            {"clients": clients, **summarize([r for r in records if r.phase == i],
                                             sum(seconds for phase, seconds in spans if phase == i))}
            for i, (clients, _) in enumerate(load.phases)]
    return row


def add_ratios(results: list[dict], modes: list[str]) -> str | None:
    """Set each result's `ratio` (output throughput / the baseline mode's on the same load);
    returns the baseline mode, None when the run has none."""
    baseline = next((m for m in BASELINES if m in modes), None)
    if baseline is None:
        return None
    base = {r["load"]: r["output_throughput"] for r in results if r["mode"] == baseline}
    for r in results:
        r["ratio"] = r["output_throughput"] / base[r["load"]] if base.get(r["load"]) else None
    return baseline


def sweep_report(benchmark: str, modes: list[str], loads: list[Load], rows: list[dict], *,
                 spec_config: dict | None, **fields) -> dict:
    """The report of a sweep, as a JSON-able dict: settings, one row per (mode, load) and
    each row's throughput ratio against the baseline mode."""
    return {"benchmark": benchmark, **fields, "speculative_config": spec_config,
            "simulated_acceptance": (spec_config or {}).get("simulate_acceptance"),
            "modes": modes, "loads": [load.label for load in loads],
            "baseline": add_ratios(rows, modes), "results": rows}
