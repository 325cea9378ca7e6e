"""The kernels of a Qwen3-30B-A3B-shaped decode step alone (E = 128, k = 8, H = 2048, I = 768,
bf16), by tokens in the step: the fused MoE's grouped GEMMs with the tiles `_config` picks
and with others, the router's torch ops against its one kernel, and `fused.gemv` (batch 1's
products) at the attention's and router's shapes with other tiles, beside cuBLAS; the norm
fused into the one-token product (`fused.norm_gemv`, by tiles) against the norm and `gemv`
as two launches; routing and grouping in one program against `route` and the grouping. Each
variant runs over 8 layers of distinct weights in one CUDA graph, so weights come from HBM
as in a model's step, not from L2; times are per layer. Against them, the floor: the bytes
read at the copy bandwidth (`moe_gpu.copy_bandwidth`). Checks each variant against the torch reference first. Prints
tables; writes JSON to $OUT/fused_moe_sweep.json.

    PYTHONPATH=. python benchmarks/fused_moe_sweep.py [--sections norm_gemv route_group]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_gpu import copy_bandwidth
from tidal.layers import fused
from tidal.layers.fused_moe import _config, _group_by_expert, _route_and_group, fused_moe, route
from tidal.layers.moe import experts_reference, route_reference

LAYERS = 8
# Grouped-GEMM tiles tried at decode sizes: (BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_M 16.
TILES = ((32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (32, 64, 4, 6),
         (64, 256, 8, 3), (128, 128, 8, 3))
# fused.gemv tiles (BLOCK_N, BLOCK_K) at batch 1's product shapes (N, K): the MoE's q|k|v, o and
# router, and Llama-8B's four for comparison.
GEMV_TILES = ((1, 512), (1, 1024), (2, 512), (4, 256), (4, 512), (8, 256))
GEMV_SHAPES = {"moe qkv": (5120, 2048), "moe o": (2048, 4096), "moe router": (128, 2048),
               "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336)}


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of fn (which runs LAYERS layers), replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # builds the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best / LAYERS


def moe_rows(tokens_list, bandwidth, gen) -> list[dict]:
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = [torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden**0.5
           for _ in range(LAYERS)]
    w2 = [torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
          for _ in range(LAYERS)]
    rows = []
    for tokens in tokens_list:
        x = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
        logits = [torch.randn(tokens, experts, device="cuda", generator=gen) for _ in range(LAYERS)]
        routed = [route(lg, top_k, True) for lg in logits]
        ref_w, ref_ids = route_reference(logits[0], top_k, True)
        ref = experts_reference(x[0], w13[0], w2[0], *routed[0])
        distinct = sum(r[1].unique().numel() for r in routed) / LAYERS
        row = {"tokens": tokens, "distinct_experts": distinct,
               "floor_us": distinct * 3 * hidden * inter * 2 / bandwidth * 1e6,
               "route_ids_equal": bool(torch.equal(routed[0][1].long(), ref_ids)),
               "route_weights_diff": (routed[0][0] - ref_w).abs().max().item(),
               "route_torch_us": graph_us(lambda: [route_reference(lg, top_k, True) for lg in logits]),
               "route_kernel_us": graph_us(lambda: [route(lg, top_k, True) for lg in logits]),
               "config": _config(tokens, top_k, experts, torch.bfloat16), "tiles": {}}
        tiles = [None] + ([dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for n, k, w, s in TILES]
                          if tokens * top_k / experts <= 8 else [])
        for config in tiles:
            name = "config" if config is None else "{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**config)
            diff = (fused_moe(x[0], w13[0], w2[0], *routed[0], config=config) - ref).abs().max().item()
            us = graph_us(lambda: [fused_moe(x[i], w13[i], w2[i], *routed[i], config=config) for i in range(LAYERS)])
            row["tiles"][name] = {"us": us, "diff": diff}
        rows.append(row)
        print(row, flush=True)
    return rows


def gemv_rows(bandwidth, gen) -> list[dict]:
    rows = []
    for shape_name, (n, k) in GEMV_SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(LAYERS)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x, ws[0]).float()
        row = {"shape": shape_name, "n": n, "k": k, "floor_us": n * k * 2 / bandwidth * 1e6,
               "cublas_us": graph_us(lambda: [F.linear(x, w) for w in ws]), "tiles": {}}
        for bn, bk in GEMV_TILES:
            diff = (fused.gemv(x, ws[0], block_n=bn, block_k=bk).float() - ref).abs().max().item()
            us = graph_us(lambda: [fused.gemv(x, w, block_n=bn, block_k=bk) for w in ws])
            row["tiles"][f"{bn}x{bk}"] = {"us": us, "diff": diff}
        rows.append(row)
        print(row, flush=True)
        del ws
    return rows


# fused.norm_gemv at the products that follow a norm at batch 1: (N, K, gated).
NORM_GEMV_SHAPES = {"moe qkv": (5120, 2048, False), "moe router": (128, 2048, False),
                    "8B qkv": (6144, 4096, False), "8B gate_up": (14336, 4096, True)}
NORM_GEMV_TILES = ((1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16))


def norm_gemv_rows(bandwidth, gen) -> list[dict]:
    """The residual add, RMSNorm and product of one token: `fused.rms_norm` then `fused.gemv`
    (two launches, as before the fusion) against `fused.norm_gemv` by (rows, warps)."""
    rows = []
    for shape_name, (n, k, gated) in NORM_GEMV_SHAPES.items():
        ws = [torch.randn(2 * n if gated else n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
              for _ in range(LAYERS)]
        x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        norm_w = 1 + torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=gen) / 4
        normed, _ = fused.rms_norm(x, norm_w, 1e-6, res)
        ref = F.linear(normed, ws[0])
        ref = fused.silu_and_mul(ref).float() if gated else ref.float()
        row = {"shape": shape_name, "n": n, "k": k, "gated": gated,
               "floor_us": ws[0].numel() * 2 / bandwidth * 1e6,
               "default_tiles": fused.norm_gemv_tiles(n, k, gated),
               "two_launches_us": graph_us(lambda: [fused.gemv(fused.rms_norm(x, norm_w, 1e-6, res)[0], w, gated)
                                                   for w in ws]),
               "tiles": {}}
        for tiles in NORM_GEMV_TILES:
            got = fused.norm_gemv(x, res, norm_w, 1e-6, ws[0], None, gated, tiles)
            diff = (got[0].float() - ref).abs().max().item()
            us = graph_us(lambda: [fused.norm_gemv(x, res, norm_w, 1e-6, w, None, gated, tiles) for w in ws])
            row["tiles"][f"{tiles[0]}r w{tiles[1]}"] = {"us": us, "diff": diff}
        rows.append(row)
        print(row, flush=True)
        del ws
    return rows


def route_group_rows(tokens_list, gen) -> list[dict]:
    """Routing and grouping at E = 128, k = 8: `route` then `_group_by_expert` (two launches,
    or three past one chunk) against `_route_and_group` (one program), where it applies."""
    experts, top_k, rows = 128, 8, []
    for tokens in tokens_list:
        logits = [torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(LAYERS)]
        block_m = _config(tokens, top_k, experts, torch.bfloat16)["BLOCK_M"]

        def two(lg):
            weights, ids = route(lg, top_k, True)
            return weights, ids, *_group_by_expert(ids, experts, block_m)

        row = {"tokens": tokens, "two_us": graph_us(lambda: [two(lg) for lg in logits])}
        if tokens * top_k <= 64:
            a, b = two(logits[0]), _route_and_group(logits[0], top_k, True, experts, block_m)
            used = int((a[3] < experts).sum()) * block_m
            row["same_layout"] = bool(torch.equal(a[1].reshape(-1), b[1]) and torch.equal(a[3], b[3])
                                      and torch.equal(a[2][:used], b[2][:used]))
            row["weights_diff"] = (a[0].reshape(-1) - b[0]).abs().max().item()
            row["one_us"] = graph_us(lambda: [_route_and_group(lg, top_k, True, experts, block_m) for lg in logits])
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sections", nargs="*", default=["moe", "gemv", "norm_gemv", "route_group"])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth("cuda")
    result = {"copy_bytes_per_s": bandwidth, "moe": [], "gemv": [], "norm_gemv": [], "route_group": []}
    if "moe" in args.sections:
        result["moe"] = moe_rows(args.tokens, bandwidth, gen)
    if "gemv" in args.sections:
        result["gemv"] = gemv_rows(bandwidth, gen)
    if "norm_gemv" in args.sections:
        result["norm_gemv"] = norm_gemv_rows(bandwidth, gen)
    if "route_group" in args.sections:
        result["route_group"] = route_group_rows(args.tokens, gen)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_moe_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"\nfused MoE per layer, us (copy bandwidth {bandwidth / 1e12:.2f} TB/s); tiles BLOCK_NxBLOCK_K, BLOCK_M 16")
    for r in result["moe"]:
        tiles = ", ".join(f"{name} {t['us']:.1f}" for name, t in r["tiles"].items())
        print(f"T={r['tokens']:<3} floor {r['floor_us']:.1f}  route torch {r['route_torch_us']:.1f} kernel "
              f"{r['route_kernel_us']:.1f}  grouped: {tiles}")
    print("\nbatch-1 products per layer, us: floor, cuBLAS, fused.gemv by BLOCK_NxBLOCK_K")
    for r in result["gemv"]:
        tiles = ", ".join(f"{name} {t['us']:.1f}" for name, t in r["tiles"].items())
        print(f"{r['shape']:<10} floor {r['floor_us']:.1f}  cuBLAS {r['cublas_us']:.1f}  {tiles}")
    print("\nnorm + one-token product per layer, us: floor, rms_norm + gemv, fused.norm_gemv by (rows, warps)")
    for r in result["norm_gemv"]:
        tiles = ", ".join(f"{name} {t['us']:.1f}" for name, t in r["tiles"].items())
        print(f"{r['shape']:<10} floor {r['floor_us']:.1f}  two launches {r['two_launches_us']:.1f}  "
              f"(default {r['default_tiles']})  {tiles}  max diff "
              f"{max(t['diff'] for t in r['tiles'].values()):.3g}")
    print("\nroute + grouping per layer, us: two kernels, one program (same layout, weights diff)")
    for r in result["route_group"]:
        print(f"T={r['tokens']:<3} {r['two_us']:.1f}  {r.get('one_us', float('nan')):.1f}  "
              f"({r.get('same_layout')}, {r.get('weights_diff')})")
    diffs = [t["diff"] for r in result["moe"] for t in r["tiles"].values()]
    if diffs:
        print("fused MoE max abs diff vs reference:", max(diffs), " router ids equal (ties aside):",
              [r["route_ids_equal"] for r in result["moe"]])


if __name__ == "__main__":
    main()
