"""One H200 run for Mixture-of-Experts targets: correctness first, then speed.

    PYTHONPATH=. python benchmarks/moe_gpu.py            # on the GPU machine
    PYTHONPATH=. python benchmarks/moe_gpu.py --smoke    # tiny shapes on the CPU (checks the script)

Correctness: greedy tokens of tiny float32 Qwen3-MoE and Mixtral models on the GPU (fused
MoE kernel, CUDA graphs) equal transformers', with and without speculation (the target
drafting for itself, K = 3); the fused kernel against the torch reference at the real shape.
Speed, random weights (bf16), a Qwen3-30B-A3B shape: batch-1 decode against its floor (the
weights a decode step reads, the router's 8 experts of 128 per layer, at the measured copy
bandwidth); an EAGLE-3-shaped head with SIMULATED acceptance 0.7 at K = 4 against plain at
batch 1; the cost of one step by tokens in it (M decode rows, and one row of width w) beside
a Llama-3.1-8B shape's; offline 256 x (128 in, 128 out) against transformers' generate in the
same run (its run is cut at `--hf-seconds`; its decode rate excludes its prefill); where a
batch-1 decode step's time goes (torch profiler: kernels, launches, GPU busy vs idle). Routing of
random weights is near uniform, the worst case for the union of experts a step reads: the
distinct experts a layer routes M random tokens to are reported beside the step costs.
Sections run in that order and each is skipped once `--deadline` seconds have passed. Prints
a table last; writes JSON to $OUT/moe_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from common import LLAMA_8B, QWEN3_30B_A3B, SMOKE, SMOKE_MOE, write_eagle_dir, write_model_dir
from gpu_fastpath import decode_rate, free_memory, greedy, random_prompts, where_time_goes
from tidal import LLM
from tidal.layers.moe import SparseMoE
from tidal.profiling import dummy_plan, random_tokens, timed
from tidal.step import Drafts

TOKENS_PER_STEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WIDTHS = (1, 2, 3, 5, 9, 17)


def tiny_moe(out_dir: Path, arch: str) -> Path:
    """A tiny random Qwen3-MoE or Mixtral in the Hugging Face layout, its weights wide enough
    that greedy decoding wanders and tokens spread over the experts."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    if arch == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                                             num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0])
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else noise if "embed" in name else 2.0 * noise / p.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    write_model_dir(out_dir.parent / f"{arch}-tok", SMOKE)  # the demo tokenizer, copied beside the weights
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((out_dir.parent / f"{arch}-tok" / "target" / name).read_bytes())
    return out_dir


def check_correctness(device: str, tmp: Path, results: dict) -> None:
    import transformers

    prompts = random_prompts(3, 9, 512, seed=1)
    for arch in ("qwen3moe", "mixtral"):
        path = tiny_moe(tmp / arch, arch)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        expected = [hf.generate(torch.tensor([p], device=device), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
        del hf
        for name, spec in (("plain", None), ("self-drafted K=3", {"method": "draft_model", "model": str(path),
                                                                  "num_speculative_tokens": 3, "policy": "fixed"})):
            llm = LLM(model=str(path), device=device, dtype="float32", speculative_config=spec)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24), use_tqdm=False)]
            results["correctness"][f"{arch} {name}"] = got == expected
            del llm
            free_memory()
    if device == "cuda":  # the kernel at the real shape, bf16, against the reference
        from tidal.layers.fused_moe import fused_moe, routed_moe
        from tidal.layers.moe import experts_reference, route_reference

        s = QWEN3_30B_A3B
        g = torch.Generator(device).manual_seed(0)
        e, h, i, k = s["num_experts"], s["hidden_size"], s["moe_intermediate_size"], s["num_experts_per_tok"]
        w13 = torch.randn(e, 2 * i, h, device=device, generator=g, dtype=torch.bfloat16) * h ** -0.5
        w2 = torch.randn(e, h, i, device=device, generator=g, dtype=torch.bfloat16) * i ** -0.5
        for t in (1, 7, 64, 512):
            x = torch.randn(t, h, device=device, generator=g, dtype=torch.bfloat16)
            weights, ids = torch.softmax(torch.randn(t, e, device=device, generator=g), -1).topk(k)
            diff = (fused_moe(x, w13, w2, weights, ids).float() - experts_reference(x, w13, w2, weights, ids).float())
            results["correctness"][f"fused_moe vs reference, bf16, T={t}: max |diff|"] = float(diff.abs().max())
            logits = torch.randn(t, e, device=device, generator=g, dtype=torch.bfloat16)
            want = experts_reference(x, w13, w2, *route_reference(logits, k, True)).float()
            diff = routed_moe(x, logits, w13, w2, k, True).float() - want
            results["correctness"][f"routed_moe vs reference, bf16, T={t}: max |diff|"] = float(diff.abs().max())


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    n = 4 << 30 if device == "cuda" else 64 << 20
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    seconds = timed(lambda: dst.copy_(src), torch.device(device), repeats=10)
    del src, dst
    return 2 * n / seconds


