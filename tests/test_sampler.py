import pytest
import torch

from tidal.config import SamplingParams
from stats import chi_square_pvalue
from tidal.layers.sampler import (
    STREAM_SAMPLE,
    SamplingTensors,
    compute_logprobs,
    hash_uniform,
    hash_uniform_vocab,
    processed_probs,
    sample,
    sample_from_probs,
)

ALPHA = 1e-3  # significance level of every chi-square test below


def build(params, seeds=None):
    return SamplingTensors.build(params, seeds if seeds is not None else list(range(len(params))), "cpu")


def zeros(n):
    return torch.zeros(n, dtype=torch.int64)


def reference_probs(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straightforward one-row version of the filters, for comparison."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits_row.argmax(), logits_row.numel()).float()
    x = logits_row / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        keep &= x >= x.sort(descending=True).values[min(p.top_k, x.numel()) - 1]
    if p.top_p < 1:
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
        order = probs.argsort(descending=True)
        mass, n = 0.0, 0
        while mass < p.top_p:
            mass += probs[order[n]].item()
            n += 1
        keep &= x >= x[order[n - 1]]
    if p.min_p > 0:
        full = torch.softmax(x, -1)
        keep &= full >= p.min_p * full.max()
    return torch.softmax(x.masked_fill(~keep, float("-inf")), -1)


def test_hash_uniform_is_strictly_inside_unit_interval_and_uniform():
    u = hash_uniform_vocab(torch.arange(8), zeros(8), STREAM_SAMPLE, 50_000)
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi_square_pvalue(counts, torch.full((20,), 0.05)) > ALPHA
    # rows and streams look independent of each other
    assert torch.corrcoef(u).triu(1).abs().max() < 0.03
    a = hash_uniform(torch.arange(10_000), zeros(10_000), 0)
    b = hash_uniform(torch.arange(10_000), zeros(10_000), 1)
    assert torch.corrcoef(torch.stack([a, b]))[0, 1].abs() < 0.05
    assert (u == hash_uniform_vocab(torch.arange(8), zeros(8), STREAM_SAMPLE, 50_000)).all()


def test_greedy_is_argmax():
    logits = torch.randn(6, 100)
    st = build([SamplingParams(temperature=0)] * 6)
    assert torch.equal(sample(logits, st, zeros(6)), logits.argmax(-1))
    mixed = build([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5)] * 3)
    tokens = sample(logits, mixed, zeros(6))
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_same_seed_and_counter_give_same_token_in_any_batch():
    torch.manual_seed(0)
    V = 1000
    row = torch.randn(V)
    mine = SamplingParams(temperature=1.3, top_k=200, min_p=0.001)
    tokens = []
    for others in ([], [SamplingParams(temperature=0)], [SamplingParams(top_p=0.3), SamplingParams(top_k=5)] * 3):
        for position in range(len(others) + 1):
            params = others[:position] + [mine] + others[position:]
            seeds = [position * 100 + i for i in range(len(params))]
            seeds[position] = 1234
            logits = torch.randn(len(params), V)
            logits[position] = row
            counters = torch.arange(len(params)) * 7
            counters[position] = 42
            tokens.append(sample(logits, build(params, seeds), counters)[position].item())
    assert len(set(tokens)) == 1


def test_different_seeds_or_counters_differ():
    logits = torch.zeros(400, 1000)  # uniform: any token possible
    st = build([SamplingParams()] * 400)
    by_seed = sample(logits, st, zeros(400))
    assert by_seed.unique().numel() > 250
    same_seed = build([SamplingParams()] * 400, [7] * 400)
    by_counter = sample(logits, same_seed, torch.arange(400))
    assert by_counter.unique().numel() > 250


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=2.0, top_p=0.6),
    SamplingParams(temperature=0.5, min_p=0.2),
    SamplingParams(temperature=1.5, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0),
])
def test_processed_probs_matches_reference(params):
    torch.manual_seed(1)
    logits = torch.randn(4, 12) * 2
    # mixing in other rows forces every code path (sort, topk, min-p) for every row
    batch = [params, SamplingParams(top_k=2), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1)]
    got = processed_probs(logits, build(batch))
    for i, p in enumerate(batch):
        assert torch.allclose(got[i], reference_probs(logits[i], p), atol=1e-6), p
    alone = processed_probs(logits[:1], build([params]))
    assert torch.equal(alone[0], got[0])


def test_filtered_tokens_are_never_sampled():
    torch.manual_seed(2)
    V, N = 50, 4000
    logits = torch.randn(V).expand(N, V)
    for params in (SamplingParams(top_k=4), SamplingParams(top_p=0.3), SamplingParams(min_p=0.5)):
        st = build([params] * N)
        allowed = processed_probs(logits[:1], build([params]))[0] > 0
        assert 1 <= allowed.sum() < V
        tokens = sample(logits, st, zeros(N))
        assert allowed[tokens].all(), params
        assert allowed.sum() == tokens.unique().numel()


