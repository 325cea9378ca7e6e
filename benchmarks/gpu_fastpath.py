"""One H200 run for the GPU fast path: correctness first, then speed, side by side.

    PYTHONPATH=. python benchmarks/gpu_fastpath.py            # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_fastpath.py --smoke    # tiny shapes on the CPU (checks the script)

Correctness: greedy tokens of a tiny float32 Llama on the GPU (Triton kernels, CUDA graphs)
equal transformers' and the torch reference backend's. Speed: a Llama-3.1-8B-shaped model
with random weights (bf16): batch-1 decode, offline 256 x (128 in, 128 out) against
transformers' static-cache generate in the same run, both with async scheduling on and
off; a proposer configured at K = 0 vs none; an EAGLE-3-shaped head with SIMULATED
acceptance (0.8, K = 4) vs plain; the scheduler's Python time per step at 256 requests;
where a decode step's time goes at batch 1 and 256, and with a proposer at K = 0 and K = 4
at batch 1 (torch profiler: GPU busy vs idle, top kernels and host ops); and the host time
per step in the engine's phases at batch 1, measured without the profiler; and the
one-pass sampling kernel against the eager sampling race it replaces. Prints a table
last; writes JSON to $OUT/gpu_fastpath.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import tempfile
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from common import LLAMA_8B, SMOKE, write_eagle_dir, write_model_dir
from tidal import LLM, SamplingParams
from tidal.demo import DEMO_DIR
from tidal.runner import PendingStep


def random_prompts(n, length, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def greedy(n):
    """Greedy decoding. The seed only draws simulated acceptance: fixed, every run verifies
    the same accept/reject pattern, so speculative rates compare across runs (with a fresh
    seed per request the accepted tokens per step moved by several percent)."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=0)


def top_p(n):
    """What chat clients commonly send."""
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True)


