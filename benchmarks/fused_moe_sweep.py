"""The fused MoE kernels alone, at Qwen3-30B-A3B's shape (E = 128, k = 8, H = 2048, I = 768,
bf16), by tokens in the step: the experts as GEMVs (several tile shapes) against the grouped
GEMMs, and the router's torch ops against its one kernel. Each variant runs over 8 layers of
distinct weights in one CUDA graph, so the weights come from HBM as in a model's step, not
from L2; times are per layer. Against it, the floor: the distinct experts' bytes at the copy
bandwidth. Checks each path against the torch reference first. Prints a table; writes JSON
to $OUT/fused_moe_sweep.json.

    PYTHONPATH=. python benchmarks/fused_moe_sweep.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from tidal.layers.fused_moe import _experts_gemv, _experts_grouped, route
from tidal.layers.moe import experts_reference, route_reference

LAYERS = 8
GEMV_TILES = ((1, 512), (1, 256), (2, 256), (4, 256), (4, 128))  # (BLOCK_N, BLOCK_K)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    args = ap.parse_args()
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dtype, generator=gen) / hidden**0.5
           for _ in range(LAYERS)]
    w2 = [torch.randn(experts, hidden, inter, device=dev, dtype=dtype, generator=gen) / inter**0.5
          for _ in range(LAYERS)]
    src, dst = torch.empty(4 << 30, dtype=torch.uint8, device=dev), torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bandwidth = 2 * src.numel() * 5 / (start.elapsed_time(end) / 1e3)
    del src, dst
    expert_bytes = 3 * hidden * inter * 2
    rows = []
    for tokens in args.tokens:
        x = [torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=gen) for _ in range(LAYERS)]
        logits = [torch.randn(tokens, experts, device=dev, dtype=dtype, generator=gen) for _ in range(LAYERS)]
        routed = [route(lg, top_k, True) for lg in logits]
        ref_w, ref_ids = route_reference(logits[0], top_k, True)
        ref = experts_reference(x[0], w13[0], w2[0], *routed[0])
        row = {"tokens": tokens,
               "route_ids_equal": bool(torch.equal(routed[0][1].long(), ref_ids)),
               "route_weights_diff": (routed[0][0] - ref_w).abs().max().item(),
               "grouped_diff": (_experts_grouped(x[0], w13[0], w2[0], *routed[0]) - ref).abs().max().item(),
               "distinct_experts": sum(r[1].unique().numel() for r in routed) / LAYERS}
        row["floor_us"] = row["distinct_experts"] * expert_bytes / bandwidth * 1e6
        row["route_torch_us"] = graph_us(lambda: [route_reference(lg, top_k, True) for lg in logits])
        row["route_kernel_us"] = graph_us(lambda: [route(lg, top_k, True) for lg in logits])
        row["grouped_us"] = graph_us(lambda: [_experts_grouped(x[i], w13[i], w2[i], *routed[i]) for i in range(LAYERS)])
        for bn, bk in GEMV_TILES:
            name = f"gemv_{bn}x{bk}"
            row[name + "_diff"] = (_experts_gemv(x[0], w13[0], w2[0], *routed[0], block_n=bn, block_k=bk)
                                   - ref).abs().max().item()
            row[name + "_us"] = graph_us(lambda: [_experts_gemv(x[i], w13[i], w2[i], *routed[i], block_n=bn, block_k=bk)
                                                 for i in range(LAYERS)])
        rows.append(row)
        print(row, flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_moe_sweep.json").write_text(json.dumps({"copy_bytes_per_s": bandwidth, "rows": rows}, indent=1))
    names = ["grouped"] + [f"gemv_{bn}x{bk}" for bn, bk in GEMV_TILES]
    print(f"\nper layer, us (copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
    print(f"{'T':>3} {'floor':>6} {'route torch':>11} {'route kernel':>12} " + " ".join(f"{n:>12}" for n in names))
    for r in rows:
        print(f"{r['tokens']:>3} {r['floor_us']:>6.1f} {r['route_torch_us']:>11.1f} {r['route_kernel_us']:>12.1f} "
              + " ".join(f"{r[n + '_us']:>12.1f}" for n in names))
    print("max abs diff vs reference:", {n: max(r[n + "_diff"] for r in rows) for n in names},
          "route ids equal:", all(r["route_ids_equal"] for r in rows))


if __name__ == "__main__":
    main()
