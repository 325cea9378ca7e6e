"""Triton paged attention, run on the CPU through the Triton interpreter."""

import os
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: set before importing them

import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tidal.attention.triton_attn import (  # noqa: E402
    AttentionConfig, TritonAttention, choose_config, every_config, paged_attention, rotate_and_store,
)
from tidal.batch import ForwardBatch  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter_mode(monkeypatch):
    """Require the interpreter and work around its bf16 dot (triton 3.9 multiplies the raw
    uint16 bits): upcast bf16 operands to float32, as the GPU's tensor cores effectively do."""
    if not isinstance(tl.max, interpreter.InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (torch._dynamo "
                    "imports it): set it in the environment or at the top of tests/conftest.py")
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched(self, a, b, d, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))
        return create_dot(self, a, b, d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patched)


# (cached tokens, new tokens): a prefill, a chunked extend, a decode, a verify of 4 tokens
MIXED = [(0, 7), (37, 5), (50, 1), (20, 4)]


def make_case(seqs, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=0):
    """Random paged cache holding each request's prefix, shuffled non-contiguous pages, and
    q/k/v of the new tokens as strided views of one qkv tensor."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(ctx + n) // page_size) for ctx, n in seqs]
    num_pages = sum(pages_per_seq) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_tables = []
    for n in pages_per_seq:
        page_tables.append(perm[:n])
        perm = perm[n:]
    cache = torch.randn(2, num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    keys, values = [], []  # full logical K/V per request
    for (ctx, n), pages in zip(seqs, page_tables):
        kv = torch.randn(2, ctx + n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):
            cache[:, pages[pos // page_size], pos % page_size] = kv[:, pos]
        keys.append(kv[0])
        values.append(kv[1])
    batch = ForwardBatch.build([[1] * n for _, n in seqs], [ctx for ctx, _ in seqs],
                               page_tables, page_size, "cpu")
    qkv = torch.randn(batch.num_tokens, num_heads + 2 * num_kv_heads, head_dim,
                      generator=gen).to(dtype)
    q = qkv[:, :num_heads]
    k = torch.cat([kk[ctx:] for kk, (ctx, _) in zip(keys, seqs)])
    v = torch.cat([vv[ctx:] for vv, (ctx, _) in zip(values, seqs)])
    qkv[:, num_heads:num_heads + num_kv_heads] = k
    qkv[:, num_heads + num_kv_heads:] = v
    return q, qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:], \
        cache, batch, keys, values


def reference(q, keys, values, seqs, scale):
    """Per-request causal attention in float32 from the logical K/V."""
    group = q.shape[1] // keys[0].shape[1]
    out, start = [], 0
    for (ctx, n), kk, vv in zip(seqs, keys, values):
        qi = q[start:start + n].float()
        ki = kk.float().repeat_interleave(group, dim=1)
        vi = vv.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        visible = torch.arange(ctx + n)[None, :] <= ctx + torch.arange(n)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, vi))
        start += n
    return torch.cat(out)


def expected_cache(cache, k, v, slots):
    exp = cache.clone()
    flat = exp.view(2, -1, *exp.shape[3:])
    keep = slots >= 0
    flat[0, slots[keep]] = k[keep]
    flat[1, slots[keep]] = v[keep]
    return exp


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2, 64), (6, 2, 64), (4, 1, 128)])
def test_mixed_batch(heads, page_size, dtype):
    num_heads, num_kv_heads, head_dim = heads
    q, k, v, cache, batch, keys, values = make_case(
        MIXED, num_heads, num_kv_heads, head_dim, page_size, dtype)
    scale = head_dim ** -0.5
    want_cache = expected_cache(cache, k, v, batch.slot_mapping)
    out = TritonAttention().forward(q, k, v, cache, batch, scale)
    assert torch.equal(cache, want_cache)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(q, keys, values, MIXED, scale), **tol(dtype))


def test_float16():
    q, k, v, cache, batch, keys, values = make_case(MIXED, 4, 2, 64, 16, torch.float16, seed=7)
    out = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(q, keys, values, MIXED, 0.125),
                               atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_several_query_blocks(dtype):
    seqs = [(40, 150), (0, 3), (90, 1)]
    q, k, v, cache, batch, keys, values = make_case(seqs, 4, 2, 64, 16, dtype, seed=1)
    cfg = choose_config(batch, 4, 2, 64, dtype, q.device)
    assert batch.max_query_len > cfg.block_m // 2  # more than one query block per request
    out = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    torch.testing.assert_close(out.float(), reference(q, keys, values, seqs, 0.125), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_edges_at_key_block_boundaries(dtype):
    """Prefixes ending next to a key block edge (blocks of 32 or 64 keys)."""
    seqs = [(62, 3), (63, 1), (30, 2), (127, 5), (0, 40), (64, 1)]
    q, k, v, cache, batch, keys, values = make_case(seqs, 4, 2, 64, 16, dtype, seed=6)
    out = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    torch.testing.assert_close(out.float(), reference(q, keys, values, seqs, 0.125), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_split_kv_decode(page_size, dtype):
    seqs = [(700, 1), (300, 1), (5, 1), (1000, 1)]
    q, k, v, cache, batch, keys, values = make_case(seqs, 8, 2, 64, page_size, dtype, seed=2)
    cfg = choose_config(batch, 8, 2, 64, dtype, q.device)
    assert cfg.num_splits > 1
    out = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    torch.testing.assert_close(out.float(), reference(q, keys, values, seqs, 0.125), **tol(dtype))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_mixed_batch(num_splits):
    """Splits also serve prefill, extend and verify rows (some splits see no key)."""
    seqs = MIXED + [(130, 4)]
    q, k, v, cache, batch, keys, values = make_case(seqs, 4, 2, 64, 16, torch.float32, seed=3)
    rotate_and_store(q, k, v, cache, batch, None)
    cfg = AttentionConfig(block_m=16, block_n=32, num_splits=num_splits, num_warps=4, num_stages=2)
    out = paged_attention(q, cache, batch, 0.125, cfg)
    torch.testing.assert_close(out, reference(q, keys, values, seqs, 0.125), atol=1e-5, rtol=1e-5)


def test_store_skips_negative_slots():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 6, 16, 3, 64, generator=gen)
    q = torch.randn(5, 6, 64, generator=gen)
    k = torch.randn(5, 3, 64, generator=gen)
    v = torch.randn(5, 3, 64, generator=gen)
    slots = torch.tensor([17, -1, 95, 0, -1])
    batch = ForwardBatch(torch.zeros(5, dtype=torch.long), torch.arange(5), torch.tensor([0, 5], dtype=torch.int32),
                         torch.tensor([5], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                         torch.zeros(1, 6, dtype=torch.int32), slots, 5, 5)
    want = expected_cache(cache, k, v, slots)
    assert torch.equal(rotate_and_store(q, k, v, cache, batch, None), q)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_applied_as_the_module_applies_it(dtype, bf16_rounds_to_nearest):
    """With a rotary table, q comes back rotated and the cache holds the rotated keys, equal
    to RotaryEmbedding's own rotation (llama3 scaling, positions across pages)."""
    from tidal.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(64, 512, 10000.0, scaling)
    q, k, v, cache, batch, keys, values = make_case(MIXED, 4, 2, 64, 16, dtype, seed=8)
    q_ref, k_ref = rope(batch.positions, q, k)
    want_cache = expected_cache(cache, k_ref, v, batch.slot_mapping)
    q_out = rotate_and_store(q, k, v, cache, batch, rope.cos_sin)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(cache, want_cache)
    out = TritonAttention().forward(q, k, v, cache.clone(), batch, 0.125, rope)
    torch_ref = pytest.importorskip("tidal.attention.torch_ref")
    want = torch_ref.TorchAttention().forward(q, k, v, cache.clone(), batch, 0.125, rope)
    torch.testing.assert_close(out, want, **tol(dtype))


