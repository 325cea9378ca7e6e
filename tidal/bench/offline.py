"""`tidal bench offline`: the same modes, loads and requests in-process (tidal.LLM's
engine, stepped directly), without HTTP: the engine's own throughput."""

from __future__ import annotations

import gc
import time
from collections import deque

import torch
from tqdm import tqdm

from tidal import LLM, SamplingParams
from tidal.bench.datasets import BenchRequest
from tidal.bench.workload import (Load, RequestRecord, mode_spec_config, split_requests,
                                  summarize_run, sweep_report, warm_up_load)
from tidal.llm import LLMEngine


def engine_counters(engine: LLMEngine) -> dict:
    """`client.server_counters`, read from an engine in this process."""
    stats = engine.stats()
    return {"drafted": stats["spec"]["num_drafted"], "accepted": stats["spec"]["num_accepted"],
            "draft_steps": stats["spec"]["num_steps"], "k_counts": list(stats["policy"]["draft_len_counts"]),
            "kernel_compiles": stats["kernel_compiles_while_serving"], "preemptions": stats["num_preemptions"]}


class LoadDriver:
    """Feeds a load's requests to the engine and steps it, timing each request's tokens."""

    def __init__(self, engine: LLMEngine, temperature: float, bar: tqdm):
        self.engine = engine
        self.temperature = temperature
        self.bar = bar
        self.running: dict[str, RequestRecord] = {}
        self.records: list[RequestRecord] = []

    def add(self, req: BenchRequest, phase: int) -> None:
        params = SamplingParams(max_tokens=req.output_len, temperature=self.temperature, ignore_eos=True)
        request = self.engine.make_request(req.prompt, params, stream=True)  # times every chunk
        record = RequestRecord(phase, req.prompt_len, req.output_len, start=time.perf_counter())
        self.engine.add_request(request)
        self.running[request.request_id] = record
        self.records.append(record)

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = self.running[out.request_id]
            record.chunk_times.append(now)
            if out.finished:
                record.output_tokens = len(out.outputs[0].token_ids)
                record.end = now
                del self.running[out.request_id]
                self.bar.update(1)


def run_load_offline(engine: LLMEngine, load: Load, requests: list[BenchRequest], *, seed: int,
                     temperature: float = 0.0, desc: str = "") -> tuple[list[RequestRecord], float, list]:
    """Drive `load` in-process; returns what `client.run_load` returns."""
    bar = tqdm(total=load.total_requests, desc=desc, unit="req", leave=False)
    driver, spans = LoadDriver(engine, temperature, bar), []
    start = time.perf_counter()
    if load.rate is not None:
        offsets = load.arrival_offsets(len(requests), seed)
        pending = deque((start + offset, req) for req, offset in zip(requests, offsets))
        while pending or driver.running:
            while pending and pending[0][0] <= time.perf_counter():
                driver.add(pending.popleft()[1], 0)
            if driver.running:
                driver.step()
            else:
                time.sleep(max(0.0, pending[0][0] - time.perf_counter()))
    else:
        for phase, clients, todo in load.phase_queues(requests):
            phase_start = time.perf_counter()
            while todo or driver.running:
                while todo and len(driver.running) < clients:
                    driver.add(todo.popleft(), phase)
                driver.step()
            spans.append((phase, time.perf_counter() - phase_start))
    duration = time.perf_counter() - start
    bar.close()
    return driver.records, duration, spans


def run_offline_sweep(modes: list[str], loads: list[Load], requests: list[BenchRequest], *, model: str,
                      spec_config: dict | None = None, engine_args: dict | None = None, seed: int = 0,
                      temperature: float = 0.0, num_warmups: int = 1, dataset: dict | None = None) -> dict:
    """Every mode under every load, one `LLM` per mode built with `engine_args`; returns
    the same report as `serve.run_sweep`."""
    configs = {m: mode_spec_config(m, spec_config) for m in modes}
    warmups, per_load = split_requests(loads, requests, num_warmups)
    rows = []
    for mode in modes:
        engine = LLM(model=model, speculative_config=configs[mode], **(engine_args or {})).engine
        run_load_offline(engine, warm_up_load(warmups), warmups, seed=seed, temperature=temperature,
                         desc=f"{mode} warm-up")
        for i, (load, load_requests) in enumerate(zip(loads, per_load)):
            before = engine_counters(engine)
            records, duration, spans = run_load_offline(engine, load, load_requests, seed=seed + i,
                                                        temperature=temperature, desc=f"{mode} {load.label}")
            rows.append(summarize_run(mode, load, records, duration, spans, before, engine_counters(engine)))
        engine.shutdown()  # (its tensor-parallel ranks: the next mode's engine starts its own)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return sweep_report("offline", modes, loads, rows, model=model, engine_args=engine_args,
                        spec_config=spec_config, mode_configs=configs, dataset=dataset, seed=seed,
                        temperature=temperature)
