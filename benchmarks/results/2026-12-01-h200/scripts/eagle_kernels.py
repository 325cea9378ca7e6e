"""GPU time of batch-1 decode steps by host phase and kernel, plain and EAGLE-3 (sim 0.8,
K = 4): each kernel is traced through its correlation id to the runtime call that
launched it (a graph launch for the kernels inside a graph), and from there to the host
labels open around that call. Prints the table, writes $OUT/eagle_kernels_{plain,eagle}.json and the
gzipped traces.

    PYTHONPATH=.:benchmarks:tests python benchmarks/results/2026-12-01-h200/scripts/eagle_kernels.py plain
    PYTHONPATH=.:benchmarks:tests python benchmarks/results/2026-12-01-h200/scripts/eagle_kernels.py eagle
"""
import gzip, json, os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import tidal.engine, tidal.graphs, tidal.runner, tidal.spec.proposer
from gpu_fastpath import LLAMA_8B, SMOKE, decode_rate, greedy, random_prompts, write_eagle_dir, write_model_dir
from tidal import LLM


def wrap(owner, name, label):
    fn = getattr(owner, name)

    def labelled(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    setattr(owner, name, labelled)


for owner, name in [(tidal.engine.LLMEngine, "step"), (tidal.runner.PendingStep, "result"),
                    (tidal.spec.proposer.ChainDrafter, "propose"), (tidal.spec.proposer.ChainDrafter, "_run"),
                    (tidal.spec.proposer.ChainDrafter, "_sample"), (tidal.spec.proposer.ChainDrafter, "catch_up"),
                    (tidal.runner.ModelRunner, "launch"), (tidal.graphs.CudaGraphs, "replay"),
                    (tidal.graphs.CudaGraphs, "load"), (tidal.runner, "verify"), (tidal.runner, "sample"),
                    (tidal.runner, "with_device_tails"), (tidal.spec.proposer, "with_device_tails"),
                    (tidal.runner.PendingStep, "copy_to_host")]:
    wrap(owner, name, name)


def attribute(trace_path, steps):
    ev = json.load(open(trace_path))["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    labels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation")
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "cpu_op")
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    by, per_label = defaultdict(lambda: [0, 0.0]), defaultdict(float)
    for k in gpu:
        launch = launches.get(k["args"].get("correlation"))
        path, op = "(unknown)", ""
        if launch is not None:
            ts = launch["ts"]
            path = "/".join(n for s, t, n in labels if s <= ts <= t and n != "step") or "(step)"
            inner = [n for s, t, n in ops if s <= ts <= t]
            op = "graph" if launch["name"] == "cudaGraphLaunch" else (inner[-1] if inner else launch["name"])
        key = (path, op, k["name"][:90])
        by[key][0] += 1
        by[key][1] += k["dur"]
        per_label[path] += k["dur"]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    busy = sum(v[1] for v in by.values())
    return {"gpu_busy_us": busy / steps, "gpu_span_us": span / steps, "kernels_per_step": len(gpu) / steps,
            "per_label_us": {p: v / steps for p, v in sorted(per_label.items(), key=lambda x: -x[1])},
            "kernels": sorted(([p, o, n, c / steps, d / steps] for (p, o, n), (c, d) in by.items()),
                              key=lambda x: -x[4])}


def run(llm, name, out, steps=24):
    one = random_prompts(1, 128, llm.engine.model_config.vocab_size, seed=3)
    llm.generate(one, greedy(8), use_tqdm=False)
    rate = decode_rate(llm, one, 256)
    engine = llm.engine
    engine.add_request(engine.make_request(one[0], greedy(steps + 64)))
    while engine.scheduler.waiting or any(q.num_computed < q.num_prompt_tokens for q in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    for q in list(engine.scheduler.running):
        engine.abort(q.request_id)
    path = out / f"trace_{name}.json"
    prof.export_chrome_trace(str(path))
    res = {"decode_tok_s": rate["decode_tok_s"], "profiled_step_us": wall * 1e6, **attribute(path, steps)}
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    path.unlink()
    return res


def main():
    """One configuration per process (a second engine in one process failed to capture its
    graphs after the first was profiled)."""
    name = sys.argv[1]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    cuda = torch.cuda.is_available()  # without one: a smoke run of the script on tiny shapes
    shape = LLAMA_8B if cuda else SMOKE
    model_dir, eagle_dir = write_model_dir(tmp, shape), write_eagle_dir(tmp, shape)
    common = dict(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", load_format="dummy",
                  max_model_len=2048 if cuda else 512, max_num_seqs=8, num_pages=512)
    if name == "eagle":
        common["speculative_config"] = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4,
                                        "policy": "fixed", "simulate_acceptance": 0.8}
    r = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
         **run(LLM(model=str(model_dir), **common), name, out)}
    (out / f"eagle_kernels_{name}.json").write_text(json.dumps(r, indent=1))
    print(f"\n== {name}: decode {r['decode_tok_s']:.0f} tok/s; profiled step {r['profiled_step_us']:.0f} us, "
          f"GPU busy {r['gpu_busy_us']:.0f}, span {r['gpu_span_us']:.0f}, {r['kernels_per_step']:.0f} GPU ops/step")
    for p, v in r["per_label_us"].items():
        print(f"  {v:8.1f} us  {p}")
    for p, o, n, c, d in r["kernels"][:100]:
        print(f"{d:8.1f} us {c:6.1f}x  {p:42.42} {o:26.26} {n}")


if __name__ == "__main__":
    main()
