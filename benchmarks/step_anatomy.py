"""Where a step's time goes, piece by piece, on one GPU (Llama-3.1-8B shapes, bf16).

    PYTHONPATH=.:benchmarks:tests python benchmarks/step_anatomy.py          # on the GPU machine
    PYTHONPATH=.:benchmarks:tests python benchmarks/step_anatomy.py --smoke  # tiny, on the CPU

Four questions, each answered side by side in one run:
- weights: the decoder's weight products at 1 and 5 query tokens (batch-1 decode and its
  verification at K = 4) through cuBLAS (`F.linear`) against Triton skinny-GEMM variants:
  outputs checked against float32, then 32 layers' worth (distinct weights, 14 GB) replayed
  from one CUDA graph per variant, so launch gaps and caches are as in a decode step;
- gemv: at one token, each decoder product through cuBLAS (gate/up followed by the SwiGLU
  kernel) against `fused.gemv` (gate/up and SwiGLU in one kernel) by block sizes, 32 layers
  from one graph, outputs checked against cuBLAS's;
- argmax: `fused.argmax` against torch's at 1, 5 and 256 rows of a 128k vocabulary;
- attention splits: batch-1 decode attention (store + attention + combine) at 300, 1,000
  and 4,000 keys with 1 to 32 key splits, 32 calls replayed from a graph;
- mixed steps: the host time to queue an eager forward of 64 decodes plus one 128-token
  prompt, against its GPU time, and the same for 64 decodes alone, eager and from the graph;
  the mixed forward from the piecewise graphs (checked equal to the eager one); then the
  host ops of one mixed eager forward under the profiler.
Prints a table last; writes $OUT/step_anatomy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_fastpath import LLAMA_8B, SMOKE, write_model_dir


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T for M <= BLOCK_M: program n streams BLOCK_N rows of w
    once; DOT on the tensor cores (x padded to BLOCK_M rows), else FMA (BLOCK_M = 1)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * swn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
    n_ok = rn[:, None] < N
    m_ok = rm[:, None] < M
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_ok, other=0.0)
            x = tl.load(x_ptrs + k0, mask=m_ok, other=0.0)
        else:
            k_ok = (k0 + rk)[None, :] < K
            w = tl.load(w_ptrs + k0, mask=n_ok & k_ok, other=0.0)
            x = tl.load(x_ptrs + k0, mask=m_ok & k_ok, other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc2 += w.to(tl.float32) * x.to(tl.float32)
    if DOT:
        out = acc
    else:
        out = tl.sum(acc2, axis=1)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok & (rn[None, :] < N))


def skinny(x, w, cfg):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages, dot = cfg
    _skinny_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                          BLOCK_M=16 if dot else 1, BLOCK_N=bn, BLOCK_K=bk, DOT=dot,
                                          EVEN_K=k % bk == 0,
                                          num_warps=warps, num_stages=stages)
    return y


# (BLOCK_N, BLOCK_K, warps, stages, DOT); FMA variants serve M = 1 only.
SKINNY = [(8, 512, 4, 4, False), (16, 256, 4, 4, False), (16, 512, 4, 3, False), (16, 512, 8, 4, False),
          (32, 256, 4, 4, False), (32, 256, 8, 4, False), (64, 128, 4, 4, False), (16, 1024, 8, 3, False),
          (32, 128, 4, 4, True), (64, 128, 4, 4, True), (32, 256, 4, 3, True), (64, 256, 8, 3, True),
          (16, 256, 4, 4, True), (128, 128, 8, 3, True)]


def variants(m):
    """cuBLAS and the skinny-GEMM configs that serve m query tokens, by label."""
    return {"cublas": None, **{str(c): c for c in SKINNY if c[4] or m == 1}}


def graph_ms(fn, reps=20):
    """Milliseconds per replay of fn captured in one CUDA graph (median of event timings)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def weights_section(shape, device, smoke):
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q_size = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    dims = {"qkv": (q_size + 2 * kv, h), "o": (h, q_size), "gate_up": (2 * inter, h), "down": (h, inter)}
    layers = shape["num_hidden_layers"]
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong (see the tests)
    torch.manual_seed(0)
    weights = [{name: torch.randn(n, k, device=device, dtype=dtype) * 0.02 for name, (n, k) in dims.items()}
               for _ in range(layers)]
    out = {"check": {}, "chain_ms": {}}
    for m in (1, 5):
        x = {name: torch.randn(m, k, device=device, dtype=dtype) for name, (_, k) in dims.items()}
        for label, cfg in variants(m).items():
            errs = []
            for name, w in weights[0].items():
                want = x[name].float() @ w.float().T
                got = F.linear(x[name], w) if cfg is None else skinny(x[name], w, cfg)
                errs.append(((got.float() - want).norm() / want.norm()).item())
            out["check"][f"m={m} {label}"] = max(errs)
            if smoke:
                continue

            def chain(cfg=cfg):
                for layer in weights:
                    for name, w in layer.items():
                        F.linear(x[name], w) if cfg is None else skinny(x[name], w, cfg)
            out["chain_ms"][f"m={m} {label}"] = graph_ms(chain)
            print(f"  weights m={m} {label}: err {out['check'][f'm={m} {label}']:.1e} "
                  f"{out['chain_ms'].get(f'm={m} {label}', float('nan')):.3f} ms", flush=True)
    per_name = {}
    if not smoke:  # each product alone, 32 layers of it, for the best variant per product
        for m in (1, 5):
            for name in dims:
                xs = torch.randn(m, dims[name][1], device=device, dtype=torch.bfloat16)
                for label, cfg in variants(m).items():
                    def one(cfg=cfg, name=name, xs=xs):
                        for layer in weights:
                            F.linear(xs, layer[name]) if cfg is None else skinny(xs, layer[name], cfg)
                    per_name[f"m={m} {name} {label}"] = graph_ms(one, reps=10) / layers * 1e3
    out["per_product_us"] = per_name
    del weights
    return out


