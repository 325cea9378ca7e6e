"""Batched token sampling without host syncs.

Every random number is a pure function of (seed, counter, index, stream), computed by a
counter-based hash in vectorised int64 ops (on CUDA in Triton kernels: `fused.row_keys` for
the per-row numbers, and `fused.race_sample`, which hashes a draw's per-vocabulary-entry
numbers inside the kernel that runs the race). A seeded request therefore draws the same
numbers whatever batch it lands in, and no generator state has to be carried between steps.
`counter` is the index of the output token being produced; `stream` separates independent
uses at the same counter (sampling vs. acceptance tests; proposers pick their own streams).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Sequence

import torch

from tidal.batch import to_device
from tidal.config import SamplingParams

STREAM_SAMPLE = 0   # token sampling (plain decode, and the resample/bonus token of verification)
STREAM_ACCEPT = 1   # simulated acceptance's draws (benchmarks), apart from the tokens' own

# From this many rows on, CUDA finds the top-p threshold by `fused.top_p_threshold`'s search
# rather than a sort of the vocabulary: the two were even at 64 rows on an H200, the sort
# faster below, the search above (docs/design.md).
SEARCH_TOP_P_ROWS = 64

# Sampling a row takes several float32 copies of its logits (scaled, masked, softmax); rows
# are sampled this many logits at a time, so that a verification of many tokens needs about
# the memory of a plain step's sampling rather than K + 1 times it (the memory plan reserves
# the largest step's peak, which the KV cache then does without).
SAMPLE_CHUNK_ELEMENTS = 2**25

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (skeeto's hash-prospector `[16 21f0aaad 15 735a2d97 15]`).
    Inputs hold values < 2^32 in int64 and both constants are < 2^31, so no product
    reaches 2^63; masking keeps the arithmetic mod 2^32."""
    x = x ^ (x >> 16)  # works on Python ints too
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def stream_key(stream: int) -> int:
    """A stream's part of every key drawn in it."""
    return _mix32((stream & _MASK32) ^ 0x9E3779B9)


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per (seed, counter, stream); seeds and counters broadcast."""
    if seeds.is_cuda:
        from tidal.layers import fused

        return fused.row_keys(seeds, counters, stream_key(stream), unit=False)
    h = _mix32((seeds & _MASK32) ^ stream_key(stream))
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    return _mix32(h ^ (counters & _MASK32))


def _to_unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hash -> float32 uniform strictly inside (0, 1): the top 23 bits, centred,
    are exact in float32, so the result is never 0 or 1."""
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in (0, 1), one per element of broadcast(seeds, counters)."""
    if seeds.is_cuda:
        from tidal.layers import fused

        return fused.row_keys(seeds, counters, stream_key(stream), unit=True)
    return _to_unit(_row_keys(seeds, counters, stream))


def hash_uniform_vocab(seeds: torch.Tensor, counters: torch.Tensor, stream: int, vocab_size: int,
                       ids: torch.Tensor | None = None) -> torch.Tensor:
    """Uniforms [..., vocab_size] in (0, 1): one per (row, vocabulary index); with `ids`,
    only at those vocabulary indices ([..., len(ids)])."""
    return _vocab_uniform(_row_keys(seeds, counters, stream), vocab_size, ids)


def _vocab_uniform(keys: torch.Tensor, vocab_size: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    cols = _mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64) if ids is None else ids)
    return _to_unit(_mix32(keys.unsqueeze(-1) ^ cols))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host-side flags computed once at
    build time so that unused work is skipped without looking at device values."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor        # [N] int64, <= 0 = off
    top_p: torch.Tensor        # [N] float32, 1 = off
    min_p: torch.Tensor        # [N] float32, 0 = off
    seeds: torch.Tensor        # [N] int64
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int             # largest active top_k (0 if none), for torch.topk without a sync
    simulated: torch.Tensor | None = None  # [N, K] float32, benchmarks only: each draft position's
                                           # chance of acceptance whatever its value (SimulatedAcceptance)

    @staticmethod
    def build(params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str,
              simulated: Sequence[Sequence[float]] | None = None) -> "SamplingTensors":
        """`seeds[i]` is request i's seed (its own `params.seed`, or one the engine drew);
        `simulated[i]`, if given, its simulated acceptance rate per draft position."""
        if len(params) != len(seeds):
            raise ValueError(f"got {len(params)} sampling params but {len(seeds)} seeds")
        top_ks = [p.top_k if p.top_k > 0 and p.temperature > 0 else 0 for p in params]
        sampling = [p for p in params if p.temperature > 0]
        return SamplingTensors(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            top_k=to_device(top_ks, torch.int64, device),
            top_p=to_device([p.top_p if p.temperature > 0 else 1.0 for p in params], torch.float32, device),
            min_p=to_device([p.min_p for p in params], torch.float32, device),
            seeds=to_device([s & (2**63 - 1) for s in seeds], torch.int64, device),
            all_greedy=not sampling,
            any_greedy=len(sampling) < len(params),
            need_top_k=any(k > 0 for k in top_ks),
            need_top_p=any(p.top_p < 1 for p in sampling),
            need_min_p=any(p.min_p > 0 for p in sampling),
            max_top_k=max(top_ks, default=0),
            simulated=None if simulated is None else
            to_device([a for rates in simulated for a in rates], torch.float32, device).view(len(params), -1),
        )

    def _rows(self, select) -> "SamplingTensors":
        """The same parameters with `select` applied to every per-row tensor (the host flags
        stay the whole batch's: work they allow is skipped no more often, never wrongly)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return SamplingTensors(**{k: select(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    def sliced(self, start: int, stop: int) -> "SamplingTensors":
        """Rows start..stop-1."""
        return self._rows(lambda t: t[start:stop])

    def repeat_rows(self, counts: int | Sequence[int]) -> "SamplingTensors":
        """Expand to one row per logits row: request i repeated `counts` times (an int for
        all, or one count per request from the host). No device sync either way."""
        if isinstance(counts, int):
            def expand(t):
                return t.unsqueeze(1).expand(-1, counts, *t.shape[1:]).reshape(-1, *t.shape[1:])
        else:
            if len(counts) != self.seeds.shape[0]:
                raise ValueError(f"got {len(counts)} counts for {self.seeds.shape[0]} rows")
            index = to_device([i for i, n in enumerate(counts) for _ in range(n)], torch.int64, self.seeds.device)

            def expand(t):
                return t.index_select(0, index)
        return self._rows(expand)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution actually sampled from, [N, V] float32: logits / temperature, then
    top-k, top-p and min-p masking, then softmax. Greedy rows are one-hot at the argmax.

    Each filter is a per-row threshold on the scaled logits, so tokens tied with the last
    kept one are kept too (a deterministic rule, independent of sort order):
    top-k keeps values >= the k-th largest; top-p keeps the smallest prefix of the sorted
    top-k distribution whose mass reaches top_p; min-p keeps p >= min_p * p_max, i.e.
    logit >= max + log(min_p) (a ratio, so unaffected by the other filters).
    """
    logits = logits.float()
    if st.any_greedy:
        greedy_onehot = torch.zeros_like(logits).scatter_(1, greedy_tokens(logits).unsqueeze(1), 1.0)
        if st.all_greedy:
            return greedy_onehot
    greedy = st.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, st.temperature).unsqueeze(1)
    thresh = torch.full_like(scaled[:, 0], float("-inf"))
    if st.need_top_k:
        ordered = scaled.topk(min(st.max_top_k, scaled.shape[1]), dim=-1).values
        kth = ordered.gather(1, (st.top_k.clamp(1, ordered.shape[1]) - 1).unsqueeze(1)).squeeze(1)
        thresh = torch.where(st.top_k > 0, kth, thresh)
    if st.need_top_p:
        if scaled.is_cuda and scaled.shape[0] >= SEARCH_TOP_P_ROWS:
            from tidal.layers import fused

            last_kept = fused.top_p_threshold(scaled, thresh, st.top_p)
        else:
            last_kept = sorted_top_p(scaled, thresh, st.top_p)
        thresh = torch.where(st.top_p < 1, torch.maximum(thresh, last_kept), thresh)
    if st.need_min_p:
        thresh = torch.maximum(thresh, scaled.max(-1).values + torch.log(st.min_p))
    probs = torch.softmax(scaled.masked_fill(scaled < thresh.unsqueeze(1), float("-inf")), dim=-1)
    return torch.where(greedy.unsqueeze(1), greedy_onehot, probs) if st.any_greedy else probs


def sorted_top_p(scaled: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The last value the sorted cumulative mass of the values >= floor keeps, per row."""
    ordered = scaled.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered.masked_fill(ordered < floor.unsqueeze(1), float("-inf")), dim=-1)
    mass = probs.cumsum(-1)
    mass_before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1)  # monotone, unlike cumsum - p
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(-1, keepdim=True)
    return ordered.gather(1, num_kept - 1).squeeze(1)