def bytes_per_decode_step(model) -> dict:
    """Weights one decode token reads: every dense weight but the embedding (one row of it),
    and per sparse layer top_k of its num_experts experts."""
    config, dense, experts = model.config, 0, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            experts += size
        elif not name.startswith("embed_tokens"):
            dense += size
    active = dense + experts * config.num_experts_per_tok / max(config.num_experts, 1)
    return {"dense_bytes": dense, "expert_bytes": experts, "active_bytes": active}


def distinct_experts(model, tokens_list) -> dict:
    """Distinct experts the first sparse layer routes M random tokens (unit-RMS hidden
    states, as its norm hands them on) to, by M: the experts a step of M tokens reads."""
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    weight = moe.gate.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    with torch.inference_mode():
        return {m: int(moe.route(torch.randn(m, weight.shape[1], generator=gen, device=weight.device,
                                             dtype=weight.dtype))[1].unique().numel())
                for m in tokens_list}


def step_costs(llm, context: int = 128) -> dict:
    """Seconds of one target step (runner.launch, graphs as the engine runs them) with M
    decode rows of width 1, and with one row verifying w - 1 drafts."""
    runner = llm.engine.core.runner
    device = runner.device

    def run(batch, width):
        plan = dummy_plan(batch, context, width - 1, runner)
        drafts = Drafts(random_tokens(runner, (batch, width - 1)).to(device), [width - 1] * batch) if width > 1 else None
        return timed(lambda: runner.launch(plan, drafts).result(), device, repeats=5)

    with torch.inference_mode():
        rows = {m: run(m, 1) for m in TOKENS_PER_STEP if m <= llm.engine.config.max_num_seqs}
        width = {w: run(1, w) for w in WIDTHS if w - 1 <= runner.max_draft_len}
    return {"rows": rows, "width_at_batch_1": width}