def free_memory():
    """Give freed engines' GPU memory back (callers drop their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_rate(llm, prompts, new_tokens, params=None):
    """Output tokens per second over the decode phase (first token to last), and overall,
    decoding greedily unless `params` say otherwise. The workload runs once untimed first,
    so Triton compilation stays out of the numbers."""
    params = params or greedy(new_tokens)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    first = min(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_tokens = tokens - len(outs)
    digest = hashlib.sha1(str([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:12]
    result = {"tokens": tokens, "seconds": total, "tok_s": tokens / total,
              "decode_tok_s": decode_tokens / max(last - first, 1e-9),
              "tokens_sha1": digest}  # equal digests: two builds' outputs were token for token the same
    if outs[0].metrics.get("spec", {}).get("num_steps"):
        result["spec_first_request"] = outs[0].metrics["spec"]  # the timed run's own acceptance
    return result


def check_correctness(device, results):
    """Greedy tokens of the shipped demo target (float32) equal transformers', through the
    Triton kernels with and without graphs, the torch reference, and speculation (the demo
    EAGLE-3 head, and the target drafting for itself as a draft model). Each batch of prompts
    is one generate call: short ones, then long ones whose first step fills 1,170, 1,680 and
    the whole 2,048 tokens of the budget (the piecewise graphs' buckets past 1,024)."""
    import transformers

    model_dir = str(DEMO_DIR / "target")
    short = random_prompts(6, 0, 384, seed=1)
    short = [p + [random.Random(i).randrange(3, 384) for _ in range(3 + 9 * i)] for i, p in enumerate(short)]
    batches = [short] + [random_prompts(n, length, 384, seed=2 + n) for n, length in ((3, 390), (4, 420), (5, 430))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    hf.generation_config.eos_token_id = None
    want = [hf.generate(torch.tensor([p], device=device), max_new_tokens=32, min_new_tokens=32,
                        do_sample=False)[0, len(p):].tolist() for b in batches for p in b]
    del hf
    free_memory()

    def generate(llm):
        return [o.outputs[0].token_ids for b in batches for o in llm.generate(b, greedy(32), use_tqdm=False)]
    variants = {"triton+graphs": {}, "triton eager": {"enforce_eager": True},
                "torch reference": {"attention_backend": "torch", "enforce_eager": True}}
    for name, kw in variants.items():
        llm = LLM(model=model_dir, device=device, dtype="float32", page_size=16, **kw)
        got = generate(llm)
        stats = llm.engine.stats()
        results["correctness"][name] = {"equal_to_transformers": got == want,
                                        "pages_free": stats["num_free_pages"] == stats["num_pages"]}
        del llm
        free_memory()
    # Speculation (drafter graphs included) must not change greedy tokens.
    drafters = {"draft_model": model_dir, "eagle3": str(DEMO_DIR / "eagle3")}
    for method, path in drafters.items():
        sc = {"method": method, "model": path, "num_speculative_tokens": 3, "policy": "fixed"}
        llm = LLM(model=model_dir, device=device, dtype="float32", page_size=16, num_pages=512,
                  speculative_config=sc)
        got = generate(llm)
        stats = llm.engine.stats()
        results["correctness"][f"speculative {method}"] = {
            "equal_to_transformers": got == want, "pages_free": stats["num_free_pages"] == stats["num_pages"],
            "accepted": stats["spec"]["num_accepted"], "drafted": stats["spec"]["num_drafted"]}
        del llm
        free_memory()
    drafts_in_graphs(device, results)


CHATS = [[{"role": "user", "content": "How do I sort a list in Python?"}],
         [{"role": "user", "content": "Write a short poem about the sea."}],
         [{"role": "user", "content": "What is the capital of France?"}]]


def drafts_in_graphs(device, results):
    """The drafter's graphs draft what its eager path drafts: on the shipped demo pair (a
    trained head, so drafts are accepted) greedy and seeded sampling, K = 4, with graphs
    and with `enforce_eager`: the same output tokens and the same acceptance."""
    sc = {"method": "eagle3", "model": str(DEMO_DIR / "eagle3"), "num_speculative_tokens": 4, "policy": "fixed"}
    runs = {}
    for mode, kw in {"graphs": {}, "eager": {"enforce_eager": True}}.items():
        llm = LLM(model=str(DEMO_DIR / "target"), device=device, dtype="float32", speculative_config=sc, **kw)
        prompts = [llm.tokenizer.apply_chat_template(c) for c in CHATS]
        for name, params in {"greedy": greedy(48), "sampled": SamplingParams(max_tokens=48, temperature=0.8, seed=7)}.items():
            before = dict(llm.engine.stats()["spec"])
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            after = llm.engine.stats()["spec"]
            runs[(mode, name)] = (tokens, after["num_accepted"] - before["num_accepted"],
                                  after["num_drafted"] - before["num_drafted"])
        del llm
        free_memory()
    for name in ("greedy", "sampled"):
        (g, ga, gd), (e, ea, ed) = runs[("graphs", name)], runs[("eager", name)]
        results["correctness"][f"demo pair drafts, graphs == eager, {name}"] = {
            "tokens_equal": g == e, "accepted_graphs": f"{ga}/{gd}", "accepted_eager": f"{ea}/{ed}"}


@contextmanager
def timing(*targets):
    """Time every call of obj.name for each (label, obj, name), an instance's method or a
    class's function; yields {label: [seconds per call]} and restores the originals."""
    calls, saved = defaultdict(list), []
    for label, obj, name in targets:
        def timed(*args, _fn=getattr(obj, name), _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                calls[_label].append(time.perf_counter() - start)
        saved.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, timed)
    try:
        yield calls
    finally:
        for obj, name, old in reversed(saved):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def gpu_ms(fn, reps=20):
    """Milliseconds of device time per call of fn, after a warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sampling_race(device, results):
    """`fused.race_sample` against the eager race it replaces, on a Llama-3 vocabulary at 1
    and 256 rows: how often they pick the same token (the GPU's fast log may break a
    near-tie differently; the uniforms are the same) and the time of each."""
    from tidal.layers import fused, sampler

    out = {}
    for n in (1, 256):
        weights = torch.rand(n, LLAMA_8B["vocab_size"], device=device) ** 4
        keys = sampler._row_keys(torch.arange(n, device=device), torch.full((n,), 7, device=device),
                                 sampler.STREAM_SAMPLE)

        def eager():
            return (weights / -torch.log(sampler._vocab_uniform(keys, weights.shape[1]))).argmax(-1)

        def kernel():
            return fused.race_sample(weights, keys)

        out[n] = {"agreement": (eager() == kernel()).float().mean().item(), "eager_ms": gpu_ms(eager),
                  "kernel_ms": gpu_ms(kernel)}
    results["correctness"]["sampling race kernel == eager (256 rows)"] = out[256]["agreement"]
    results["speed"]["sampling_race"] = out


def sampling_filters(device, results):
    """Sampling's filters on a Llama-3 vocabulary. The top-p threshold found by sorting
    (`sampler.sorted_top_p`) and by `fused.top_p_threshold`'s search, with 4, 8 or 16 cuts
    per pass, at 1 to 256 rows: how often they agree (they sum the kept mass in different
    orders) and the time of each, which sets `sampler.SEARCH_TOP_P_ROWS`. Then all of
    sampling per filter at 1 and 256 rows (a step takes about 5 and 10 ms there). At one row
    back-to-back calls of small ops time the host's launches more than the GPU."""
    from tidal.config import SamplingParams
    from tidal.layers import fused, sampler

    vocab = LLAMA_8B["vocab_size"]
    search, agreement = {}, []
    for n in (1, 16, 64, 128, 256):
        torch.manual_seed(n)
        scaled = torch.randn(n, vocab, device=device) * 3
        for top_k in (0, 50):
            floor = (scaled.topk(top_k, dim=-1).values[:, -1] if top_k else
                     torch.full((n,), float("-inf"), device=device))
            top_p = torch.full((n,), 0.9, device=device)
            sorted_ = sampler.sorted_top_p(scaled, floor, top_p)
            o = search[f"{n} rows, top_k={top_k}"] = {"sort_ms": gpu_ms(lambda: sampler.sorted_top_p(scaled, floor,
                                                                                                       top_p))}
            for group in (4, 8, 16):
                agreement.append((fused.top_p_threshold(scaled, floor, top_p, group) == sorted_).float().mean().item())
                o[f"search_{group}_ms"] = gpu_ms(lambda: fused.top_p_threshold(scaled, floor, top_p, group))
    results["correctness"]["top-p search == sort (rows, worst case)"] = min(agreement)
    results["speed"]["top_p_threshold"] = search

    filters = {"temperature": {}, "top_k=50": {"top_k": 50}, "top_p=0.9": {"top_p": 0.9},
               "top_k=50 top_p=0.9": {"top_k": 50, "top_p": 0.9}, "min_p=0.1": {"min_p": 0.1}}
    out = {}
    for n in (1, 256):
        logits = torch.randn(n, vocab, device=device) * 3
        counters = torch.zeros(n, dtype=torch.int64, device=device)
        for name, kw in filters.items():
            st = sampler.SamplingTensors.build([SamplingParams(temperature=1.0, **kw)] * n, list(range(n)), device)
            out[f"{name}, {n} rows"] = gpu_ms(lambda: sampler.sample(logits, st, counters))
    results["speed"]["sample_ms"] = out


def scheduler_overhead(llm, prompts, new_tokens):
    """Python time in schedule + commit (host bookkeeping) vs whole step, at full batch."""
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    # With async scheduling a step plans the next one and commits itself.
    with timing(("schedule", scheduler, "schedule"), ("commit", scheduler, "commit"), ("step", engine, "step")) as calls:
        llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    # Decode steps only: skip the first steps (prefill) and the tail.
    steps = list(zip(calls["schedule"], calls["commit"], calls["step"]))[4:-4]
    host = sum(s + c for s, c, _ in steps) / len(steps)
    total = sum(t for _, _, t in steps) / len(steps)
    return {"host_ms": host * 1e3, "step_ms": total * 1e3, "fraction": host / total}


def phase_timing(engine):
    """`timing` of the engine's host phases, measured without the profiler (which inflates
    host costs, CUDA graph launches most): the whole step, the proposer, queueing the
    target's step (`launch`, of which `graph inputs` fill the graphs' buffers), the policy's
    choice and learning, committing, and waiting for the step's tokens (the device's share
    of the step, less what ran behind the host's work)."""
    targets = [("step", engine.core, "step"), ("launch", engine.core.runner, "launch"),
               ("choose", engine.core.scheduler, "_choose"), ("observe", engine.core, "_observe_last"),
               ("commit", engine.core.scheduler, "commit"), ("wait", PendingStep, "result")]
    graph_sets = [engine.core.runner.graphs]
    if engine.core.speculation is not None:
        proposer = engine.core.speculation.proposer  # each set's [0] loads them all
        targets.append(("propose", proposer, "propose"))
        graph_sets += [*proposer.catch_up_graphs.values(), *(c[0] for c in proposer.draft_graphs.values() if c)]
    return timing(*targets, *(("graph inputs", graphs, "load") for graphs in graph_sets if graphs is not None))


def per_step_us(calls) -> dict:
    """Microseconds per step in each phase timed by `phase_timing`."""
    steps = max(len(calls["step"]), 1)
    return {label: 1e6 * sum(times) / steps for label, times in calls.items()}


def host_phases(llm, prompts, new_tokens):
    """Host time per step in the engine's phases while `prompts` decode: where a host-bound
    step goes."""
    with phase_timing(llm.engine) as calls:
        llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    return per_step_us(calls)


def where_time_goes(llm, prompts, steps=24, top_kernels=8, params=greedy):
    """Decode steps under the torch profiler: wall time per step, the GPU's busy time in it
    (kernel durations summed; the rest is the GPU waiting on the host or between kernels),
    the kernels a step launches, and the top kernels (ms and launches per step). `params`
    makes a request's SamplingParams from its output length."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for p in prompts:
        engine.add_request(engine.make_request(p, params(steps + 64)))
    while engine.core.scheduler.waiting or any(r.num_computed < r.num_prompt_tokens for r in engine.core.scheduler.running):
        engine.step()  # prefill first: only decode steps are profiled
    for _ in range(4):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        wall = (time.perf_counter() - start) / steps
    for req in list(engine.core.scheduler.running):
        engine.abort(req.request_id)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps  # us -> ms
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top_kernels]
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"step_ms": wall * 1e3, "gpu_busy_ms": busy, "gpu_idle_ms": wall * 1e3 - busy,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels_ms_per_step": {e.key[:80]: e.self_device_time_total / 1e3 / steps for e in top},
            "top_kernels_per_step": {e.key[:80]: e.count / steps for e in top},
            "top_host_ops_ms_per_step": {e.key[:80]: (e.self_cpu_time_total / 1e3 / steps, e.count // steps)
                                         for e in host}}


def hf_static_generate(model_dir, device, batch, prompt_len, new_tokens):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(random_prompts(batch, prompt_len, config.vocab_size), device=device)
    # Static cache, no torch.compile (transformers would compile a static-cache generate).
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              cache_implementation="static", disable_compile=True)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
    torch.cuda.synchronize() if device == "cuda" else None
    start = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize() if device == "cuda" else None
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    del model
    free_memory()
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "correctness": {}, "speed": {},
               "note": "random weights; speculation rows use SIMULATED acceptance"}
    batch, prompt_len, new_tokens = (8, 16, 16) if args.smoke else (256, 128, 128)
    b1_tokens = 32 if args.smoke else 256
    # Steps under the profiler: on the CPU its trace of a step is thousands of host ops, slow to read back.
    profiled_steps = 3 if args.smoke else 24
    common = dict(device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
                  max_model_len=256 if args.smoke else 2048, max_num_seqs=batch, num_pages=(batch * (prompt_len + new_tokens + 8)) // 16 + 64)

    def section(name, fn):
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)

    if not args.smoke:
        section("correctness", lambda: check_correctness(device, results))
        section("sampling_race", lambda: sampling_race(device, results))
        section("sampling_filters", lambda: sampling_filters(device, results))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), shape)
        eagle_dir = write_eagle_dir(Path(tmp), shape)
        speed = results["speed"]
        one = random_prompts(1, prompt_len, shape["vocab_size"], seed=3)
        many = random_prompts(batch, prompt_len, shape["vocab_size"], seed=4)
        mid = many[:64]

        def plain():
            llm = LLM(model=str(model_dir), **common)
            llm.generate(one, greedy(8), use_tqdm=False)  # warm up
            speed["plain_b1"] = decode_rate(llm, one, b1_tokens)
            speed["plain_b64"] = decode_rate(llm, mid, new_tokens)
            speed["plain_offline"] = decode_rate(llm, many, new_tokens)
            speed["plain_offline_top_p"] = decode_rate(llm, many, new_tokens, top_p(new_tokens))
            speed["scheduler_overhead"] = scheduler_overhead(llm, many, new_tokens)
            speed["profile_b1"] = where_time_goes(llm, one, profiled_steps)
            speed["host_phases_b1"] = host_phases(llm, one, b1_tokens)
            speed["profile_full_batch"] = where_time_goes(llm, many, profiled_steps)
            del llm
            free_memory()

        def plain_sync():
            llm = LLM(model=str(model_dir), async_scheduling=False, **common)
            llm.generate(one, greedy(8), use_tqdm=False)  # warm up
            speed["plain_sync_b1"] = decode_rate(llm, one, b1_tokens)
            speed["plain_sync_offline"] = decode_rate(llm, many, new_tokens)
            del llm
            free_memory()

        def spec(name, **cfg):
            sc = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4, **cfg}
            llm = LLM(model=str(model_dir), speculative_config=sc, **common)
            llm.generate(one, greedy(8), use_tqdm=False)
            speed[f"{name}_b1"] = decode_rate(llm, one, b1_tokens)
            if cfg.get("policy") == "off":
                speed[f"{name}_b64"] = decode_rate(llm, mid, new_tokens)
            speed[f"profile_{name}_b1"] = where_time_goes(llm, one, profiled_steps)
            speed[f"host_phases_{name}_b1"] = host_phases(llm, one, b1_tokens)
            del llm
            free_memory()

        section("plain", plain)
        section("plain_sync", plain_sync)
        section("eagle3_k0", lambda: spec("eagle3_off", policy="off"))
        section("eagle3_sim08_k4", lambda: spec("eagle3_sim08_k4", policy="fixed", simulate_acceptance=0.8))
        if not args.smoke:
            section("transformers", lambda: speed.__setitem__(
                "hf_static_offline", hf_static_generate(str(model_dir), device, batch, prompt_len, new_tokens)))

    rows = []
    s = results["speed"]

    def ratio(a, b, key="decode_tok_s"):
        try:
            return s[a][key] / s[b][key]
        except (KeyError, ZeroDivisionError):
            return float("nan")

    for name, value in results["correctness"].items():
        rows.append((f"greedy == transformers, {name}", str(value)))
    for key in ("plain_b1", "plain_sync_b1", "plain_b64", "plain_offline", "plain_offline_top_p", "plain_sync_offline",
                "eagle3_off_b1", "eagle3_off_b64", "eagle3_sim08_k4_b1", "hf_static_offline"):
        if key in s:
            rows.append((f"{key} tok/s (decode / overall)",
                         f"{s[key].get('decode_tok_s', float('nan')):.0f} / {s[key]['tok_s']:.0f}"))
    rows.append(("offline: tidal / transformers (overall tok/s)", f"{ratio('plain_offline', 'hf_static_offline', 'tok_s'):.2f}x"))
    rows.append(("offline: top-p 0.95 sampling / greedy (overall tok/s)",
                 f"{ratio('plain_offline_top_p', 'plain_offline', 'tok_s'):.3f}"))
    rows.append(("async / sync scheduling, batch 1 (decode tok/s)", f"{ratio('plain_b1', 'plain_sync_b1'):.3f}"))
    rows.append(("async / sync scheduling, offline (overall tok/s)",
                 f"{ratio('plain_offline', 'plain_sync_offline', 'tok_s'):.3f}"))
    rows.append(("K=0 configured / none, batch 1 (time ratio)", f"{ratio('plain_b1', 'eagle3_off_b1'):.3f}"))
    rows.append(("K=0 configured / none, batch 64 (time ratio)", f"{ratio('plain_b64', 'eagle3_off_b64'):.3f}"))
    rows.append(("EAGLE-3 sim 0.8 K=4 / plain, batch 1", f"{ratio('eagle3_sim08_k4_b1', 'plain_b1'):.2f}x"))
    timed = s.get("eagle3_sim08_k4_b1", {}).get("spec_first_request")
    if timed:
        rows.append(("EAGLE-3 batch 1, timed request: steps / tokens per step",
                     f"{timed['num_steps']} / {timed['mean_accepted_length']:.3f} (sim 0.8, K=4 expects 3.362)"))
    if "scheduler_overhead" in s:
        o = s["scheduler_overhead"]
        rows.append(("scheduler host time / step at full batch", f"{o['host_ms']:.2f} / {o['step_ms']:.2f} ms = {o['fraction']:.1%}"))
    for key in ("profile_b1", "profile_full_batch", "profile_eagle3_off_b1", "profile_eagle3_sim08_k4_b1"):
        if key in s:
            o = s[key]
            rows.append((f"{key}: step / GPU busy / GPU idle (ms)",
                         f"{o['step_ms']:.2f} / {o['gpu_busy_ms']:.2f} / {o['gpu_idle_ms']:.2f}"))
    for n, o in s.get("sampling_race", {}).items():
        rows.append((f"sampling race at {n} rows: eager / kernel (ms)", f"{o['eager_ms']:.3f} / {o['kernel_ms']:.3f}"))
    for name, o in s.get("top_p_threshold", {}).items():
        rows.append((f"top-p threshold, {name}: sort / search 4, 8, 16 (ms)",
                     f"{o['sort_ms']:.3f} / " + ", ".join(f"{o[f'search_{g}_ms']:.3f}" for g in (4, 8, 16))))
    for name, ms in s.get("sample_ms", {}).items():
        rows.append((f"sampling, {name} (ms)", f"{ms:.3f}"))
    for key in ("host_phases_b1", "host_phases_eagle3_sim08_k4_b1"):
        if key in s:
            rows.append((f"{key}: us per step", ", ".join(f"{k} {v:.0f}" for k, v in s[key].items())))
    results["table"] = rows
    (out_dir / "gpu_fastpath.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n" + "\n".join(f"{k:<55} {v}" for k, v in rows))


if __name__ == "__main__":
    main()
