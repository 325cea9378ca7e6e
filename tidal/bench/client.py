"""The HTTP load generator: streaming /v1/completions requests, closed or open loop
(aiohttp), and the server's speculation counters from /metrics (httpx, one request each)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tidal.bench.datasets import BenchRequest
from tidal.bench.workload import Load, RequestRecord


async def stream_completion(session: aiohttp.ClientSession, model: str, req: BenchRequest, phase: int,
                            temperature: float, extra: dict | None = None) -> RequestRecord:
    """Send one streaming completion of exactly `req.output_len` tokens (ignore_eos), with
    `extra` fields in its body, and time each chunk; the token count comes from the
    stream's usage."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    record = RequestRecord(phase, req.prompt_len, req.output_len, start=time.perf_counter())
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            else:
                async for line in response.content:  # one server-sent event's data line at a time
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[len(b"data: "):])
                    if "error" in chunk:
                        record.error = chunk["error"]["message"]
                    elif chunk["choices"]:
                        record.chunk_times.append(time.perf_counter())
                    elif chunk.get("usage"):
                        record.output_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None and not (record.chunk_times and record.output_tokens):
        record.error = "the stream ended without tokens or usage"
    record.end = record.chunk_times[-1] if record.chunk_times else time.perf_counter()
    return record


async def run_load(base_url: str, model: str, load: Load, requests: list[BenchRequest], *, seed: int,
                   temperature: float = 0.0, extra: dict | None = None,
                   desc: str = "") -> tuple[list[RequestRecord], float, list]:
    """Drive `load` with `requests` (in order), `extra` fields in every body. Returns the
    records, the run's seconds and the (phase, seconds) of each closed-loop phase.

    The load generator must not be what limits the load: at 256 streams a client parses
    thousands of events a second, so it is aiohttp's (whose parser is compiled). httpx's
    pool rescans every connection on each request and response, and bounded an earlier
    measurement of this benchmark at about two thirds of what the server could serve."""
    records, spans = [], []
    bar = tqdm(total=load.total_requests, desc=desc, unit="req", leave=False)
    session = aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 20)
    async with session:

        async def send(req: BenchRequest, phase: int) -> None:
            records.append(await stream_completion(session, model, req, phase, temperature, extra))
            bar.update(1)

        start = time.perf_counter()
        if load.rate is not None:
            tasks = []
            for req, offset in zip(requests, load.arrival_offsets(len(requests), seed)):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(send(req, 0)))
            await asyncio.gather(*tasks)
        else:
            for phase, clients, todo in load.phase_queues(requests):
                phase_start = time.perf_counter()
                await asyncio.gather(*(client_loop(todo, send, phase) for _ in range(min(clients, len(todo)))))
                spans.append((phase, time.perf_counter() - phase_start))
        duration = time.perf_counter() - start
    bar.close()
    return records, duration, spans


async def client_loop(todo: deque[BenchRequest], send, phase: int) -> None:
    """One closed-loop client: take the next request from the shared queue when the last ends."""
    while todo:
        await send(todo.popleft(), phase)


def server_counters(base_url: str) -> dict:
    """The server's totals a run reports the change of: drafted and accepted tokens,
    request-steps that verified drafts, how often each draft length K was chosen (from the
    cumulative `tidal_spec_draft_length` histogram), kernels built while serving, and
    requests preempted for lack of KV pages."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples = {}
    buckets = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tidal_spec_draft_length_bucket" and s.labels["le"] != "+Inf":
                buckets.append((float(s.labels["le"]), s.value))
            samples[s.name] = s.value
    cumulative = [n for _, n in sorted(buckets)]
    return {"drafted": samples["tidal_spec_draft_tokens_total"],
            "accepted": samples["tidal_spec_accepted_tokens_total"],
            "draft_steps": samples["tidal_spec_draft_steps_total"],
            "k_counts": [b - a for a, b in zip([0.0] + cumulative, cumulative)],
            "kernel_compiles": samples["tidal_kernel_compiles_while_serving_total"],
            "preemptions": samples["tidal_preemptions_total"]}


def served_model(base_url: str) -> str:
    """The model name the server answers to (the first of /v1/models)."""
    response = httpx.get(f"{base_url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]