def hf_generate(shape: dict, device: str, batch: int, prompt_len: int, new_tokens: int, seconds: float) -> dict:
    """transformers' generate on the same shape (random weights, bf16, static cache, no
    compile), cut at `seconds`: overall output tokens/s, and decode tokens/s without its
    prefill (a 1-token generate timed alone)."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(random_prompts(batch, prompt_len, shape["vocab_size"]), device=device)
    kw = dict(do_sample=False, cache_implementation="static", disable_compile=True)

    def run(n, **extra):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw, **extra)
        sync()
        return out.shape[1] - prompt_len, time.perf_counter() - start

    run(2)  # warm up
    _, prefill = run(1)
    steps, total = run(new_tokens, max_time=seconds)
    del model
    free_memory()
    return {"tokens": steps * batch, "seconds": total, "tok_s": steps * batch / total,
            "decode_tok_s": (steps - 1) * batch / max(total - prefill, 1e-9), "prefill_s": prefill,
            "experts_implementation": getattr(config, "_experts_implementation", None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which sections are skipped")
    ap.add_argument("--hf-seconds", type=float, default=60.0)
    ap.add_argument("--skip", nargs="*", default=[], help="sections not to run (correctness, moe_plain, ...)")
    args = ap.parse_args()
    begin = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    moe_shape, dense_shape = (SMOKE_MOE, SMOKE) if args.smoke else (QWEN3_30B_A3B, LLAMA_8B)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "correctness": {}, "speed": {}, "skipped": [],
               "note": "random weights (near-uniform routing); speculation rows use SIMULATED acceptance 0.7"}
    speed = results["speed"]
    batch, prompt_len, new_tokens = (8, 16, 16) if args.smoke else (256, 128, 128)
    b1_tokens = 32 if args.smoke else 256
    common = dict(device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
                  max_model_len=256 if args.smoke else 2048,
                  max_num_seqs=batch if args.smoke else TOKENS_PER_STEP[-1])  # (the cost curve's M = 512 is one step)

    def section(name, fn):
        if name in args.skip:
            return
        if time.perf_counter() - begin > args.deadline:
            results["skipped"].append(name)
            print(f"[{name}] skipped: past the deadline", flush=True)
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        moe_dir = write_model_dir(tmp / "moe", moe_shape)
        eagle_dir = write_eagle_dir(tmp / "moe", moe_shape)
        dense_dir = write_model_dir(tmp / "dense", dense_shape)
        one = random_prompts(1, prompt_len, moe_shape["vocab_size"], seed=3)
        many = random_prompts(batch, prompt_len, moe_shape["vocab_size"], seed=4)

        def moe_plain():
            llm = LLM(model=str(moe_dir), **common)
            model = llm.engine.core.runner.model
            speed["moe_distinct_experts"] = distinct_experts(model, TOKENS_PER_STEP)
            llm.generate(one, greedy(8), use_tqdm=False)  # warm up
            speed["moe_weights"] = bytes_per_decode_step(model)
            speed["moe_b1"] = decode_rate(llm, one, b1_tokens)
            speed["moe_b1_profile"] = where_time_goes(llm, one, top_kernels=24)
            speed["moe_step_s"] = step_costs(llm)
            speed["moe_offline"] = decode_rate(llm, many, new_tokens)
            del llm
            free_memory()

        def moe_eagle3():
            spec = {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 4, "policy": "fixed",
                    "simulate_acceptance": 0.7}
            llm = LLM(model=str(moe_dir), speculative_config=spec, **common)
            llm.generate(one, greedy(8), use_tqdm=False)
            speed["moe_eagle3_sim07_k4_b1"] = decode_rate(llm, one, b1_tokens)
            speed["moe_step_s_with_head"] = step_costs(llm)["width_at_batch_1"]
            del llm
            free_memory()

        def dense_plain():
            llm = LLM(model=str(dense_dir), **common)
            llm.generate(random_prompts(1, prompt_len, dense_shape["vocab_size"]), greedy(8), use_tqdm=False)
            speed["dense_weights"] = bytes_per_decode_step(llm.engine.core.runner.model)
            speed["dense_step_s"] = step_costs(llm)
            del llm
            free_memory()

        section("correctness", lambda: check_correctness(device, tmp, results))
        section("bandwidth", lambda: speed.__setitem__("copy_bytes_per_s", copy_bandwidth(device)))
        section("moe_plain", moe_plain)
        section("moe_eagle3", moe_eagle3)
        section("dense_plain", dense_plain)
        section("transformers", lambda: speed.__setitem__("hf_offline", hf_generate(
            moe_shape, device, batch, prompt_len, new_tokens, args.hf_seconds)))

    rows = [(f"greedy == transformers / reference: {k}", v if isinstance(v, bool) else f"{v:.3g}")
            for k, v in results["correctness"].items()]
    s = speed
    if "moe_b1" in s and "copy_bytes_per_s" in s:
        floor = s["copy_bytes_per_s"] / s["moe_weights"]["active_bytes"]
        s["moe_b1_floor_tok_s"] = floor
        rows.append(("MoE batch 1: decode tok/s / floor (active weights at copy bandwidth)",
                     f"{s['moe_b1']['decode_tok_s']:.0f} / {floor:.0f} = {s['moe_b1']['decode_tok_s'] / floor:.2f}"))
    if "moe_b1_profile" in s:
        prof = s["moe_b1_profile"]
        rows.append(("MoE batch 1 under the profiler: step ms, GPU busy ms, kernels per step",
                     f"{prof['step_ms']:.2f}, {prof['gpu_busy_ms']:.2f}, {prof['kernels_per_step']:.0f}"))
        for name, ms in list(prof["top_kernels_ms_per_step"].items())[:12]:
            rows.append((f"  {name[:60]}", f"{ms * 1e3:.0f} us, {prof['top_kernels_per_step'][name]:.0f} launches"))
    if "moe_eagle3_sim07_k4_b1" in s and "moe_b1" in s:
        rows.append(("MoE batch 1: EAGLE-3 sim 0.7 K=4 / plain (decode tok/s)",
                     f"{s['moe_eagle3_sim07_k4_b1']['decode_tok_s'] / s['moe_b1']['decode_tok_s']:.2f}x"))
    if "moe_offline" in s and "hf_offline" in s:
        for key in ("tok_s", "decode_tok_s"):
            rows.append((f"offline 256x(128,128) {key}: tidal / transformers",
                         f"{s['moe_offline'][key]:.0f} / {s['hf_offline'][key]:.0f} = "
                         f"{s['moe_offline'][key] / s['hf_offline'][key]:.1f}x"))
    if "moe_distinct_experts" in s:
        rows.append(("MoE distinct experts a layer reads, by tokens in the step (M: experts)",
                     ", ".join(f"{m}: {n}" for m, n in s["moe_distinct_experts"].items())))
    for name in ("moe", "dense"):
        curve = s.get(f"{name}_step_s", {})
        for kind, points in curve.items():
            base = points.get(1)
            if base:
                rows.append((f"{name} step ms by {kind} (M: ms, x of M=1)",
                             ", ".join(f"{m}: {t * 1e3:.2f} ({t / base:.2f})" for m, t in points.items())))
    results["table"] = rows
    (out_dir / "moe_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{'what':<72} value")
    for what, value in rows:
        print(f"{what:<72} {value}")
    if results["skipped"] or results.get("errors"):
        print("skipped:", results["skipped"], "errors:", list(results.get("errors", {})))


if __name__ == "__main__":
    main()
