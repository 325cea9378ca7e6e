"""`tidal bench serve`: every speculation mode under every load, over HTTP. A server is
started per mode (`python -m tidal serve` on a free port), or one given by URL is used."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import httpx

from tidal.bench.client import run_load, served_model, server_counters
from tidal.bench.datasets import BenchRequest
from tidal.bench.workload import (Load, check_warm_up, mode_spec_config, split_requests, summarize_run, sweep_report,
                                  warm_up_load)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(model: str, spec_config: dict | None, server_args: list[str] = (),
                   timeout: float = 600.0, log_path: str | None = None) -> Iterator[str]:
    """`tidal serve` in a subprocess on a free loopback port; yields its URL once /health
    answers, and stops it with SIGTERM on exit. Its output goes to a temporary log, whose
    tail is in the error if it fails to start, and is appended to `log_path` if given."""
    port = free_port()
    cmd = [sys.executable, "-m", "tidal", "serve", "--model", model, "--port", str(port), *server_args]
    if spec_config is not None:
        cmd += ["--speculative-config", json.dumps(spec_config)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + timeout
            while not healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    why = f"exited with code {proc.returncode}" if proc.poll() is not None \
                        else f"did not answer /health within {timeout:g}s"
                    raise RuntimeError(f"the server {why}: {' '.join(cmd)}\n{log.read()[-4000:]}")
                time.sleep(0.2)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if log_path:
                log.seek(0)
                with open(log_path, "a") as out:
                    out.write(f"$ {' '.join(cmd)}\n{log.read()}\n")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def run_sweep(modes: list[str], loads: list[Load], requests: list[BenchRequest], *, model: str,
              spec_config: dict | None = None, server_args: list[str] = (), base_url: str | None = None,
              seed: int = 0, temperature: float = 0.0, num_warmups: int = 1, server_timeout: float = 600.0,
              dataset: dict | None = None) -> dict:
    """Run every mode under every load and return the report (a JSON-able dict). Servers
    are started per mode with `spec_config` (the base: method, drafter, max K) adapted to
    the mode; with `base_url` the running server is used and `modes` is its one label."""
    if base_url is not None and len(modes) != 1:
        raise ValueError(f"modes: a server given by base_url runs one mode, its label; got {modes}")
    configs = {m: None if base_url else mode_spec_config(m, spec_config) for m in modes}
    warmups, per_load = split_requests(loads, requests, num_warmups)
    rows = []
    for mode in modes:
        server = nullcontext(base_url) if base_url else \
            server_process(model, configs[mode], server_args, server_timeout)
        with server as url:
            name = served_model(url)
            warm, _, _ = asyncio.run(run_load(url, name, warm_up_load(warmups), warmups, seed=seed,
                                              temperature=temperature, desc=f"{mode} warm-up"))
            check_warm_up(mode, warm)
            for i, (load, load_requests) in enumerate(zip(loads, per_load)):
                before = server_counters(url)
                records, duration, spans = asyncio.run(run_load(url, name, load, load_requests, seed=seed + i,
                                                                temperature=temperature, desc=f"{mode} {load.label}"))
                rows.append(summarize_run(mode, load, records, duration, spans, before, server_counters(url)))
    return sweep_report("serve", modes, loads, rows, model=model, base_url=base_url, spec_config=spec_config,
                        mode_configs=configs, dataset=dataset, seed=seed, temperature=temperature)