GEMV_BLOCKS = ((1, 512), (1, 1024), (2, 512), (2, 1024), (4, 512), (4, 1024))


def gemv_section(shape, device, smoke):
    """One token, 32 layers from one graph: each decoder product through cuBLAS (the gate/up
    one followed by `fused.silu_and_mul`) against `fused.gemv` (gated for gate/up), by
    block sizes; outputs checked against cuBLAS's."""
    from tidal.layers import fused

    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q_size = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    out = {}
    if smoke:
        return out
    dtype = torch.bfloat16
    torch.manual_seed(0)
    for name, (n, k), gated in (("qkv", (q_size + 2 * kv, h), False), ("o", (h, q_size), False),
                                ("gate_up", (2 * inter, h), True), ("down", (h, inter), False)):
        x = torch.randn(1, k, device=device, dtype=dtype)
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]

        def cublas(w):
            y = F.linear(x, w)
            return fused.silu_and_mul(y) if gated else y
        want = cublas(weights[0]).float()
        out[f"{name} cublas ms"] = graph_ms(lambda: [cublas(w) for w in weights])
        for bn, bk in GEMV_BLOCKS:
            got = fused.gemv(x, weights[0], gated, bn, bk).float()
            out[f"{name} gemv {bn}x{bk} err"] = ((got - want).norm() / want.norm()).item()
            out[f"{name} gemv {bn}x{bk} ms"] = graph_ms(
                lambda bn=bn, bk=bk: [fused.gemv(x, w, gated, bn, bk) for w in weights])
        del weights
    return out


