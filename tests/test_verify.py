import math

import pytest
import torch

import tidal.speculative.verify as verify_module
from tidal.config import SamplingParams, SimulatedAcceptance
from tidal.layers.sampler import STREAM_SAMPLE, SamplingTensors, processed_probs, sample, sample_from_probs
from tidal.speculative.verify import verify
from stats import chi_square_pvalue

ALPHA = 1e-3  # significance level of every chi-square test below
N = 20_000    # rows (independent seeds) per statistical test


def greedy_st(n):
    return SamplingTensors.build([SamplingParams(temperature=0)] * n, list(range(n)), "cpu")


def one_hot_logits(argmaxes, V):
    """Logits [B, W, V] whose argmax at [i, j] is argmaxes[i][j]."""
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), V).float() * 5 + torch.randn(len(argmaxes), len(argmaxes[0]), V)


def test_greedy_by_hand():
    V = 10
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [7, 8, 9, 0], [5, 6, 7, 8]], V)
    drafts = torch.tensor([
        [1, 2, 3],  # all accepted -> bonus 4
        [9, 2, 3],  # first rejected -> correction 1
        [7, 8, 9],  # K = 0: drafts are padding -> plain decode 7
        [5, 9, 7],  # K = 2, second rejected -> 5 then correction 6
    ])
    lens = torch.tensor([3, 3, 0, 2])
    tokens, accept, _ = verify(logits, drafts, lens, greedy_st(4), torch.zeros(4, dtype=torch.int64))
    assert accept.tolist() == [4, 1, 1, 2]
    committed = [tokens[i, :a].tolist() for i, a in enumerate(accept.tolist())]
    assert committed == [[1, 2, 3, 4], [1], [7], [5, 6]]
    # padding past K_i is ignored even when it matches the target
    tokens, accept, _ = verify(logits[3:], torch.tensor([[5, 6, 7]]), torch.tensor([1]), greedy_st(1),
                            torch.zeros(1, dtype=torch.int64))
    assert accept.tolist() == [2] and tokens[0, :2].tolist() == [5, 6]


def test_greedy_rows_in_a_sampling_batch_match_greedy_path():
    torch.manual_seed(0)
    B, W, V = 6, 4, 8
    logits = torch.randn(B, W, V)
    drafts = logits[:, :3].argmax(-1)
    drafts[1, 0] = (drafts[1, 0] + 1) % V
    drafts[2, 2] = (drafts[2, 2] + 1) % V
    lens = torch.tensor([3, 3, 3, 2, 0, 1])
    counters = torch.zeros(B, dtype=torch.int64)
    expected, expected_accept, _ = verify(logits, drafts, lens, greedy_st(B), counters)
    params = [SamplingParams(temperature=0)] * (B - 1) + [SamplingParams(top_p=0.5)]
    mixed = SamplingTensors.build(params, list(range(B)), "cpu")
    tokens, accept, _ = verify(logits, drafts, lens, mixed, counters)
    assert torch.equal(accept[:-1], expected_accept[:-1])
    for i in range(B - 1):
        assert torch.equal(tokens[i, :accept[i]], expected[i, :accept[i]])


