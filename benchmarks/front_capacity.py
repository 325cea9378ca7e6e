"""What the API process can stream, with an engine core that costs nothing: `tidal serve`'s
own app and core process, but a core without a model (ClockCore: every --step-ms it commits
one token to every running request). At 256 clients and 24 ms a step, a perfect front
streams 256 / 0.024 = 10,667 tok/s; what it reaches, and the API process's CPU time, bound
what the HTTP path can cost a real engine on any GPU. Also counted: steps the core began
more than four steps late (held up in its send while the API process did not drain the
pipe), and what a full garbage collection in the API process walks, and takes, once it
is up. The load comes from `tidal bench`'s client in this process; the server is a
subprocess.

    PYTHONPATH=.:benchmarks python benchmarks/front_capacity.py [--step-ms 24] [--concurrency 256]
Prints a table and one JSON line. (`--smoke`: a short run, for the CPU tests.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import SMOKE, write_model_dir

from tidal.bench.client import run_load, server_counters
from tidal.bench.datasets import BenchRequest
from tidal.bench.serve import free_port
from tidal.bench.workload import Load, summarize_run
from tidal.config import EngineConfig
from tidal.models.config import ModelConfig
from tidal.processing import EngineOutput
from tidal.request import Request


class ClockCore:
    """The engine core's interface (what `core_process.run_core` calls), without a model."""

    step_s = float(os.environ.get("TIDAL_CLOCK_STEP_S", "0.024"))
    report = os.environ.get("TIDAL_CLOCK_REPORT")  # a folder: stalls.txt, a line per step that began late

    def __init__(self, config: EngineConfig):
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = self.model_config.max_position_embeddings
        self.running: dict[str, Request] = {}
        self.num_steps = self.num_generated_tokens = 0
        self.next_step = time.monotonic()

    def describe(self) -> str:
        return f"a clock core: one token per running request every {self.step_s * 1e3:g} ms"

    def stats(self) -> dict:
        spec = {"num_steps": 0, "num_drafted": 0, "num_accepted": 0, "mean_accepted_length": 1.0,
                "acceptance_per_position": []}
        return {"num_running": len(self.running), "num_waiting": 0, "num_pages": 1, "num_free_pages": 1,
                "prefix_cache_hit_pages": 0, "num_preemptions": 0, "num_steps": self.num_steps,
                "num_steps_ahead": 0, "num_generated_tokens": self.num_generated_tokens,
                "kernel_compiles_while_serving": 0, "spec": spec,
                "policy": {"name": "none", "draft_len_counts": [0]}}

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def request_ids(self) -> list[str]:
        return list(self.running)

    def shutdown(self) -> None:
        """A clock has no ranks to stop."""

    def add_request(self, req: Request) -> None:
        if not self.running:  # idle until now: the next step is due at once, not late
            self.next_step = time.monotonic() - self.step_s
        self.running[req.request_id] = req

    def finish(self, request_id: str, reason: str = "abort", stop_reason=None) -> EngineOutput | None:
        req = self.running.pop(request_id, None)
        return None if req is None else self._end(req, [], reason, stop_reason)

    def step(self) -> list[EngineOutput]:
        late = time.monotonic() - (self.next_step + self.step_s)
        if self.report and late > 4 * self.step_s:  # the core was held up (a send the API did not drain)
            with open(Path(self.report) / "stalls.txt", "a") as f:
                f.write(f"{late:.4f}\n")
        self.next_step = max(self.next_step + self.step_s, time.monotonic())
        time.sleep(max(0.0, self.next_step - time.monotonic()))
        self.num_steps += 1
        outputs = []
        for req in list(self.running.values()):
            token = 300 + len(req.token_ids) % 50  # the demo tokenizer's words (100-149 are lone bytes)
            req.token_ids.append(token)
            req.first_token_time = req.first_token_time or time.monotonic()
            self.num_generated_tokens += 1
            if req.num_output_tokens >= req.params.max_tokens:
                outputs.append(self._end(self.running.pop(req.request_id), [token], "length", None))
            elif req.stream:
                outputs.append(EngineOutput(req.request_id, [token]))
        return outputs

    @staticmethod
    def _end(req: Request, tokens: list[int], reason: str, stop_reason) -> EngineOutput:
        metrics = {"num_prompt_tokens": req.num_prompt_tokens, "num_cached_prompt_tokens": 0, "num_preemptions": 0,
                   "arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": time.monotonic(), "spec": req.spec.as_dict()}
        return EngineOutput(req.request_id, tokens, None, reason, stop_reason, metrics)