def greedy_tokens(logits: torch.Tensor, lookup: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the last dim of logits [..., V] (on CUDA by `fused.argmax`, which splits
    a row over many programs where torch reduces it in one); with `lookup`, its entries
    there; written to `out` (contiguous, of the result's shape) if given."""
    if not logits.is_cuda:
        ids = logits.argmax(-1)
        ids = ids if lookup is None else lookup[ids]
        return ids if out is None else out.copy_(ids)
    from tidal.layers import fused

    flat = None if out is None else out.view(-1)
    return fused.argmax(logits.reshape(-1, logits.shape[-1]), flat, lookup).view(logits.shape[:-1])


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                      stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """Exact sample [N] int64 from unnormalised non-negative weights [N, V] by the
    exponential race argmax(p / E), E = -log(u): the same as Gumbel-max argmax(log p + g)
    with g = -log(E), but zero-weight tokens can never win and no log of p is needed."""
    keys = _row_keys(seeds, counters, stream)
    if probs.is_cuda:
        from tidal.layers import fused

        return fused.race_sample(probs, keys)
    return (probs / -torch.log(_vocab_uniform(keys, probs.shape[-1]))).argmax(-1)


def race_top_k(logits: torch.Tensor, k: int, temperature: torch.Tensor | None = None,
               seeds: torch.Tensor | None = None, counters: torch.Tensor | None = None,
               lookup: torch.Tensor | None = None, stream: int = STREAM_SAMPLE) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens of each row of logits [N, V] and their log-softmax scores, best
    first: scores log_softmax(logits) for a greedy row; for a row of temperature T > 0, of
    the Gumbel race logits / T + g, g = -log(-log(u)), u the uniform of the row's (seed,
    counter) at each token (the race `sample_from_probs` runs, so its first is that draw).
    temperature, seeds and counters [R] hold R requests' (None: every row greedy), each the
    N / R rows that follow; `lookup` maps indices to the token ids the noise and the result
    use. On CUDA one kernel (`fused.race_top_k`) where torch makes a dozen passes over [N, V]."""
    race = temperature is not None
    if logits.is_cuda:
        from tidal.layers import fused

        keys = _row_keys(seeds, counters, stream) if race else None
        values, index = fused.race_top_k(logits, k, temperature, keys, lookup)
    else:
        scores = torch.log_softmax(logits.float(), dim=-1)
        if race:
            group = logits.shape[0] // len(temperature)
            temperature = temperature.repeat_interleave(group)
            hot = temperature > 0
            noise = hash_uniform_vocab(seeds.repeat_interleave(group), counters.repeat_interleave(group), stream,
                                       logits.shape[-1], lookup)
            race_scores = logits.float() / torch.where(hot, temperature, 1.0)[:, None] - torch.log(-torch.log(noise))
            scores = torch.where(hot[:, None], torch.log_softmax(race_scores, dim=-1), scores)
        values, index = scores.topk(k, dim=-1)
    return values, index if lookup is None else lookup[index]


def row_chunks(logits: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of the row chunks of logits [N, V] that hold SAMPLE_CHUNK_ELEMENTS at most."""
    n, step = logits.shape[0], max(1, SAMPLE_CHUNK_ELEMENTS // logits.shape[-1])
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def sample(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor) -> torch.Tensor:
    """Next token per row [N] int64: argmax for greedy rows, else an exact sample from
    processed_probs. counters [N] int64: index of the output token being sampled. Rows are
    sampled `row_chunks` at a time (each row's draw is its own)."""
    if st.all_greedy:
        return greedy_tokens(logits)
    drawn = [sample_from_probs(processed_probs(logits[a:b], st.sliced(a, b)), st.seeds[a:b], counters[a:b],
                               STREAM_SAMPLE) for a, b in row_chunks(logits)]
    return drawn[0] if len(drawn) == 1 else torch.cat(drawn)


class Logprobs(NamedTuple):
    token_logprobs: torch.Tensor  # [N] float32, logprob of the given token
    top_ids: torch.Tensor         # [N, num_top] int64, most likely tokens, best first
    top_logprobs: torch.Tensor    # [N, num_top] float32


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> Logprobs:
    """Logprobs from the raw logits' log_softmax (before temperature and filters), which is
    what the OpenAI API and vLLM report; `row_chunks` at a time, as sampling goes."""
    parts = []
    for a, b in row_chunks(logits):
        logprobs = torch.log_softmax(logits[a:b].float(), dim=-1)
        parts.append((logprobs.gather(1, tokens[a:b].unsqueeze(1)).squeeze(1), *logprobs.topk(num_top, dim=-1)))
    chosen, top_logprobs, top_ids = (torch.cat(x) for x in zip(*parts))
    return Logprobs(chosen, top_ids, top_logprobs)
