"""The OpenAI-compatible server, live on loopback, driven by the real `openai` client.

One server (uvicorn on a thread, its engine core in a process of its own) serves most
tests; others, started by `tidal serve` in a subprocess, cover the CLI, authentication,
the SIGTERM drain and the engine process dying.
"""

import asyncio
import gc
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from openai import APITimeoutError, AsyncOpenAI, AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tidal import EngineConfig, SamplingParams
from tidal.demo import DEMO_NAME, default_model_dir, default_speculative_config
from tidal.engine import EngineCore
from tidal.server import AsyncEngine, build_app

MODEL = "tiny-llama"
API_KEY = "sk-tidal-test"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
GREEDY_BODY = {"temperature": 0, "ignore_eos": True}


@contextmanager
def uvicorn_thread(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def failing_core(config):
    """An engine core whose second step fails (it runs in the core's process: it travels by name)."""
    core = EngineCore(config)
    real_step, calls = core.step, itertools.count()
    core.step = lambda: real_step() if next(calls) != 1 else 1 / 0
    return core


def always_drafting_core(config):
    """An n-gram proposer that always proposes, so that every decode step drafts."""
    core = EngineCore(config)
    core.speculation.proposer.lookup = lambda tokens, n: [3] * n
    return core


@pytest.fixture(scope="module")
def server(checkpoint):
    # Steps queued ahead, as on a GPU (a CPU engine does not plan ahead by default).
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=1024,
                                      async_scheduling=True))
    with uvicorn_thread(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def metrics(url) -> dict[str, float]:
    """Every sample of /metrics, keyed by name{labels}."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(url, timeout=10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["tidal_num_requests_running"] == m["tidal_num_requests_waiting"] == 0 and \
                m["tidal_kv_cache_free_pages"] == m["tidal_kv_cache_pages"]:
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_a_serving_api_process_keeps_its_start_up_objects_out_of_collections(client):
    """A full collection over the libraries' objects holds the API process up, and the
    core with it once its pipe is full (`benchmarks/front_capacity.py` counts the core's
    stalls)."""
    client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=2, **GREEDY)
    assert gc.get_freeze_count() > 100_000


def test_chat_completion(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, **GREEDY)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    # Text parts are joined into the same template input as a plain string.
    text_parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]
    parts = [messages[0], {"role": "user", "content": text_parts}]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, **GREEDY)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens == out.usage.prompt_tokens


def test_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="To be or not", max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="To be or not", max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "It was the best of times"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_seed_and_n(client):
    def sample(**kw):
        return client.completions.create(model=MODEL, prompt="A journey", max_tokens=12, temperature=1.0,
                                         extra_body={"ignore_eos": True}, **kw)

    first, again = sample(seed=1234), sample(seed=1234)
    assert first.choices[0].text == again.choices[0].text
    fanned = sample(seed=1234, n=3)
    assert [c.index for c in fanned.choices] == [0, 1, 2]
    # Choice i is the request with seed + i.
    assert fanned.choices[0].text == first.choices[0].text
    assert fanned.choices[1].text == sample(seed=1235).choices[0].text
    assert fanned.usage.completion_tokens == 36 and fanned.usage.prompt_tokens == first.usage.prompt_tokens

    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=5, stream=True, **GREEDY)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1]  # greedy: both choices agree


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and 2 <= len(top) <= 3
        assert logprob == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset[0] == 0

    streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, stream=True, **GREEDY)
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob == tops[0]


def test_many_concurrent_streams(server):
    async def one(client, i):
        want = 4 + i % 13
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i} says", max_tokens=want, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        finish, usage = None, None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
            usage = chunk.usage or usage
        return want, usage.completion_tokens, finish

    async def run_all():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    steps_before = metrics(server)["tidal_steps_total"]
    results = asyncio.run(run_all())
    assert all(got == want and finish == "length" for want, got, finish in results)
    # They ran as one batch: far fewer steps than tokens.
    assert wait_idle(server)["tidal_steps_total"] - steps_before < sum(want for want, _, _ in results) / 4


def test_disconnect_aborts_and_frees_pages(server, client):
    aborted_before = metrics(server).get("tidal_requests_finished_total{finish_reason=abort}", 0)
    streams = [client.completions.create(model=MODEL, prompt=f"Long story {i}:", max_tokens=480, stream=True, **GREEDY)
               for i in range(4)]
    for stream in streams:
        next(iter(stream))
        next(iter(stream))
        stream.close()
    m = wait_idle(server)
    assert m["tidal_requests_finished_total{finish_reason=abort}"] == aborted_before + 4


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", ', 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", '{"prompt": "a\\udc80b"}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', 400, "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi " * 600}, 400, "prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_request(server, client, path, body, status, param):
    if isinstance(body, str):  # raw JSON text
        response = httpx.post(server + path, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(server + path, json={"model": MODEL, **body} if "model" not in body else body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_metrics_move(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=7, **GREEDY)
    after = wait_idle(server)
    assert after["tidal_generation_tokens_total"] >= before["tidal_generation_tokens_total"] + 7
    assert after["tidal_requests_finished_total{finish_reason=length}"] > \
        before.get("tidal_requests_finished_total{finish_reason=length}", 0)
    assert after["tidal_time_to_first_token_seconds_count"] == before["tidal_time_to_first_token_seconds_count"] + 1
    assert after["tidal_time_per_output_token_seconds_count"] > before["tidal_time_per_output_token_seconds_count"]
    assert after["tidal_spec_draft_tokens_total"] == after["tidal_spec_draft_length_count"] == 0  # no speculation
    assert after["tidal_steps_ahead_total"] > before["tidal_steps_ahead_total"]  # decodes queued ahead
    assert "tidal_policy_decisions_total" not in after  # no goodput policy here
    assert httpx.get(f"{server}/health").status_code == 200


def test_engine_failure_fails_its_requests_and_the_server_recovers(checkpoint):
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=256),
                         make_core=failing_core)
    with uvicorn_thread(build_app(engine, MODEL)) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 500 and "ZeroDivisionError" in response.json()["error"]["message"]
        wait_idle(url)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **GREEDY).usage.completion_tokens == 4


def test_a_consumer_that_falls_behind_takes_the_steps_it_missed_in_one_output(checkpoint):
    """Steps' outputs for a stream its reader has not taken are merged, not queued: fewer
    outputs, the same text and tokens as a request read at once."""
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=256))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    async def run(delay: float) -> tuple[list[str], object]:
        req = await asyncio.to_thread(engine.make_request, "Read me slowly", params, stream=True)
        deltas = []
        async for _, out in engine.generate([req]):
            deltas.append(out.outputs[0].delta)
            await asyncio.sleep(delay)
        return deltas, out

    async def both():
        engine.start()
        try:
            return await run(0.0), await run(0.1)
        finally:
            await engine.stop()

    (fast, fast_final), (slow, slow_final) = asyncio.run(both())
    assert len(slow) < len(fast) <= 32
    assert "".join(slow) == "".join(fast) == slow_final.outputs[0].text == fast_final.outputs[0].text
    assert slow_final.outputs[0].token_ids == fast_final.outputs[0].token_ids and len(slow_final.outputs[0].token_ids) == 32


def test_speculation_metrics(checkpoint):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed", "simulate_acceptance": 0.6}
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=256,
                                      speculative_config=spec), make_core=always_drafting_core)
    with uvicorn_thread(build_app(engine, MODEL)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for i in range(3):
            client.completions.create(model=MODEL, prompt=f"Speculate {i}", max_tokens=20, **GREEDY)
        m = wait_idle(url)
    drafted = m["tidal_spec_draft_tokens_total"]
    assert drafted > 0 and 0 < m["tidal_spec_accepted_tokens_total"] <= drafted
    assert 1 < m["tidal_spec_mean_accepted_length"] <= 4
    assert {f"tidal_spec_acceptance_rate{{position={p}}}" for p in (1, 2, 3)} <= set(m)
    # The chosen draft lengths add up to the drafted tokens; most steps chose the full K = 3.
    assert m["tidal_spec_draft_length_sum"] == drafted
    count = m["tidal_spec_draft_length_count"]
    assert count - m["tidal_spec_draft_length_bucket{le=2}"] > count / 2


def test_goodput_metrics(checkpoint):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "cost_model": "online", "simulate_acceptance": 0.6}
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=256,
                                      speculative_config=spec), make_core=always_drafting_core)
    with uvicorn_thread(build_app(engine, MODEL)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt="Adapt", max_tokens=20, **GREEDY)
        m = wait_idle(url)
        policy = engine.metrics.stats["policy"]  # the core's last snapshot
    assert m["tidal_policy_decisions_total"] == policy["num_decisions"] > 0
    assert m["tidal_policy_step_seconds{kind=observed}"] > 0 and m["tidal_policy_step_seconds{kind=predicted}"] > 0
    assert m["tidal_policy_step_time_error"] == pytest.approx(policy["step_time"]["mean_abs_rel_error"])
    assert {"tidal_policy_held_decisions_total", "tidal_policy_probes_total",
            "tidal_policy_explored_decisions_total"} <= set(m)


def test_a_huge_prompt_is_refused_and_holds_nothing_up(server):
    """A body over the limit is 413 before it is parsed; one under it, too long for the
    context, is 400 without the tokenizer's time; /health answers meanwhile."""
    too_big = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                         headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    latencies, done = [], threading.Event()

    def watch():
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{server}/health").status_code == 200
            latencies.append(time.monotonic() - start)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    long = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "lorem ipsum " * 600_000},
                      timeout=60)
    elapsed = time.monotonic() - start
    done.set()
    watcher.join()
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text
    assert "or more, but max_model_len" in long.json()["error"]["message"]
    assert elapsed < 5 and latencies and max(latencies) < 1.0, (elapsed, max(latencies, default=None))


