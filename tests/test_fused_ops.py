"""Fused Triton RMSNorm / rotary / SiluAndMul against the torch modules, on the CPU through
the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch

pytest.importorskip("triton")

from tidal.layers import fused  # noqa: E402
from tidal.layers.activation import SiluAndMul  # noqa: E402
from tidal.layers.norm import RMSNorm  # noqa: E402
from tidal.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 37]


pytestmark = pytest.mark.usefixtures("bf16_rounds_to_nearest")


def close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [96, 1000])
def test_rms_norm(dtype, tokens, hidden):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, dtype=dtype)
    x = torch.randn(tokens, hidden, dtype=dtype)
    residual = torch.randn(tokens, hidden, dtype=dtype)
    close(fused.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, new_residual = fused.rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_residual = norm(x, residual)
    close(out, ref_out)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # the sum is exact
    assert torch.equal(residual, residual.clone()) and x.data_ptr() != out.data_ptr()


def test_rms_norm_float32_weight_bf16_input():
    """The output dtype follows torch's promotion (weight * normed)."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    close(fused.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_strided_heads(dtype, tokens):
    """q/k norm: per-head norm of a [T, H, D] view into a fused qkv output."""
    torch.manual_seed(0)
    heads, head_dim = 3, 48
    norm = RMSNorm(head_dim, 1e-6).to(dtype)
    norm.weight.data = torch.randn(head_dim, dtype=dtype)
    qkv = torch.randn(tokens, heads * head_dim + 2 * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert tokens == 1 or not q.is_contiguous()
    close(fused.rms_norm(q, norm.weight, norm.eps), norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotary_strided(dtype, tokens, head_dim):
    torch.manual_seed(0)
    hq, hk = 4, 2
    rope = RotaryEmbedding(head_dim, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 128})
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(tokens, hq, head_dim), k.view(tokens, hk, head_dim)
    positions = torch.randint(0, 512, (tokens,))
    before = qkv.clone()
    q_out, k_out = fused.rotary(positions, q, k, rope.cos_sin)
    q_ref, k_ref = rope(positions, q, k)
    close(q_out, q_ref)
    close(k_out, k_ref)
    assert torch.equal(qkv, before)  # inputs untouched


def test_rotary_contiguous_positions_view():
    """Contiguous q/k and a strided positions tensor."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 64, 500000.0)
    q, k = torch.randn(6, 2, 32), torch.randn(6, 1, 32)
    positions = torch.arange(12)[::2]
    q_out, k_out = fused.rotary(positions, q, k, rope.cos_sin)
    q_ref, k_ref = rope(positions, q, k)
    close(q_out, q_ref)
    close(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [96, 1500])
def test_silu_and_mul(dtype, tokens, inter):
    torch.manual_seed(0)
    x = torch.randn(tokens, 2 * inter, dtype=dtype) * 3
    close(fused.silu_and_mul(x), SiluAndMul()(x))


@pytest.mark.parametrize("simulate", [False, True])
@pytest.mark.parametrize("nodes", [5, 63])
def test_accept_tree_walks_as_the_torch_walk(simulate, nodes):
    """`fused.accept_tree` commits what `tree.accept_tree` commits (with `simulated_choice`'s
    children when simulating): random trees of up to 63 nodes (the mask's last bit), every
    length 0..N, a node its parent's target token often."""
    from tidal.speculative.tree import Tree, accept_tree, simulated_choice

    gen = torch.Generator().manual_seed(nodes)
    B, N, V = 48, nodes, 1000
    parents = torch.stack([torch.tensor([int(torch.randint(0, c + 1, (1,), generator=gen)) for c in range(N)])
                           for _ in range(B)])
    tree = Tree.of(parents)
    targets = torch.randint(0, V, (B, N + 1), generator=gen)
    drafts = torch.randint(V, 2 * V, (B, N), generator=gen)  # (never a target: siblings stay distinct)
    for i in range(B):
        for c in range(N):  # a node's first child is its target token at 0.7
            if c == int((parents[i] == parents[i, c]).nonzero()[0]) and torch.rand(1, generator=gen) < 0.7:
                drafts[i, c] = targets[i, parents[i, c]]
    lens = torch.randint(0, N + 1, (B,), generator=gen)
    u = simulated = chosen = None
    if simulate:
        u = torch.rand(B, N + 1, generator=gen)
        simulated = torch.cat([torch.rand(B, 3, generator=gen), torch.full((B, 1), 0.4)], 1)
        chosen = simulated_choice(parents, lens, tree.depth, simulated[:, :-1], simulated[:, -1:], u)
    want_tokens, want_accept, want_path = accept_tree(targets, drafts, tree, lens, chosen)
    tokens, accept, path = fused.accept_tree(targets, drafts, tree, lens, u, simulated)
    assert accept.tolist() == want_accept.tolist()
    assert max(accept) >= 3 and min(accept) == 1  # deep paths and none
    assert path.tolist() == want_path.tolist()
    assert [t[:n] for t, n in zip(tokens.tolist(), accept)] == [t[:n] for t, n in zip(want_tokens.tolist(), accept)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("hidden, n", [(128, 37), (300, 130)])
def test_gemv_is_the_product_and_swiglu(dtype, gated, hidden, n):
    """One token's product in one kernel, with the SwiGLU after it or not: the unfused
    modules' result, rounded the same way (an output count that leaves the last block of
    rows half full, a hidden size that is not a multiple of the block)."""
    torch.manual_seed(0)
    x = torch.randn(1, hidden, dtype=dtype)
    w = (torch.randn(2 * n if gated else n, hidden) / hidden ** 0.5).to(dtype)
    want = torch.nn.functional.linear(x, w)
    close(fused.gemv(x, w, gated=gated, block_k=64), SiluAndMul()(want) if gated else want)


@pytest.mark.parametrize("max_width, trees, tiles, whole", [(5, False, {8}, True), (17, False, {8, 16, 32}, False),
                                                           (17, True, {8}, False)])
def test_start_up_builds_the_acceptance_tile_of_every_chain_width(monkeypatch, max_width, trees, tiles, whole):
    """`accept_matching`'s tile follows the width (at least 8): start-up builds one for every
    width a chain step can verify, 2 .. max_width, or 2 alone in an engine that drafts trees
    (its chains are of one node), with and without simulated acceptance. (The first case
    builds the other variants too; the others, whose widths are all that differs, skip those
    that run 512 rows, slow in the interpreter.)"""
    built = set()
    if not whole:
        monkeypatch.setattr(fused, "build_argmax_variants", lambda *args: None)
        monkeypatch.setattr(fused, "race_sample", lambda *args: None)

    def record(best, drafts, lens, u=None):
        built.add((fused.matching_tile(best.shape[1]), u is None))

    monkeypatch.setattr(fused, "accept_matching", record)
    monkeypatch.setattr(fused, "accept_tree", lambda *args: None)
    fused.build_sampling_variants(64, max_width, torch.device("cpu"), trees)
    assert built == {(tile, plain) for tile in tiles for plain in (False, True)}


def test_empty_batches():
    w = torch.ones(16)
    assert fused.rms_norm(torch.empty(0, 16), w, 1e-6).shape == (0, 16)
    out, s = fused.rms_norm(torch.empty(0, 16), w, 1e-6, torch.empty(0, 16))
    assert out.shape == s.shape == (0, 16)
    assert fused.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    q, k = fused.rotary(torch.empty(0, dtype=torch.long), torch.empty(0, 2, 8), torch.empty(0, 1, 8),
                        torch.randn(4, 8))
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


def spread_over(monkeypatch, programs: int) -> None:
    """Set the programs `_first_best` spreads a batch's rows over (512): at 64, n / 8 rows
    split as n rows do at 512 (as many splits, of as many blocks, the same padding), with an
    eighth of the programs, each of which takes milliseconds in the interpreter."""
    monkeypatch.setattr(fused, "_BEST_PROGRAMS", programs)


@pytest.mark.parametrize("n, vocab, programs", [(9, 5, 512), (9, 3000, 512), (9, 70_000, 512), (17, 9000, 64)])
def test_race_sample_draws_what_the_torch_sampler_draws(n, vocab, programs, monkeypatch):
    """The one-pass sampling kernel computes the same uniforms and the same race as
    `sampler.sample_from_probs` (row-strided weights, zero weights, one block, several, and
    a vocabulary split over programs, with several blocks each and one split empty: 17
    rows over 64 programs, as 130 over 512)."""
    from tidal.layers import sampler

    spread_over(monkeypatch, programs)
    torch.manual_seed(0)
    weights = (torch.rand(n, vocab + 7) ** 4)[:, :vocab]
    weights[:, ::3] = 0.0
    seeds, counters = torch.arange(n) * 7919 + 2**40, torch.arange(n) + 3
    expected = sampler.sample_from_probs(weights, seeds, counters, sampler.STREAM_ACCEPT)
    keys = sampler._row_keys(seeds, counters, sampler.STREAM_ACCEPT)
    assert fused.race_sample(weights, keys).tolist() == expected.tolist()
    assert all(weights[i, t] > 0 for i, t in enumerate(expected.tolist()))


@pytest.mark.parametrize("k", [4, 3])
@pytest.mark.parametrize("lookup", [False, True])
def test_race_top_k_is_the_torch_race(k, lookup):
    """The one-pass top k (tree drafts' children) finds torch's: the same k tokens, best
    first, at the same log-softmax scores, for greedy rows and for rows racing at their
    temperature (two rows a request, a greedy one among them; three blocks of vocabulary,
    the last ragged; k not a power of two; a drafter's draft-to-target ids); tied scores
    go to the first index. Each racing row's first is what `sample_from_probs` draws."""
    from tidal.layers import sampler

    torch.manual_seed(0)
    vocab, requests, group = 2500, 5, 2
    logits = torch.randn(requests * group, vocab) * 3
    logits[2, 9] = logits[2, 2000] = 50.0  # a tie at the top, in two blocks
    ids = torch.randperm(40_000)[:vocab] if lookup else None
    temperature = torch.tensor([0.7, 0.0, 1.0, 1.5, 0.3])
    seeds, counters = torch.arange(requests) * 7919 + 2**40, torch.arange(requests) + 3
    for race in (False, True):
        args = (temperature, seeds, counters) if race else ()
        want_values, want_ids = sampler.race_top_k(logits, k, *args, lookup=ids)
        keys = sampler._row_keys(seeds, counters, sampler.STREAM_SAMPLE) if race else None
        values, index = fused.race_top_k(logits, k, temperature if race else None, keys, ids)
        assert index[2, :2].tolist() == [9, 2000]  # row 2 is greedy (request 1: temperature 0) when racing too
        index = index if ids is None else ids[index]  # (the kernel's indices are the logits')
        assert torch.equal(index.sort(1).values, want_ids.sort(1).values)
        assert torch.equal(index[:, 2:], want_ids[:, 2:])  # (the tie aside, in torch's order)
        torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    if not lookup:
        hot = temperature.repeat_interleave(group) > 0
        probs = torch.softmax(logits / temperature.clamp(min=0.01).repeat_interleave(group)[:, None], -1)
        drawn = sampler.sample_from_probs(probs, seeds.repeat_interleave(group), counters.repeat_interleave(group))
        assert torch.equal(want_ids[hot, 0], drawn[hot])


@pytest.mark.parametrize("unit", [False, True])
def test_row_keys_are_the_samplers(unit):
    """The one-kernel hash gives `sampler`'s keys and uniforms bit for bit: 63-bit seeds,
    counters past 2^32, every stream, one row per draw and a row broadcast over positions."""
    from tidal.layers import sampler

    seeds = torch.tensor([0, 1, 2**40 + 7, 2**63 - 1, 123456789])
    counters = torch.tensor([0, 5, 2**33 + 1, 17, 999])
    want = sampler.hash_uniform if unit else sampler._row_keys
    for stream in (sampler.STREAM_SAMPLE, sampler.STREAM_ACCEPT, 7):
        key = sampler.stream_key(stream)
        assert torch.equal(fused.row_keys(seeds, counters, key, unit), want(seeds, counters, stream))
        grid = counters.unsqueeze(1) + torch.arange(4)
        got = fused.row_keys(seeds.unsqueeze(1), grid, key, unit)
        assert got.shape == (5, 4) and torch.equal(got, want(seeds.unsqueeze(1), grid, stream))


@pytest.mark.parametrize("n, vocab, programs", [(1, 5, 512), (1, 70_000, 512), (3, 9000, 512), (15, 20_000, 64),
                                                (40, 2100, 64)])
def test_argmax_is_torchs_first_index_of_the_maximum(n, vocab, programs, monkeypatch):
    """The split argmax gives torch's argmax: ties (integer values, a row all equal, the
    maximum repeated across splits) go to the first index, -inf entries and a row of only
    -inf included, on row-strided input, with one split per row or many (fewer than the
    vocabulary's most, which set the padding). (15 and 40 rows over 64 programs split as
    120 and 300 rows do over 512.)"""
    spread_over(monkeypatch, programs)
    torch.manual_seed(0)
    x = (torch.randn(n, vocab + 3) * 2).round()[:, :vocab]
    x[0] = x[0].max()  # every index ties
    x[-1, vocab // 3::vocab // 3 + 1] = 100.0  # the maximum again in later splits
    if n > 2:
        x[1] = float("-inf")
        x[2, :vocab // 2] = float("-inf")
    assert fused.argmax(x).tolist() == x.argmax(-1).tolist()
    lookup, out = torch.randperm(vocab), torch.full((n,), -1, dtype=torch.int64)  # a drafter's draft -> target ids
    assert fused.argmax(x, out, lookup) is out and out.tolist() == lookup[x.argmax(-1)].tolist()


@pytest.mark.parametrize("vocab", [7, 3000])
def test_top_p_search_keeps_what_sorting_keeps(vocab):
    """The sort-free top-p search finds the threshold the sorted cumulative mass gives, per
    row: with and without a top-k floor below, a floor that keeps one value, a tiny and a
    near-1 top-p, 4 or 8 cuts per pass, tied values (integer logits), negative and zero
    values, row-strided input, one block or several; a row with top-p off gets -inf."""
    from tidal.layers import sampler

    torch.manual_seed(0)
    n = 16
    scaled = torch.randn(n, vocab + 5)[:, :vocab] * 4
    scaled[n // 2:] = scaled[n // 2:].round().clamp(-3, 3)  # many ties, zeros and negative values
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.tensor([0, 3, 20, 1, 0, vocab, 2, 0] * 2).clamp(max=vocab)
    floor = torch.where(k > 0, ordered.gather(1, (k.clamp(min=1) - 1).unsqueeze(1)).squeeze(1), float("-inf"))
    top_p = torch.tensor([0.9, 0.8, 0.5, 0.3, 1e-6, 0.999, 0.6, 0.95] * 2)
    expected = sampler.sorted_top_p(scaled, floor, top_p)
    assert fused.top_p_threshold(scaled, floor, top_p).tolist() == expected.tolist()
    assert fused.top_p_threshold(scaled, floor, top_p, group=4).tolist() == expected.tolist()
    assert expected[4] == scaled[4].max() and expected[3] == scaled[3].max()  # one value kept
    top_p[5] = 1.0
    assert fused.top_p_threshold(scaled, floor, top_p)[5] == float("-inf")


@pytest.mark.parametrize("simulate", [None, 0.6])
def test_accept_matching_commits_what_verify_commits(simulate):
    """`fused.accept_matching` takes what `verify`'s greedy rows take: drafts equal to the
    target's argmax (or, simulating, drawing under the rate) up to each row's draft length,
    then the argmax after them; rows of every length 0..K, on column-major drafts."""
    from dataclasses import replace

    from tidal.config import SamplingParams
    from tidal.layers.sampler import STREAM_ACCEPT, SamplingTensors, hash_uniform
    from tidal.speculative.verify import verify

    torch.manual_seed(0)
    B, K, V = 64, 4, 6
    logits = torch.randn(B, K + 1, V)
    best = logits.argmax(-1)
    tall = torch.zeros(K + 2, B, dtype=torch.int64)  # drafts by position, as a drafter keeps them
    tall[:K] = torch.where(torch.rand(B, K) < 0.8, best[:, :K], torch.randint(0, V, (B, K))).t()
    drafts = tall[:K].t()
    lens = torch.randint(0, K + 1, (B,))
    st = SamplingTensors.build([SamplingParams(temperature=0)] * B, list(range(B)), "cpu")
    counters = torch.arange(B) * 7
    if simulate is not None:
        st = replace(st, simulated=torch.full((B, K), simulate))
    want_tokens, want_accept, _ = verify(logits, drafts, lens, st, counters)
    u = None if simulate is None else hash_uniform(st.seeds.unsqueeze(1), counters.unsqueeze(1) + torch.arange(K),
                                                   STREAM_ACCEPT) / simulate
    tokens, accept = fused.accept_matching(best, drafts, lens, u)
    assert accept.tolist() == want_accept.tolist()
    assert len(set(accept.tolist())) >= 4  # short and long prefixes both occur
    assert [t[:n] for t, n in zip(tokens.tolist(), accept)] == [t[:n] for t, n in zip(want_tokens.tolist(), accept)]


# Every flag on each shape; the output count at which `norm_gemv_tiles` takes several rows a
# program (2,050: 513 or 1,025 programs, slow in the interpreter) once gated and once not:
# the kernel's several-row path meets every flag at the explicit tiles.
NORM_GEMV_CASES = [(hidden, n, tiles, with_residual, gated, dtype)
                   for hidden, n, tiles in [(128, 37, None), (1000, 130, None), (100, 45, (4, 4)), (64, 33, (2, 8))]
                   for with_residual in (False, True) for gated in (False, True) for dtype in DTYPES]
NORM_GEMV_CASES += [(96, 2050, None, True, True, torch.float32), (96, 2050, None, False, False, torch.bfloat16)]


@pytest.mark.parametrize("hidden, n, tiles, with_residual, gated, dtype", NORM_GEMV_CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_norm_gemv_is_the_add_the_norm_and_the_product(dtype, gated, with_residual, hidden, n, tiles):
    """One token's residual add, RMSNorm and product (with the SwiGLU or not) in one kernel:
    the unfused modules' stream (exactly), normed row and product, with a bias or not (Qwen2's
    q|k|v), a row a program and several (a last block of rows part full), a hidden size that
    is not a power of two; the inputs untouched."""
    from tidal.layers.linear import Linear, MergedColumnLinear, norm_product

    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = 1 + torch.randn(hidden, dtype=dtype) / 4
    layer = (MergedColumnLinear(hidden, [n, n]) if gated else Linear(hidden, n, bias=True)).to(dtype)
    layer.weight.data = (torch.randn(layer.weight.shape) / hidden ** 0.5).to(dtype)
    if layer.bias is not None:
        layer.bias.data = torch.randn(n, dtype=dtype)
    x = torch.randn(1, hidden, dtype=dtype)
    residual = torch.randn(1, hidden, dtype=dtype) if with_residual else None
    before = (x.clone(), None if residual is None else residual.clone())
    want = norm_product(norm, x, residual, layer, gated)  # on the CPU: the modules, unfused
    got = fused.norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias, gated, tiles)
    close(got[0], want[0])
    close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)
    assert got[2] is x if residual is None else got[2].data_ptr() not in (x.data_ptr(), residual.data_ptr())
    assert torch.equal(x, before[0]) and (residual is None or torch.equal(residual, before[1]))


def test_norm_gemv_tiles():
    """A router's 128 outputs keep a row a program; q|k|v's thousands take 4 rows (2 gated
    pairs), fewer where K is long, with warps for about 32 weights a thread."""
    assert fused.norm_gemv_tiles(128, 2048, False) == (1, 4)
    assert fused.norm_gemv_tiles(5120, 2048, False) == (4, 8)
    assert fused.norm_gemv_tiles(14336, 4096, True) == (2, 16)
    assert fused.norm_gemv_tiles(6144, 8192, False) == (2, 16)
    assert fused.norm_gemv_tiles(6144, 16384, True) == (1, 16)
