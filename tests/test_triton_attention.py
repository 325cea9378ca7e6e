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


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_kv_mixed_batch(num_splits):
    """Splits also serve prefill, extend and verify rows (some splits see no key, and with
    16 most of a short request's splits start past its last key)."""
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


def random_tree(n, gen, roots=1):
    """Ancestor masks (bit j: node j; a node is its own ancestor) of a random forest of n
    nodes: nodes 0 .. roots - 1 roots, each later node under a random earlier one."""
    masks = [1 << i for i in range(roots)]
    for i in range(roots, n):
        masks.append(masks[int(torch.randint(i, (1,), generator=gen))] | 1 << i)
    return masks


# (cached tokens, new tokens): a tree (root + 9 nodes), a decode, a prefill, and the drafter's
# frontier nodes, a row of 3 and a row of 1, whose ancestors earlier forwards stored.
TREE_SEQS = [(37, 10), (50, 1), (0, 70), (75, 3), (66, 1)]


def tree_batch(batch, gen):
    """Give `batch` (of TREE_SEQS) its trees. The tree row's window starts at its root, its
    first query token. The decode sees all (mask -1, tree_start = seq_len), the prefill too
    through a window of 70 keys from 0 (mask -1: the bit is clamped to 63). The drafter's
    windows start before its query tokens, 16 and 9 keys from the ends: the keys of random
    forests whose last nodes are the query tokens (its depth-1 nodes come first, their root
    before the window), so some don't see the window's first key."""
    drafter, one = random_tree(16, gen, roots=3), random_tree(9, gen, roots=3)
    assert not all(m & 1 for m in drafter[-3:]) and not one[-1] & 1
    batch.tree_mask = torch.tensor(random_tree(10, gen) + [-1] + [-1] * 70 + drafter[-3:] + one[-1:])
    batch.tree_start = torch.tensor([37, 51, 0, 78 - 16, 67 - 9], dtype=torch.int32)


TREE_GEOMETRIES = [((4, 2, 64), 16), ((6, 2, 64), 32), ((4, 1, 128), 64)]


@pytest.mark.parametrize("heads, page_size, dtype, num_splits",
                         [(h, p, d, None) for h, p in TREE_GEOMETRIES for d in (torch.float32, torch.bfloat16)]
                         + [(h, p, d, 3) for (h, p), d in zip(TREE_GEOMETRIES, (torch.float32, torch.bfloat16,
                                                                                 torch.float32))],
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_tree_masks_match_the_reference(heads, page_size, dtype, num_splits):
    """Triton equals the torch reference on a batch of trees and rows without (TREE_SEQS),
    in one pass or 3 splits. The drafter's windows start inside the key blocks the unmasked
    loop would take (blocks of 32 and 64 keys), so a tree key leaking into it is seen.
    (Split, each geometry runs in one dtype, both dtypes among them: the split kernel's
    masking does not depend on the dtype, and the 3 splits take most of this test's time
    in the interpreter.)"""
    from tidal.attention.torch_ref import TorchAttention

    num_heads, num_kv_heads, head_dim = heads
    q, k, v, cache, batch, _, _ = make_case(TREE_SEQS, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=5)
    tree_batch(batch, torch.Generator().manual_seed(13))
    want = TorchAttention().forward(q, k, v, cache.clone(), batch, 0.125)
    if num_splits is None:
        got = TritonAttention().forward(q, k, v, cache, batch, 0.125)
    else:
        auto = choose_config(batch, num_heads, num_kv_heads, head_dim, dtype, q.device)
        config = AttentionConfig(auto.block_m, auto.block_n, num_splits, auto.num_warps, auto.num_stages)
        got = paged_attention(rotate_and_store(q, k, v, cache, batch, None), cache, batch, 0.125, config)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_sees_what_its_path_laid_out_causally_sees(dtype):
    """A tree mask is causal attention over the node's path: a node's output equals that of
    the same keys laid out as a chain (context, then its ancestors), in the torch reference
    and in Triton."""
    from tidal.attention.torch_ref import TorchAttention

    gen = torch.Generator().manual_seed(9)
    ctx, n = 21, 12
    q, k, v, cache, batch, _, _ = make_case([(ctx, n)], 4, 2, 64, 16, dtype, seed=9)
    masks = random_tree(n, gen)
    batch.tree_mask, batch.tree_start = torch.tensor(masks), torch.tensor([ctx], dtype=torch.int32)
    node = max(range(n), key=lambda i: masks[i].bit_count())  # a deepest node
    path = [i for i in range(n) if masks[node] >> i & 1]  # the root down to it
    assert len(path) > 2
    chain = ForwardBatch.build([[1] * len(path)], [ctx], [batch.page_table[0].tolist()], 16, "cpu")
    for backend in (TorchAttention(), TritonAttention()):
        tree_out = backend.forward(q, k, v, cache.clone(), batch, 0.125)
        chain_out = backend.forward(q[path], k[path], v[path], cache.clone(), chain, 0.125)
        torch.testing.assert_close(tree_out[path], chain_out, **tol(dtype))


def test_start_up_builds_the_tree_variants_too(monkeypatch):
    """The first forward of a geometry at start-up, without trees, runs every configuration
    once; in an engine that drafts trees, without and with them (it may meet no tree before
    it serves)."""
    import tidal.attention.triton_attn as triton_attn

    class OnDevice:  # q as _build_every_variant sees it on a GPU
        is_cuda, shape, dtype, device = True, (1, 8, 64), torch.bfloat16, torch.device("cpu")

        def __getitem__(self, index):
            return torch.zeros(1, 8, 64, dtype=torch.bfloat16)

    ran = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(triton_attn, "paged_attention",
                        lambda q, cache, batch, scale, config: ran.append((config, batch.tree_mask is not None)))
    configs = every_config(8, 2, 64, torch.bfloat16)
    for trees in (False, True):
        ran.clear()
        backend, cache = TritonAttention(), torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
        backend.trees = trees
        backend._build_every_variant(OnDevice(), cache)
        backend._build_every_variant(OnDevice(), cache)
        assert ran == [(config, tree) for tree in (False, True)[:1 + trees] for config in configs]