def test_a_non_streaming_request_whose_client_leaves_is_aborted(server):
    aborted = metrics(server).get("tidal_requests_finished_total{finish_reason=abort}", 0)

    def one(i):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", timeout=1.0,
                       json={"model": MODEL, "prompt": f"Tell a long story {i}", "max_tokens": 480, "temperature": 0,
                             "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = wait_idle(server, timeout=30)
    assert m["tidal_requests_finished_total{finish_reason=abort}"] == aborted + 20


def test_the_engine_process_dying_fails_open_requests_and_health(checkpoint):
    engine = AsyncEngine(EngineConfig(model=checkpoint("llama"), dtype="float32", page_size=8, num_pages=256))
    with uvicorn_thread(build_app(engine, MODEL)) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Die", "max_tokens": 480, "stream": True, **GREEDY_BODY}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            engine.process.kill()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "the engine process died" in json.loads(rest[-2][6:])["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["message"]


def test_many_streams_with_a_quarter_of_clients_leaving():
    """The embedded demo model (its EAGLE-3 head, goodput): 256 clients at once, a quarter of
    them gone mid-stream or mid-request; the others get exactly their tokens, and the server
    ends idle with every page free."""
    engine = AsyncEngine(EngineConfig(model=default_model_dir(), device="cpu",
                                      speculative_config=default_speculative_config()))

    async def one(client, i):
        want = 8 + i % 17
        body = dict(model=DEMO_NAME, prompt=f"Client {i} asks about the sea.", max_tokens=want, **GREEDY)
        if i % 8 == 0:  # leaves mid-request
            with pytest.raises(APITimeoutError):
                await client.with_options(timeout=0.5).completions.create(**{**body, "max_tokens": 400})
            return None
        leaves = i % 8 == 1  # mid-stream
        stream = await client.completions.create(**{**body, "max_tokens": 400} if leaves else body, stream=True,
                                                 stream_options={"include_usage": True})
        received, usage = 0, None
        async for chunk in stream:
            usage = chunk.usage or usage
            received += 1
            if leaves and received == 2:
                break
        await stream.close()
        return None if leaves else (want, usage.completion_tokens, received - 1)

    async def run_all(url):
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(256)))

    with uvicorn_thread(build_app(engine, DEMO_NAME)) as url:
        results = [r for r in asyncio.run(run_all(url)) if r is not None]
        m = wait_idle(url, timeout=60)
    assert len(results) == 192 and all(got == want and chunks >= 1 for want, got, chunks in results)
    assert m["tidal_num_requests_running"] == 0 and m["tidal_kv_cache_free_pages"] == m["tidal_kv_cache_pages"]
    assert m["tidal_requests_finished_total{finish_reason=length}"] == 192
    # Every mid-stream leaver was aborted; a client that left before its request reached the
    # engine left nothing to abort.
    assert 32 <= m["tidal_requests_finished_total{finish_reason=abort}"] <= 64