def serve(model: str, port: int) -> None:
    import uvicorn

    from tidal.server.api import build_app
    from tidal.server.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=model, device="cpu"), make_core=ClockCore)
    app = build_app(engine, "clock")
    # What a full collection walks in the API process once it is up, and how long it takes.
    objects, begun = len(gc.get_objects()), time.perf_counter()
    gc.collect()
    (Path(os.environ["TIDAL_CLOCK_REPORT"]) / "api_gc.json").write_text(json.dumps(
        {"api_objects": objects, "api_full_collection_ms": 1e3 * (time.perf_counter() - begun)}))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=24.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=768)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--port", type=int, default=None, help="the server's (default: a free one)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--serve", metavar="MODEL", help=argparse.SUPPRESS)  # the server subprocess
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.port)
    if args.smoke:
        args.concurrency, args.num_prompts, args.input_len, args.output_len = 8, 16, 16, 16
    model = str(write_model_dir(Path(tempfile.mkdtemp()), SMOKE))
    args.port = args.port or free_port()
    report = Path(tempfile.mkdtemp())
    env = {**os.environ, "TIDAL_CLOCK_STEP_S": str(args.step_ms / 1e3), "TIDAL_CLOCK_REPORT": str(report)}
    server = subprocess.Popen([sys.executable, __file__, "--serve", model, "--port", str(args.port)], env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                sys.exit("the server exited")
            time.sleep(0.2)
        requests = [BenchRequest([100 + (i + j) % 300 for j in range(args.input_len)], args.output_len)
                    for i in range(args.num_prompts)]
        load = Load(f"c={args.concurrency}", phases=((args.concurrency, args.num_prompts),))
        counters, before = server_counters(url), cpu_seconds(server.pid)
        records, duration, spans = asyncio.run(run_load(url, "clock", load, requests, seed=0, temperature=0.7))
        api_cores = (cpu_seconds(server.pid) - before) / duration
        row = summarize_run("clock", load, records, duration, spans, counters, server_counters(url))
    finally:
        server.terminate()
        server.wait()
    ideal = args.concurrency / (args.step_ms / 1e3)
    stalls = report / "stalls.txt"
    late = [float(x) for x in stalls.read_text().split()] if stalls.exists() else []
    result = {"step_ms": args.step_ms, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
              "output_tok_s": row["output_throughput"], "ideal_tok_s": ideal,
              "of_ideal": row["output_throughput"] / ideal, "api_process_cores": api_cores,
              "failed": row["failed"], "median_ttft_ms": row["median_ttft_ms"], "median_tpot_ms": row["median_tpot_ms"],
              "core_stalls": len(late), "core_stall_s": sum(late), "core_stall_max_ms": 1e3 * max(late, default=0.0),
              **json.loads((report / "api_gc.json").read_text())}
    print(f"clock core, {args.step_ms:g} ms a step, c={args.concurrency}: {result['output_tok_s']:.0f} of "
          f"{ideal:.0f} tok/s ({result['of_ideal']:.2f}); API process {api_cores:.2f} cores; "
          f"{row['failed']} failed; median TTFT {row['median_ttft_ms']:.0f} ms, TPOT {row['median_tpot_ms']:.1f} ms; "
          f"the core held up {len(late)} times, {sum(late):.2f} s in all (longest {result['core_stall_max_ms']:.0f} ms); "
          f"a full collection in the API process walks {result['api_objects']:,} objects in "
          f"{result['api_full_collection_ms']:.0f} ms")
    print(json.dumps(result))
    if row["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