def test_sample_distribution_matches_processed_probs():
    torch.manual_seed(3)
    V, N = 10, 20_000
    logits = torch.randn(V).expand(N, V)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    st = build([params] * N)
    probs = processed_probs(logits[:1], build([params]))[0]
    counts = torch.bincount(sample(logits, st, torch.arange(N) % 13), minlength=V)
    assert (counts[probs == 0] == 0).all()
    assert chi_square_pvalue(counts, probs) > ALPHA
    # control: the unfiltered distribution is rejected by the same test
    assert chi_square_pvalue(counts, torch.softmax(logits[0], -1)) < ALPHA


def test_sample_from_probs_accepts_unnormalised_weights():
    N = 20_000
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 6.0]).expand(N, 5)
    tokens = sample_from_probs(weights, torch.arange(N), zeros(N), stream=5)
    counts = torch.bincount(tokens, minlength=5)
    assert counts[0] == 0 and counts[3] == 0
    assert chi_square_pvalue(counts, weights[0]) > ALPHA


def test_repeat_rows():
    st = build([SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0), SamplingParams(top_p=0.5)])
    uniform = st.repeat_rows(2)
    assert uniform.top_k.tolist() == [3, 3, 0, 0, 0, 0]
    assert uniform.seeds.tolist() == [0, 0, 1, 1, 2, 2]
    ragged = st.repeat_rows([1, 0, 3])
    assert ragged.temperature.tolist() == [0.5, 1.0, 1.0, 1.0]
    assert ragged.top_p.tolist() == [1.0, 0.5, 0.5, 0.5]
    assert (ragged.need_top_k, ragged.need_top_p, ragged.max_top_k) == (True, True, 3)
    with pytest.raises(ValueError):
        st.repeat_rows([1, 2])


def test_build_validates_and_sets_flags():
    st = build([SamplingParams(temperature=0, top_k=5, top_p=0.5), SamplingParams(min_p=0.1)])
    assert (st.all_greedy, st.any_greedy, st.need_top_k, st.need_top_p, st.need_min_p) == (False, True, False, False, True)
    big = SamplingTensors.build([SamplingParams()] * 2, [2**70 + 5, -1], "cpu")
    assert (big.seeds >= 0).all()
    with pytest.raises(ValueError):
        SamplingTensors.build([SamplingParams()], [], "cpu")


def test_compute_logprobs():
    logits = torch.randn(3, 20)
    tokens = torch.tensor([4, 0, 19])
    out = compute_logprobs(logits, tokens, num_top=2)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.token_logprobs, ref[torch.arange(3), tokens])
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    assert torch.allclose(out.top_logprobs, ref.topk(2, -1).values)
    assert compute_logprobs(logits, tokens, 0).top_ids.shape == (3, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only show on CUDA")
def test_no_host_sync_on_cuda():
    from tidal.speculative.verify import verify

    params = [SamplingParams(temperature=0), SamplingParams(top_k=5, top_p=0.9, min_p=0.01)]
    logits = torch.randn(2, 3, 100, device="cuda")
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    drafts = torch.randint(0, 100, (2, 2), device="cuda")
    lens = torch.tensor([2, 1], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = SamplingTensors.build(params, [1, 2], "cuda")
        st.repeat_rows([1, 2])
        sample(logits[:, 0], st, counters)
        compute_logprobs(logits[:, 0], counters, 3)
        verify(logits, drafts, lens, st, counters)
        verify(logits, drafts, lens, SamplingTensors.build(params, [1, 2], "cuda", [[0.5] * 2] * 2), counters)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_rows_sampled_in_chunks_draw_what_one_pass_draws(monkeypatch):
    """Sampling and logprobs go a few rows at a time (bounding a wide verification's memory);
    each row's draw and logprobs are its own, so the chunks change nothing."""
    from tidal.layers import sampler

    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(0.8, 0, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.2, 5, 1.0, 0.05), (0.5, 0, 1.0, 0.0)] * 3]
    logits, counters = torch.randn(len(params), 50), torch.arange(len(params)) * 7
    st = build(params, seeds=[11 * i for i in range(len(params))])
    whole, whole_lp = sample(logits, st, counters), compute_logprobs(logits, counters % 50, 3)
    monkeypatch.setattr(sampler, "SAMPLE_CHUNK_ELEMENTS", 5 * 50)  # chunks of 5, 5 and 2 rows
    assert sampler.row_chunks(logits) == [(0, 5), (5, 10), (10, 12)]
    assert torch.equal(sample(logits, st, counters), whole)
    assert all(torch.equal(a, b) for a, b in zip(compute_logprobs(logits, counters % 50, 3), whole_lp))
