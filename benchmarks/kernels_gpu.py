"""Check and time the Triton attention kernels on one GPU (Llama-3.1-8B attention shape).

    python benchmarks/kernels_gpu.py [--no-sweep]

For each case (decode, verify of K+1 = 5 tokens, prefill, extend): checks the KV store
(exact) and the attention output against the torch reference in float32 on a sample of
requests, then times the store (`rotate_and_store` without a rotation), attention (eager, median of triton.testing.do_bench) and,
for decode/verify, the whole backend forward replayed from a CUDA graph. Bandwidth is the
K/V bytes the attention must read over its time, against a 4.3 TB/s ceiling. A small
sweep of launch configs follows (to tune `choose_config`). Results go to
$OUT/kernels.json (default ./out); a failing case is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import triton
import triton.testing

# Import the attention modules without running tidal/__init__.py, which loads the serving
# stack (transformers, tokenizers, ...): this script needs only torch, triton and numpy.
_tidal = types.ModuleType("tidal")
_tidal.__path__ = [str(Path(__file__).resolve().parents[1] / "tidal")]
sys.modules["tidal"] = _tidal

from tidal.attention.torch_ref import attend  # noqa: E402
from tidal.attention.triton_attn import (  # noqa: E402
    AttentionConfig, TritonAttention, choose_config, paged_attention, rotate_and_store,
)
from tidal.batch import ForwardBatch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
PEAK_BW = 4.3e12  # bytes/s, measured copy bandwidth of the H200
PEAK_FLOPS = 790e12  # bf16 dense matmul
REL_TOL = 2e-2

DEVICE = torch.device("cuda")


def make_case(batch_size: int, context: int, new_tokens: int, seed: int = 0):
    """Random cache with `context` cached tokens per request on shuffled pages, and q/k/v
    for `new_tokens` more per request."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_len = context + new_tokens
    pages_per_seq = math.ceil(seq_len / PAGE_SIZE)
    num_pages = batch_size * pages_per_seq + 1
    perm = torch.randperm(num_pages, device=DEVICE, generator=gen).tolist()
    tables = [perm[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(batch_size)]
    cache = torch.randn(2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE,
                        dtype=DTYPE, generator=gen)
    batch = ForwardBatch.build([[0] * new_tokens] * batch_size, [context] * batch_size, tables,
                               PAGE_SIZE, DEVICE)
    t = batch.num_tokens
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, k, v, cache, batch, tables


def check(q, k, v, cache, batch, tables, new_tokens) -> dict:
    """Store exactness and attention error on up to 4 sampled requests."""
    rotate_and_store(q, k, v, cache, batch, None)
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    store_ok = bool(torch.equal(flat[0, batch.slot_mapping], k)
                    and torch.equal(flat[1, batch.slot_mapping], v))
    out = paged_attention(q, cache, batch, SCALE)
    sample = sorted({0, len(tables) // 3, len(tables) // 2, len(tables) - 1})
    reference = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    attend(q, reference, cache, batch.page_table, batch.query_start_loc.tolist(), batch.seq_lens.tolist(),
           sample, SCALE)
    max_abs, max_ref = 0.0, 0.0
    for i in sample:
        rows = slice(i * new_tokens, (i + 1) * new_tokens)
        ref = reference[rows]
        max_abs = max(max_abs, (out[rows].float() - ref).abs().max().item())
        max_ref = max(max_ref, ref.abs().max().item())
    rel = max_abs / max_ref
    return {"store_exact": store_ok, "max_abs_err": max_abs, "max_rel_err": rel,
            "ok": store_ok and rel < REL_TOL and math.isfinite(rel)}


def graph_time_ms(fn) -> tuple[float, torch.Tensor]:
    """Capture fn in a CUDA graph and time its replays; returns (ms, the graph's output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, return_mode="median"), out


def run_case(kind: str, batch_size: int, context: int, new_tokens: int) -> dict:
    q, k, v, cache, batch, tables = make_case(batch_size, context, new_tokens)
    cfg = choose_config(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    res = {"kind": kind, "batch": batch_size, "context": context, "new_tokens": new_tokens,
           "config": cfg.__dict__}
    res.update(check(q, k, v, cache, batch, tables, new_tokens))

    seq_len = context + new_tokens
    kv_bytes = batch_size * seq_len * NUM_KV_HEADS * HEAD_DIM * 2 * cache.element_size()
    visible = sum(context + j + 1 for j in range(new_tokens)) * batch_size
    flops = 4 * NUM_HEADS * HEAD_DIM * visible
    res["store_ms"] = triton.testing.do_bench(
        lambda: rotate_and_store(q, k, v, cache, batch, None), return_mode="median")
    res["attn_ms"] = triton.testing.do_bench(
        lambda: paged_attention(q, cache, batch, SCALE), return_mode="median")
    res["attn_tb_s"] = kv_bytes / res["attn_ms"] / 1e9
    res["attn_tflop_s"] = flops / res["attn_ms"] / 1e9
    if kind in ("decode", "verify"):
        backend = TritonAttention()
        eager = backend.forward(q, k, v, cache, batch, SCALE)
        ms, graph_out = graph_time_ms(lambda: backend.forward(q, k, v, cache, batch, SCALE))
        res["graph_ms"] = ms
        res["graph_tb_s"] = kv_bytes / ms / 1e9
        res["graph_matches_eager"] = bool(torch.equal(graph_out, eager))
        res["ok"] = res["ok"] and res["graph_matches_eager"]
    res["bw_frac"] = res.get("graph_tb_s", res["attn_tb_s"]) * 1e12 / PEAK_BW
    return res


def sweep_case(kind, batch_size, context, new_tokens, variants, deadline) -> list[dict]:
    """Time the configs `variants(default_config)` on one case (outputs checked against
    the default config); stops at `deadline`."""
    q, k, v, cache, batch, _ = make_case(batch_size, context, new_tokens)
    rotate_and_store(q, k, v, cache, batch, None)
    want = paged_attention(q, cache, batch, SCALE).float()
    base = choose_config(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    rows = []
    for cfg in variants(base):
        if time.time() > deadline:
            break
        row = {"kind": kind, "batch": batch_size, "context": context, "config": cfg.__dict__,
               "default": cfg == base}
        try:
            got = paged_attention(q, cache, batch, SCALE, cfg).float()
            row["max_abs_diff"] = (got - want).abs().max().item()
            row["ms"] = triton.testing.do_bench(
                lambda: paged_attention(q, cache, batch, SCALE, cfg), return_mode="median")
        except Exception as exc:  # noqa: BLE001 - e.g. a config that does not fit
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(f"  sweep {kind} b={batch_size} ctx={context} {cfg} -> "
              f"{row.get('ms', row.get('error'))}", flush=True)
    return rows


def small_query_variants(base: AttentionConfig) -> list[AttentionConfig]:
    tiles = [AttentionConfig(base.block_m, bn, base.num_splits, w, st)
             for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    splits = [AttentionConfig(base.block_m, base.block_n, s, base.num_warps, base.num_stages)
              for s in sorted({1, max(1, base.num_splits // 2), base.num_splits * 2})]
    return tiles + splits


def prefill_variants(base: AttentionConfig) -> list[AttentionConfig]:
    return [AttentionConfig(bm, bn, 1, w, st)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]


def sweep(deadline: float) -> list[dict]:
    rows = []
    for kind, b, ctx, n in [("decode", 1, 8192, 1), ("decode", 16, 2048, 1),
                            ("verify", 64, 2048, 5)]:
        rows += sweep_case(kind, b, ctx, n, small_query_variants, deadline)
    rows += sweep_case("prefill", 1, 0, 2048, prefill_variants, deadline)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    props = torch.cuda.get_device_properties(DEVICE)
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "shape": [NUM_HEADS, NUM_KV_HEADS, HEAD_DIM],
           "page_size": PAGE_SIZE, "dtype": str(DTYPE)}
    print(env, flush=True)
    start = time.time()

    cases = [("decode", b, c, 1) for b in (1, 16, 64, 256) for c in (128, 512, 2048, 8192)]
    cases += [("verify", b, c, 5) for b in (1, 16, 64, 256) for c in (128, 512, 2048, 8192)]
    cases += [("prefill", 1, 0, 2048), ("prefill", 4, 0, 1024), ("extend", 1, 4096, 512)]
    results = []
    for kind, b, c, n in cases:
        try:
            res = run_case(kind, b, c, n)
        except Exception as exc:  # noqa: BLE001 - report and go on
            res = {"kind": kind, "batch": b, "context": c, "new_tokens": n, "ok": False,
                   "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(res), flush=True)
        results.append(res)
        torch.cuda.empty_cache()

    sweep_rows = []
    if not args.no_sweep:
        try:
            sweep_rows = sweep(deadline=start + 420)
        except Exception as exc:  # noqa: BLE001
            sweep_rows = [{"error": f"{type(exc).__name__}: {exc}"}]

    (out_dir / "kernels.json").write_text(
        json.dumps({"env": env, "cases": results, "sweep": sweep_rows}, indent=1))

    best = {}
    for row in sweep_rows:
        if "ms" in row:
            key = (row["kind"], row["batch"], row["context"])
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    for (kind, b, c), row in best.items():
        print(f"best {kind} b={b} ctx={c}: {row['ms'] * 1e3:.1f} us {row['config']}")

    print(f"\n{'kind':8}{'batch':>6}{'ctx':>6}{'new':>6}{'ok':>4}{'rel_err':>10}{'split':>6}"
          f"{'store_us':>10}{'attn_us':>10}{'graph_us':>10}{'TB/s':>7}{'%peak':>7}{'TFLOP/s':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['kind']:8}{r['batch']:>6}{r['context']:>6}{r['new_tokens']:>6}  FAILED "
                  f"{r['error'][:80]}")
            continue
        graph = f"{r['graph_ms'] * 1e3:10.1f}" if "graph_ms" in r else f"{'-':>10}"
        print(f"{r['kind']:8}{r['batch']:>6}{r['context']:>6}{r['new_tokens']:>6}"
              f"{'yes' if r['ok'] else 'NO':>4}{r['max_rel_err']:>10.2e}"
              f"{r['config']['num_splits']:>6}{r['store_ms'] * 1e3:>10.1f}"
              f"{r['attn_ms'] * 1e3:>10.1f}{graph}"
              f"{r.get('graph_tb_s', r['attn_tb_s']):>7.2f}{r['bw_frac'] * 100:>6.0f}%"
              f"{r['attn_tflop_s']:>9.1f}")
    print(f"wrote {out_dir / 'kernels.json'}; {sum(r['ok'] for r in results)}/{len(results)} ok")


if __name__ == "__main__":
    main()