def test_rejects_bad_head_dim():
    q, k, v, cache, batch, _, _ = make_case([(3, 2)], 2, 1, 64, 16, torch.float32)
    bad_cache = torch.zeros(*cache.shape[:-1], 96)
    with pytest.raises(AssertionError, match="power-of-two head_dim"):
        paged_attention(torch.zeros(q.shape[0], 2, 96), bad_cache, batch, 0.1)


def test_matches_torch_reference_backend():
    torch_ref = pytest.importorskip("tidal.attention.torch_ref")
    seqs = MIXED + [(300, 1)]
    q, k, v, cache, batch, _, _ = make_case(seqs, 6, 2, 64, 16, torch.float32, seed=5)
    ref_cache = cache.clone()
    out = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    want = torch_ref.TorchAttention().forward(q, k, v, ref_cache, batch, 0.125)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, head_dim, dtype", [((32, 8), 128, torch.bfloat16), ((8, 8), 64, torch.float32),
                                                    ((16, 2), 256, torch.bfloat16), ((4, 1), 64, torch.float16)])
def test_every_config_holds_each_variant_a_step_can_pick(heads, head_dim, dtype):
    """Start-up builds the kernel variants of `every_config` (tile sizes, with or without
    split-KV); whatever batch a step brings, `choose_config` must pick one of them, or the
    step would build a kernel while a user waits (and each is one a step can pick)."""
    def variant(config):
        return config.block_m, config.block_n, config.num_warps, config.num_stages, config.num_splits > 1

    built = {variant(c) for c in every_config(*heads, head_dim, dtype)}
    picked = set()
    for num_seqs in (1, 2, 3, 7, 16, 64, 256):
        for query_len in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65, 300, 2048):
            for context in (0, 100, 700, 5000, 40000):
                batch = SimpleNamespace(num_seqs=num_seqs, max_query_len=query_len, max_seq_len=context + query_len)
                picked.add(variant(choose_config(batch, *heads, head_dim, dtype, torch.device("cpu"))))
    assert picked == built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_is_fused_as_the_modules_apply_it(dtype, bf16_rounds_to_nearest):
    """Qwen3's per-head q and k norms, fused with the rotation and the store, give the
    modules' results (norm, then rotate; float32 sums in another order), padding slots
    skipped."""
    from tidal.layers.norm import RMSNorm
    from tidal.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, 10000.0, None)
    q, k, v, cache, batch, keys, values = make_case(MIXED, 4, 2, 64, 16, dtype, seed=9)
    gen = torch.Generator().manual_seed(3)
    q_norm, k_norm = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.5 * torch.randn(64, generator=gen)).to(dtype)
    q_ref, k_ref = rope(batch.positions, q_norm(q), k_norm(k))
    want_cache = expected_cache(cache, k_ref, v, batch.slot_mapping)
    q_out = rotate_and_store(q, k, v, cache, batch, rope.cos_sin, (q_norm, k_norm))
    torch.testing.assert_close(q_out, q_ref, **tol(dtype))
    torch.testing.assert_close(cache, want_cache, **tol(dtype))
    out = TritonAttention().forward(q, k, v, cache.clone(), batch, 0.125, rope, qk_norm=(q_norm, k_norm))
    torch_ref = pytest.importorskip("tidal.attention.torch_ref")
    want = torch_ref.TorchAttention().forward(q, k, v, cache.clone(), batch, 0.125, rope, qk_norm=(q_norm, k_norm))
    torch.testing.assert_close(out, want, **tol(dtype))