def argmax_section(vocab, device, smoke):
    from tidal.layers import fused

    out = {}
    for n in (1, 5, 256):
        x = torch.randn(n, vocab, device=device) * 3
        x[0, vocab // 2] = x[0].max()  # a tie with the first maximum
        same = torch.equal(fused.argmax(x), x.argmax(-1))
        row = {"equal": same}
        if not smoke:
            row["torch_us"] = graph_ms(lambda: x.argmax(-1)) * 1e3
            row["fused_us"] = graph_ms(lambda: fused.argmax(x)) * 1e3
        out[n] = row
    return out


def splits_section(shape, device, smoke):
    from tidal.attention.triton_attn import AttentionConfig, choose_config, paged_attention, rotate_and_store
    from tidal.batch import ForwardBatch

    heads, kv_heads, d, ps = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"], 16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {}
    for ctx in ((40,) if smoke else (300, 1000, 4000)):
        pages = -(-(ctx + 1) // ps)
        cache = torch.randn(2, pages + 1, ps, kv_heads, d, device=device, dtype=dtype)
        batch = ForwardBatch.build([[0]], [ctx], [list(range(1, pages + 1))], ps, device)
        batch.max_seq_len = 2048 if not smoke else 64  # as in a graph captured for max_model_len
        q = torch.randn(1, heads, d, device=device, dtype=dtype)
        k = torch.randn(1, kv_heads, d, device=device, dtype=dtype)
        v = torch.randn(1, kv_heads, d, device=device, dtype=dtype)
        rotate_and_store(q, k, v, cache, batch, None)  # the timed calls store it too: compare like with like
        base = choose_config(batch, heads, kv_heads, d, dtype, torch.device(device))
        want = paged_attention(q, cache, batch, d ** -0.5, AttentionConfig(base.block_m, base.block_n, 1,
                                                                           base.num_warps, base.num_stages))
        row = {"default_splits": base.num_splits}
        for splits in (1, 2, 3) if smoke else (1, 2, 4, 8, 16, 32):  # (smoke: fewer programs in the interpreter)
            cfg = AttentionConfig(base.block_m, base.block_n, splits, base.num_warps, base.num_stages)
            got = paged_attention(q, cache, batch, d ** -0.5, cfg)
            row[f"err_{splits}"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
            if not smoke:
                def layers(cfg=cfg):
                    for _ in range(32):
                        qr = rotate_and_store(q, k, v, cache, batch, None)
                        paged_attention(qr, cache, batch, d ** -0.5, cfg)
                row[f"us_{splits}"] = graph_ms(layers) / 32 * 1e3
        out[ctx] = row
    return out


def mixed_section(model_dir, device, smoke):
    """Host enqueue time and GPU time of eager forwards, against a graph replay."""
    from torch.profiler import ProfilerActivity, profile

    from tidal import LLM
    from tidal.batch import ForwardBatch

    llm = LLM(model=str(model_dir), device=device, load_format="dummy", max_model_len=1024, max_num_seqs=64,
              num_pages=64 * 24 + 64, dtype="bfloat16" if device == "cuda" else "float32")
    runner = llm.engine.core.runner
    ps = runner.page_size
    decodes, ctx, prompt = (4, 20, 16) if smoke else (64, 200, 128)
    per_row = -(-(ctx + 1) // ps)
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(decodes)]
    prompt_table = list(range(1 + decodes * per_row, 1 + decodes * per_row + -(-prompt // ps)))

    def build(with_prompt):
        feeds = [[5] for _ in range(decodes)] + ([[7] * prompt] if with_prompt else [])
        contexts = [ctx] * decodes + ([0] if with_prompt else [])
        return ForwardBatch.build(feeds, contexts, tables + ([prompt_table] if with_prompt else []), ps, device)

    def timed(fn, reps=10):
        host, wall = [], []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if device == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
        return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall)}

    out = {}
    with torch.inference_mode():
        for label, with_prompt in (("mixed eager", True), ("decodes eager", False)):
            batch = build(with_prompt)

            def forward(batch=batch):
                runner.model(batch.input_ids, batch, runner.kv_caches)
            forward()
            out[label] = timed(forward)
            if device == "cuda":  # the same forward's GPU time alone, from a graph of it
                out[label]["gpu_ms"] = graph_ms(forward, reps=5)
        if runner.pieces is not None:
            feeds = [[5] for _ in range(decodes)] + [[7] * prompt]
            bucket = runner.pieces.bucket(decodes + prompt)
            padded = ForwardBatch.build(feeds, [ctx] * decodes + [0], tables + [prompt_table], ps, device,
                                        pad_tokens=bucket)
            eager = runner.model(padded.input_ids, padded, runner.kv_caches)[:decodes + prompt]
            pieces = runner.pieces.run(padded, decodes + prompt)
            out["mixed piecewise == eager"] = bool(torch.equal(eager, pieces))
            out["mixed piecewise"] = timed(lambda: runner.pieces.run(padded, decodes + prompt))
        if runner.graphs is not None:
            feeds = [[5] for _ in range(decodes)]

            def replay():
                runner.graphs.run(feeds, [ctx] * decodes, tables, 1)
            replay()
            out["decodes graph (load + replay)"] = timed(replay)
        batch = build(True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.model(batch.input_ids, batch, runner.kv_caches)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        out["mixed eager host ops (self ms, calls)"] = {e.key[:70]: (e.self_cpu_time_total / 1e3, e.count)
                                                        for e in ops}
    del llm
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", nargs="*", help="run these sections only (argmax, splits, gemv, weights, mixed)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE if args.smoke else LLAMA_8B
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "triton": triton.__version__}
    sections = {"argmax": lambda: argmax_section(shape["vocab_size"], device, args.smoke),
                "splits": lambda: splits_section(shape, device, args.smoke),
                "gemv": lambda: gemv_section(shape, device, args.smoke),
                "weights": lambda: weights_section(shape, device, args.smoke)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), shape)
        sections["mixed"] = lambda: mixed_section(model_dir, device, args.smoke)
        for name, fn in sections.items():
            if args.only and name not in args.only:
                continue
            t = time.perf_counter()
            results[name] = fn()
            print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    (out_dir / "step_anatomy.json").write_text(json.dumps(results, indent=1, default=str))

    if "argmax" in results:
        print("\nargmax (equal, torch us, fused us):")
        for n, row in results["argmax"].items():
            print(f"  {n:>4} rows  {row['equal']}  {row.get('torch_us', float('nan')):7.1f}  "
                  f"{row.get('fused_us', float('nan')):7.1f}")
    if "splits" in results:
        print("attention, batch-1 decode, us per layer by key splits (default from max_model_len 2048):")
        for ctx, row in results["splits"].items():
            print(f"  ctx {ctx:>5} (default {row['default_splits']}): " + "  ".join(
                f"{s}: {row.get(f'us_{s}', float('nan')):.2f}" for s in (1, 2, 4, 8, 16, 32)))
    if "gemv" in results:
        print("one token, 32 layers from one graph: cuBLAS (+ SwiGLU) against fused.gemv (ms, err):")
        for label, value in results["gemv"].items():
            print(f"  {label:<40} {value:.3g}")
    if "weights" in results:
        w = results["weights"]
        print("weight products, 32 layers from one graph (ms), worst relative error:")
        for label, ms in sorted(w["chain_ms"].items(), key=lambda kv: kv[1]):
            print(f"  {label:<40} {ms:7.3f}  {w['check'][label]:.1e}")
    if "mixed" in results:
        print("mixed steps (ms; piecewise = graphs around eager attention):")
        for label, row in results["mixed"].items():
            print(f"  {label:<40} {row}")

if __name__ == "__main__":
    main()