# -- `tidal serve` in a subprocess: the CLI, --api-key, and the SIGTERM drain ---------------

@contextmanager
def tidal_serve(checkpoint, *args):
    """`tidal serve` in a subprocess; yields (url, process) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tidal", "serve", "--model", checkpoint("llama"), "--dtype", "float32",
           "--port", str(port), "--served-model-name", MODEL, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tidal serve did not start:\n{proc.stdout.read()}")
        time.sleep(0.2)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cli_server(checkpoint):
    with tidal_serve(checkpoint, "--api-key", API_KEY) as server:
        yield server


def test_api_key(cli_server):
    url, _ = cli_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    # The key is checked first: a bad body or an unknown path tells nothing without it.
    assert httpx.post(f"{url}/v1/completions", content=b'{"prompt": ').status_code == 401
    assert httpx.get(f"{url}/v1/nothing-here").status_code == 401
    assert httpx.get(f"{url}/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=3, **GREEDY).usage.completion_tokens == 3


def test_sigterm_drains_running_requests(cli_server):
    url, proc = cli_server
    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="Drain me", max_tokens=300, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = iter(stream)
    next(chunks)
    proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 300  # the running request finished
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_sigterm_ends_what_outlasts_the_drain_window_with_errors(checkpoint):
    with tidal_serve(checkpoint, "--drain-s", "0.3") as (url, proc):
        body = {"model": MODEL, "prompt": "Never done", "max_tokens": 480, **GREEDY_BODY}
        waiting = {}
        thread = threading.Thread(target=lambda: waiting.update(
            response=httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
        thread.start()
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        thread.join()
        assert events[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        response = waiting["response"]
        assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained for


def test_the_server_exits_non_zero_when_its_engine_process_dies(checkpoint):
    with tidal_serve(checkpoint) as (url, proc):
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        core = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(core) == 1  # the engine core (beside multiprocessing's resource tracker)
        os.kill(int(core[0]), signal.SIGKILL)
        assert proc.wait(timeout=30) == 1


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children] + [d for c in children for d in descendants(int(c))]


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting to be reaped."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]


def test_a_server_of_two_tensor_parallel_ranks_serves_one_ranks_tokens_and_stops_them(checkpoint):
    """`tidal serve --tensor-parallel-size 2`: the openai client gets one rank's greedy tokens,
    and on SIGTERM the server ends with its core process and the rank that process started."""
    from tidal import LLM

    prompt = "Split over two ranks"
    want = LLM(model=checkpoint("llama"), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    with tidal_serve(checkpoint, "--tensor-parallel-size", "2") as (url, proc):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert got.choices[0].text == want
        processes = descendants(proc.pid)
        spawned = [p for p in processes if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(spawned) == 2  # the engine core and the rank it started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if running(p)]
