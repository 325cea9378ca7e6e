"""Fused MoE (grouped-GEMM Triton kernels) against its torch reference, and the reference
against Hugging Face's Qwen3MoeExperts, on the CPU through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1). Shapes are tiny and H, I are not multiples of
the block sizes, so masks and padding rows are exercised."""

import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tidal.layers.fused_moe import (_ONE_PROGRAM_PAIRS, _config, _group_by_expert, _route_and_group,  # noqa: E402
                                    fused_moe, route, routed_moe)
from tidal.layers.moe import experts_reference, route_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("bf16_rounds_to_nearest")


@pytest.fixture(autouse=True)
def bf16_dot_in_float32(monkeypatch):
    """The interpreter (triton 3.9) multiplies bf16 dot operands' raw uint16 bits: upcast
    them to float32, as the GPU's tensor cores effectively do."""
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched(self, a, b, d, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patched)


def make_moe(tokens, experts, top_k, hidden=48, inter=40, dtype=torch.float32, seed=0):
    """Random x, w13, w2 and a softmax-top-k routing of the tokens (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    probs = torch.randn(tokens, experts, generator=gen).softmax(-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, topk_weights, topk_ids


def close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = dict(atol=1e-4, rtol=1e-4) if expected.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k):
    args = make_moe(tokens, experts, top_k, dtype=dtype)
    close(fused_moe(*args), experts_reference(*args))


@pytest.mark.parametrize("tokens,experts", [(37, 2), (150, 2)])
def test_fused_moe_large_groups(tokens, experts):
    """Many rows per expert: the 64- and 128-row tiles."""
    args = make_moe(tokens, experts, 1)
    close(fused_moe(*args), experts_reference(*args))


def test_fused_moe_several_k_and_n_tiles():
    """H and I longer than one BLOCK_K strip and one BLOCK_N tile, with ragged ends; int32 ids."""
    x, w13, w2, topk_weights, topk_ids = make_moe(3, 8, 2, hidden=200, inter=136)
    close(fused_moe(x, w13, w2, topk_weights, topk_ids.to(torch.int32)),
          experts_reference(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("tokens", [3, 37])
def test_fused_moe_skewed_routing(tokens):
    """One expert takes every token's first slot, most experts get none."""
    x, w13, w2, topk_weights, _ = make_moe(tokens, 8, 2)
    topk_ids = torch.stack([torch.full((tokens,), 5), torch.arange(tokens) % 2], dim=1)
    close(fused_moe(x, w13, w2, topk_weights, topk_ids), experts_reference(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("tokens", [3, 37])
def test_fused_moe_one_expert_takes_all(tokens):
    x, w13, w2, topk_weights, _ = make_moe(tokens, 8, 1)
    topk_ids = torch.full((tokens, 1), 7)
    close(fused_moe(x, w13, w2, topk_weights, topk_ids), experts_reference(x, w13, w2, topk_weights, topk_ids))


def test_group_by_expert_layout():
    """Each expert's pairs sit in its own blocks, in pair order, padded with T*k; blocks past
    the last in use are marked with E."""
    topk_ids = torch.tensor([[2, 0], [2, 3], [2, 0]])  # pairs 0..5
    pair_ids, block_expert = _group_by_expert(topk_ids, num_experts=5, block_m=2)
    assert pair_ids.tolist() == [1, 5, 0, 2, 4, 6, 3, 6] + [6] * 4  # 6 blocks: the bound 6 + 5 * 1 rows
    assert block_expert.tolist() == [0, 2, 2, 3, 5, 5]


def test_group_by_expert_many_chunks():
    """Pairs spread over many counting programs (20 chunks) land where a stable sort by expert
    would put them."""
    gen = torch.Generator().manual_seed(0)
    experts, block_m = 6, 16
    topk_ids = torch.randint(0, experts - 1, (2500, 2), generator=gen)  # expert 5 idle
    pair_ids, block_expert = _group_by_expert(topk_ids, experts, block_m)
    flat = topk_ids.reshape(-1)
    expected, expected_experts = [], []
    for e in range(experts):
        group = torch.nonzero(flat == e).flatten().tolist()
        padded = -(-len(group) // block_m) * block_m
        expected += group + [flat.numel()] * (padded - len(group))
        expected_experts += [e] * (padded // block_m)
    padding = pair_ids.numel() - len(expected)
    assert pair_ids.tolist() == expected + [flat.numel()] * padding
    assert block_expert.tolist() == expected_experts + [experts] * (padding // block_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k", [(8, 1), (12, 4), (16, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_reference(dtype, experts, top_k, renormalize):
    """The router kernel picks the reference's experts in its order (E not a power of two
    too) with the same weights. The logits are distinct (quarters, exact in bf16): how
    torch.topk orders ties is unspecified."""
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.stack([torch.randperm(experts, generator=gen) for _ in range(37)]) / 4 - 1).to(dtype)
    weights, ids = route(logits, top_k, renormalize)
    expected_weights, expected_ids = route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


def test_route_ties_go_to_the_first_expert():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0]])
    weights, ids = route(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 2]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (5, 128, 8), (8, 128, 8), (3, 12, 4), (32, 8, 2),
                                                   (1, 4, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_and_group_in_one_program(tokens, experts, top_k, renormalize):
    """The one-program kernel picks `route_reference`'s experts and weights and lays the pairs
    out as `_group_by_expert` does, in every block in use (blocks past them it leaves): one
    token of Qwen3-30B-A3B's 128 experts, verification-sized steps, up to the most pairs it
    takes, E not a power of two, and every expert hit. Distinct logits (quarters, exact)."""
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) / 4 - 1
    logits[:, 0] = logits[0, 0]  # one expert picked often
    assert tokens * top_k <= _ONE_PROGRAM_PAIRS
    block_m = _config(tokens, top_k, experts, torch.float32)["BLOCK_M"]
    weights, ids, pair_ids, block_expert = _route_and_group(logits, top_k, renormalize, experts, block_m)
    expected_weights, expected_ids = route_reference(logits, top_k, renormalize)
    assert ids.tolist() == expected_ids.reshape(-1).tolist()
    torch.testing.assert_close(weights, expected_weights.reshape(-1), atol=1e-6, rtol=1e-6)
    want_pairs, want_blocks = _group_by_expert(expected_ids, experts, block_m)
    assert block_expert.tolist() == want_blocks.tolist()
    in_use = (want_blocks < experts).sum().item() * block_m
    assert pair_ids[:in_use].tolist() == want_pairs[:in_use].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_routed_moe_matches_reference(dtype, tokens):
    """The experts routed from the router's logits: one program routing and grouping (1 and
    5 tokens of k = 4), the route and grouping kernels (37)."""
    x, w13, w2, _, _ = make_moe(tokens, 12, 4, dtype=dtype)
    logits = torch.randn(tokens, 12, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    for renormalize in (False, True):
        weights, ids = route_reference(logits, 4, renormalize)
        close(routed_moe(x, logits, w13, w2, 4, renormalize), experts_reference(x, w13, w2, weights, ids))


def test_reference_matches_transformers():
    """The reference is Qwen3MoeExperts' computation, bit for bit, in float32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(config)
    x, w13, w2, topk_weights, topk_ids = make_moe(37, 8, 2)
    topk_ids[:, 0] = 5  # and a skewed routing, with idle experts
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        expected = experts(x, topk_ids, topk_weights)
    torch.testing.assert_close(experts_reference(x, w13, w2, topk_weights, topk_ids), expected, atol=0, rtol=0)
