"""Where the GPU waits in a batch-1 EAGLE step: profiler trace, GPU idle gaps attributed to the
innermost host label running meanwhile."""
import gzip, json, os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks"),
                str(Path(__file__).resolve().parents[1] / "tests")]
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from gpu_fastpath import SMOKE, LLAMA_8B, write_model_dir, write_eagle_dir, random_prompts, greedy, decode_rate
from tidal import LLM
import tidal.runner, tidal.graphs, tidal.batch, tidal.scheduler, tidal.spec.proposer, tidal.engine

def wrap(cls, name, label):
    fn = getattr(cls, name)
    def w(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    setattr(cls, name, w if not isinstance(cls.__dict__.get(name), staticmethod) else staticmethod(w))

for cls, name in [(tidal.engine.LLMEngine, "step"), (tidal.runner.PendingStep, "result"),
                  (tidal.scheduler.Scheduler, "commit"), (tidal.scheduler.Scheduler, "schedule"),
                  (tidal.scheduler.Scheduler, "choose_ahead"), (tidal.scheduler.Scheduler, "schedule_ahead"),
                  (tidal.spec.proposer.ChainDrafter, "propose"), (tidal.spec.proposer.ChainDrafter, "_sample"),
                  (tidal.spec.proposer.ChainDrafter, "catch_up"),
                  (tidal.runner.ModelRunner, "launch"), (tidal.graphs.CudaGraphs, "run"),
                  (tidal.batch.ForwardBatch, "build"), (tidal.engine.LLMEngine, "_observe_last"),
                  (tidal.engine.LLMEngine, "_output"), (tidal.runner.ModelRunner, "sampling_tensors")]:
    wrap(cls, name, f"{cls.__name__}.{name}")

def analyse(trace_path, steps):
    ev = json.load(open(trace_path))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    labels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    first = min(s for s, _, n in labels if n == "LLMEngine.step")
    last = max(t for _, t, n in labels if n == "LLMEngine.step")
    gaps, end = [], first
    for s, t in gpu:
        if s > end and s > first:
            gaps.append((max(end, first), min(s, last)))
        end = max(end, t)
    idle = defaultdict(float)
    for a, b in gaps:
        if b <= a:
            continue
        # split the gap at label boundaries, attribute each piece to the innermost label
        pts = sorted({a, b, *[x for s, t, _ in labels for x in (s, t) if a < x < b]})
        for p, q in zip(pts, pts[1:]):
            m = (p + q) / 2
            active = [(t - s, n) for s, t, n in labels if s <= m <= t]
            idle[min(active)[1] if active else "(no label)"] += q - p
    busy = defaultdict(float)
    for s, t, n in labels:
        busy[n] += t - s
    return {"idle_us_per_step": {k: v / steps for k, v in sorted(idle.items(), key=lambda x: -x[1])},
            "host_label_us_per_step": {k: v / steps for k, v in sorted(busy.items(), key=lambda x: -x[1])},
            "gaps_per_step": len(gaps) / steps, "total_idle_us_per_step": sum(idle.values()) / steps}

def run(llm, name, out, steps=24):
    one = random_prompts(1, 128, LLAMA_8B["vocab_size"], seed=3)
    llm.generate(one, greedy(8), use_tqdm=False)
    r = decode_rate(llm, one, 256)
    engine = llm.engine
    engine.add_request(engine.make_request(one[0], greedy(steps + 64)))
    while engine.scheduler.waiting or any(q.num_computed < q.num_prompt_tokens for q in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize() if CUDA else None
        wall = (time.perf_counter() - t) / steps
    for q in list(engine.scheduler.running):
        engine.abort(q.request_id)
    path = out / f"trace_{name}.json"
    prof.export_chrome_trace(str(path))
    res = {"decode_tok_s": r["decode_tok_s"], "profiled_step_us": wall * 1e6, **analyse(path, steps)}
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    path.unlink()
    return res

out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True)
tmp = Path(tempfile.mkdtemp())
CUDA = torch.cuda.is_available()
if not CUDA: LLAMA_8B = SMOKE
model_dir, eagle_dir = write_model_dir(tmp, LLAMA_8B), write_eagle_dir(tmp, LLAMA_8B)
common = dict(device="cuda" if CUDA else "cpu", dtype="bfloat16" if CUDA else "float32", load_format="dummy", max_model_len=2048, max_num_seqs=8, num_pages=512)
results = {}
llm = LLM(model=str(model_dir), **common)
results["plain"] = run(llm, "plain", out)
del llm; torch.cuda.empty_cache() if CUDA else None
sc = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4, "policy": "fixed", "simulate_acceptance": 0.8}
llm = LLM(model=str(model_dir), speculative_config=sc, **common)
results["eagle"] = run(llm, "eagle", out)
(out / "trace_summary.json").write_text(json.dumps(results, indent=1))
for k, v in results.items():
    print(k, f"decode {v['decode_tok_s']:.0f} tok/s, profiled step {v['profiled_step_us']:.0f} us, idle {v['total_idle_us_per_step']:.0f} us, gaps {v['gaps_per_step']:.1f}")
    print("  idle by host label:", {a: round(b) for a, b in list(v["idle_us_per_step"].items())[:12]})
    print("  host label time:", {a: round(b) for a, b in list(v["host_label_us_per_step"].items())[:16]})
