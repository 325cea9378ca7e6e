"""A full garbage collection's time on this machine, with the heap thawed and frozen
(`tidal.engine.frozen_heap`): a tiny EAGLE-3 engine serving 250 requests, one collection
after 100 frozen steps with the requests still running, then one with the heap thawed.

    PYTHONPATH=.:benchmarks:tests python benchmarks/results/2026-12-01-cpu/full_collection.py
"""
import gc
import tempfile
import time
from pathlib import Path

from gpu_fastpath import SMOKE, random_prompts, write_eagle_dir, write_model_dir
from tidal import LLM, SamplingParams
from tidal.engine import frozen_heap


def collection_ms():
    start = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - start)


with tempfile.TemporaryDirectory() as tmp:
    model, eagle = write_model_dir(Path(tmp), SMOKE), write_eagle_dir(Path(tmp), SMOKE)
    llm = LLM(model=str(model), device="cpu", dtype="float32", load_format="dummy", max_model_len=1024,
              max_num_seqs=256, num_pages=256 * 300 // 16 + 64,
              speculative_config={"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 4,
                                  "simulate_acceptance": 0.6})
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = random_prompts(600, 128, SMOKE["vocab_size"], seed=5)
    for p in prompts[:250]:
        engine.add_request(engine.make_request(p, params))
    sent = 250
    with frozen_heap():
        for _ in range(100):
            for out in engine.step():
                if out.finished and sent < len(prompts):
                    engine.add_request(engine.make_request(prompts[sent], params))
                    sent += 1
        print(f"full collection, frozen, mid-serving: {collection_ms():.1f} ms "
              f"({len(gc.get_objects())} objects tracked and not frozen)")
    print(f"full collection, thawed: {collection_ms():.1f} ms ({len(gc.get_objects())} objects tracked)")