def tree_masks(parents, start_bit=0):
    """Ancestor masks (bit j: query j, shifted by start_bit) of a root and nodes hanging
    from `parents` (query indices, each below its node's)."""
    masks = [1 << start_bit]
    for r, p in enumerate(parents):
        masks.append(masks[p] | (1 << (start_bit + r + 1)))
    return masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,page_size", [((4, 2, 64), 16), ((6, 2, 64), 32), ((4, 1, 128), 16)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_tree_masks_match_the_reference(heads, page_size, dtype, num_splits):
    """A batch of a tree (root + 9 nodes), a decode, a prefill of 70 tokens and a drafter's
    row of frontier nodes whose ancestors lie before its query tokens (tree_start 30 of a
    context of 41): Triton equals the torch reference, which applies the same masks."""
    from tidal.attention.torch_ref import TorchAttention

    num_heads, num_kv_heads, head_dim = heads
    seqs = [(37, 10), (50, 1), (0, 70), (38, 3)]
    q, k, v, cache, batch, _, _ = make_case(seqs, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=5)
    tree = tree_masks([0, 0, 1, 1, 2, 3, 3, 5, 0])
    drafter = [0b10110001001, 0b01001000011, 0b100000000110]  # bits over keys 30 .. 41
    batch.tree_mask = torch.tensor(tree + [-1] + [-1] * 70 + drafter)
    batch.tree_start = torch.tensor([37, 51, 70, 30], dtype=torch.int32)
    config = None
    if num_splits:
        auto = choose_config(batch, num_heads, num_kv_heads, head_dim, dtype, q.device)
        config = AttentionConfig(auto.block_m, auto.block_n, num_splits, auto.num_warps, auto.num_stages)
    want_cache = cache.clone()
    want = TorchAttention().forward(q, k, v, want_cache, batch, 0.125)
    got = TritonAttention().forward(q, k, v, cache, batch, 0.125) if config is None else \
        paged_attention(rotate_and_store(q, k, v, cache, batch, None), cache, batch, 0.125, config)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


def test_a_tree_node_sees_what_its_path_laid_out_causally_sees():
    """The reference's tree mask is causal attention over the node's path: a node's output
    equals that of the same keys laid out as a chain (context, then its ancestors)."""
    from tidal.attention.torch_ref import TorchAttention

    gen = torch.Generator().manual_seed(9)
    ctx, page_size, heads, dim = 21, 16, (4, 2), 64
    parents = [0, 0, 1, 2, 2, 4]  # node 6 hangs from 4, which hangs from 2, which hangs from the root
    n = 1 + len(parents)
    cache = torch.zeros(2, 8, page_size, heads[1], dim)
    q = torch.randn(n, heads[0], dim, generator=gen)
    k, v = torch.randn(n, heads[1], dim, generator=gen), torch.randn(n, heads[1], dim, generator=gen)
    context = torch.randn(2, ctx, heads[1], dim, generator=gen)
    flat = cache.view(2, -1, heads[1], dim)
    pages = [1, 2, 3]
    flat[:, [pages[p // page_size] * page_size + p % page_size for p in range(ctx)]] = context
    batch = ForwardBatch.build([[0] * n], [ctx], [pages], page_size, "cpu")
    batch.tree_mask, batch.tree_start = torch.tensor(tree_masks(parents)), torch.tensor([ctx], dtype=torch.int32)
    tree_out = TorchAttention().forward(q, k, v, cache.clone(), batch, 0.125)
    path = [0, 2, 4, 6]  # query indices from the root down to node 6
    chain = ForwardBatch.build([[0] * len(path)], [ctx], [pages], page_size, "cpu")
    chain_out = TorchAttention().forward(q[path], k[path], v[path], cache.clone(), chain, 0.125)
    torch.testing.assert_close(tree_out[path], chain_out)