def test_no_drafts_is_plain_sampling():
    torch.manual_seed(1)
    B, V = 64, 30
    logits = torch.randn(B, 1, V)
    params = [SamplingParams(temperature=0.9, top_k=10), SamplingParams(min_p=0.1), SamplingParams(temperature=0)] * 21
    st = SamplingTensors.build(params + [SamplingParams()], list(range(B)), "cpu")
    counters = torch.arange(B) * 3
    tokens, accept, _ = verify(logits, torch.zeros(B, 0, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                            st, counters)
    assert tokens.shape == (B, 1) and (accept == 1).all()
    assert torch.equal(tokens[:, 0], sample(logits[:, 0], st, counters))


def test_accept_lens_stay_in_range():
    torch.manual_seed(2)
    B, W, V = 500, 5, 6
    logits = torch.randn(B, W, V)
    lens = torch.randint(0, W, (B,))
    drafts = torch.randint(0, V, (B, W - 1))
    for sim in (None, [[0.7] * (W - 1)] * B):
        st = SamplingTensors.build([SamplingParams(temperature=1.0)] * B, list(range(B)), "cpu", sim)
        _, accept, _ = verify(logits, drafts, lens, st, torch.zeros(B, dtype=torch.int64))
        assert ((accept >= 1) & (accept <= lens + 1)).all()


# --- sampling losslessness -------------------------------------------------------------
# The target is a Markov chain T[prev] over V = 5 tokens and the drafter a different chain
# Q[prev]. Committed tokens must follow T whatever the drafter does.

V = 5
T = torch.tensor([
    [0.40, 0.25, 0.15, 0.12, 0.08],
    [0.10, 0.20, 0.30, 0.25, 0.15],
    [0.30, 0.10, 0.10, 0.20, 0.30],
    [0.15, 0.35, 0.20, 0.10, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.20],
])
Q = torch.tensor([
    [0.05, 0.10, 0.15, 0.30, 0.40],
    [0.50, 0.10, 0.10, 0.20, 0.10],
    [0.10, 0.60, 0.10, 0.10, 0.10],
    [0.30, 0.05, 0.30, 0.30, 0.05],
    [0.70, 0.10, 0.10, 0.05, 0.05],
])
START = 0  # the last committed token


def spec_step(prev, seeds, counters, params, K=2, draft="coupled", simulate=None):
    """One speculative step after token `prev` [n]: draft K tokens from Q (raced against the
    target's own noise, as tidal's drafters do; or with noise of their own; or Q's argmax),
    score them with T, verify."""
    n = prev.shape[0]
    gen = torch.Generator().manual_seed(int(counters[0]) + 99)
    st = SamplingTensors.build(params, seeds, "cpu", None if simulate is None else [[simulate] * K] * n)
    inputs = [prev]
    for j in range(K):
        dist = Q[inputs[-1]]
        if draft == "coupled":
            inputs.append(sample_from_probs(dist, st.seeds, counters + j, STREAM_SAMPLE))
        elif draft == "independent":
            inputs.append(torch.multinomial(dist, 1, generator=gen).squeeze(1))
        else:
            inputs.append(dist.argmax(-1))
    logits = torch.log(T[torch.stack(inputs, 1)])  # [n, K + 1, V]
    return verify(logits, torch.stack(inputs[1:], 1), torch.full((n,), K), st, counters)[:2]


def first_two_tokens(params=None, **kwargs):
    """The first two committed tokens of N independent requests: from one step, or from a
    second step for requests whose first step committed only one token."""
    params = params or [SamplingParams(temperature=1.0)] * N
    seeds = list(range(N))
    prev = torch.full((N,), START)
    tokens, accept = spec_step(prev, seeds, torch.zeros(N, dtype=torch.int64), params, **kwargs)
    first = tokens[:, 0]
    more, _ = spec_step(first, seeds, torch.ones(N, dtype=torch.int64), params, **kwargs)
    second = torch.where(accept >= 2, tokens[:, 1], more[:, 0])
    return first, second


def joint_counts(first, second):
    return torch.bincount(first * V + second, minlength=V * V)


TARGET_JOINT = T[START].unsqueeze(1) * T  # P(first, second)


@pytest.mark.parametrize("draft", ["coupled", "independent", "argmax"])
def test_speculative_sampling_is_lossless(draft):
    first, second = first_two_tokens(draft=draft)
    assert chi_square_pvalue(torch.bincount(first, minlength=V), T[START]) > ALPHA
    assert chi_square_pvalue(joint_counts(first, second), TARGET_JOINT) > ALPHA


def test_coupled_drafts_are_accepted_more_often_than_independent_ones():
    """Racing the draft against the target's noise is what makes it accepted: more often
    than a draft with noise of its own, at most 1 - TV(p, q) (the best any rule can do)."""
    params, seeds, prev = [SamplingParams(temperature=1.0)] * N, list(range(N)), torch.full((N,), START)
    rates = {}
    for draft in ("coupled", "independent"):
        _, accept = spec_step(prev, seeds, torch.zeros(N, dtype=torch.int64), params, K=1, draft=draft)
        rates[draft] = (accept == 2).double().mean().item()
    best = torch.minimum(T[START], Q[START]).sum().item()
    assert rates["independent"] == pytest.approx((T[START] * Q[START]).sum().item(), abs=0.01)
    assert rates["independent"] + 0.05 < rates["coupled"] <= best + 0.01


def test_control_noise_that_ignores_the_position_is_detected(monkeypatch):
    """Every position drawing with the same noise correlates a step's tokens: the joint
    test must see it."""
    monkeypatch.setattr(verify_module, "sample", lambda logits, st, counters: sample(logits, st, counters * 0))
    first, second = first_two_tokens()
    assert chi_square_pvalue(joint_counts(first, second), TARGET_JOINT) < ALPHA


def test_control_always_accepting_is_detected():
    first, second = first_two_tokens(simulate=1.0)
    assert chi_square_pvalue(torch.bincount(first, minlength=V), T[START]) < ALPHA
    assert chi_square_pvalue(joint_counts(first, second), TARGET_JOINT) < ALPHA


def test_lossless_under_temperature_and_filters():
    """p is the processed target distribution, as `sample` would use."""
    params = SamplingParams(temperature=0.7, top_k=4, min_p=0.2)
    first, second = first_two_tokens(params=[params] * N)
    st1 = SamplingTensors.build([params], [0], "cpu")
    p = processed_probs(torch.log(T), st1.repeat_rows(V))  # [V, V]: processed row per previous token
    assert (p == 0).any()
    counts = joint_counts(first, second)
    expected = p[START].unsqueeze(1) * p
    assert (counts[expected.flatten() == 0] == 0).all()
    assert chi_square_pvalue(counts, expected) > ALPHA


def test_simulated_acceptance_length_and_tokens():
    K, rates = 4, [0.9, 0.75, 0.6, 0.45]  # decaying with depth, each conditional on the one before
    B = N
    logits = torch.randn(1, K + 1, 50).expand(B, K + 1, 50)
    drafts = torch.randint(0, 50, (B, K))
    st = SamplingTensors.build([SamplingParams(temperature=0)] * B, list(range(B)), "cpu", [rates] * B)
    tokens, accept, _ = verify(logits, drafts, torch.full((B,), K), st, torch.zeros(B, dtype=torch.int64))
    accepted = (accept - 1).double()
    expected = sum(math.prod(rates[:j]) for j in range(1, K + 1))
    assert abs(accepted.mean().item() - expected) < 4 * accepted.std().item() / B ** 0.5
    for i in range(100):
        a = accept[i].item()
        assert tokens[i, :a - 1].tolist() == drafts[i, :a - 1].tolist()
        assert tokens[i, a - 1].item() == logits[i, a - 1].argmax().item()
    # the rates also hold for sampling rows and ragged draft lengths
    lens = torch.randint(0, K + 1, (B,))
    st = SamplingTensors.build([SamplingParams()] * B, list(range(B)), "cpu", [rates] * B)
    _, accept, _ = verify(logits, drafts, lens, st, torch.zeros(B, dtype=torch.int64))
    expected = sum(sum(math.prod(rates[:j]) for j in range(1, k + 1)) for k in range(K + 1)) / (K + 1)
    assert abs((accept - 1).double().mean().item() - expected) < 0.03


def test_simulated_acceptance_per_request_spread():
    """{"mean": ..., "std": ...}: each request draws its own rate (a Beta of that mean and
    spread, the same for the same seed), later positions keeping their ratio to the first."""
    sim = SimulatedAcceptance.parse({"mean": [0.6, 0.3], "std": 0.25})
    drawn = [sim.rates(seed, 3) for seed in range(4000)]
    firsts = torch.tensor([r[0] for r in drawn], dtype=torch.float64)
    assert abs(firsts.mean().item() - 0.6) < 0.02 and abs(firsts.std().item() - 0.25) < 0.02
    assert (firsts > 0.9).any() and (firsts < 0.2).any()
    assert all(r[1] == r[2] == pytest.approx(r[0] / 2) for r in drawn)  # the last rate repeats
    assert sim.rates(7, 3) == sim.rates(7, 3)
    assert SimulatedAcceptance.parse(0.7).rates(1, 2) == [0.7, 0.7]
    for bad in ({"mean": 0.5, "std": 0.6}, [1.2], {"men": 0.5}, []):
        with pytest.raises(ValueError, match="simulate_acceptance"):
            SimulatedAcceptance.parse(bad)
