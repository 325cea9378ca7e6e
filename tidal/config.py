"""User-facing configuration: frozen, validated dataclasses. A bad value is a ValueError
that names the field."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEC_METHODS = ("ngram", "draft_model", "eagle3")
SPEC_POLICIES = ("off", "fixed", "table", "goodput")
COST_MODELS = ("profile", "online")
MAX_SPECULATIVE_TOKENS = 16
MAX_DRAFT_TOKENS = 63  # a tree's nodes and its root fit one 64-bit attention mask


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each request's tokens. Names and defaults follow vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1           # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None   # per-request seed: same seed, same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled one)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def parse_table(table, max_k: int) -> tuple[tuple[int, int], ...]:
    """{batch size: K} (JSON keys may be strings) or (batch size, K) pairs, sorted by batch size."""
    pairs = list(table.items()) if isinstance(table, dict) else list(table or ())
    if not pairs:
        raise ValueError("speculative_config.table: policy 'table' needs a non-empty {batch size: K} table")
    out = {}
    for entry in pairs:
        try:
            b, k = entry
            b = int(b) if isinstance(b, str) and b.strip().isdigit() else b
        except (TypeError, ValueError):
            raise ValueError(f"speculative_config.table: bad entry {entry!r}; want batch size: K") from None
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"speculative_config.table: batch size {b!r} must be an integer >= 1")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= max_k:
            raise ValueError(f"speculative_config.table: K {k!r} for batch size {b} must be an integer in [0, {max_k}]")
        if b in out:
            raise ValueError(f"speculative_config.table: batch size {b} appears twice")
        out[b] = k
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SimulatedAcceptance:
    """Benchmarks only: a draft at position m is accepted with probability rate[m] whatever
    its value, so that speed can be measured with random weights (outputs are then not the
    target's). `mean` gives the rate per draft position (its last entry repeats); with `std`
    > 0 each request draws its own rate at position 1 from a Beta distribution of that mean
    and standard deviation (from its seed: the same request draws the same), and its later
    positions keep their ratio to position 1. For trees of drafts, a node's best child is
    taken with its depth's rate, and its r-th best with that rate times `sibling`^r (0: only
    the best child is ever the target's token). Given as a number, a list per position, or
    {"mean": number or list, "std": s, "sibling": f}."""

    mean: tuple[float, ...]
    std: float = 0.0
    sibling: float = 0.0

    @staticmethod
    def parse(value, field: str = "speculative_config.simulate_acceptance") -> "SimulatedAcceptance | None":
        if value is None or isinstance(value, SimulatedAcceptance):
            return value
        spec = value if isinstance(value, dict) else {"mean": value}
        if set(spec) - {"mean", "std", "sibling"} or "mean" not in spec:
            raise ValueError(f"{field}: want a number, a list per draft position or "
                             f"{{'mean': ..., 'std': ..., 'sibling': ...}}, got {value!r}")
        mean = spec["mean"] if isinstance(spec["mean"], (list, tuple)) else [spec["mean"]]
        std = spec.get("std", 0.0)
        if not mean or not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in mean):
            raise ValueError(f"{field}: acceptance rates must be numbers in [0, 1], got {spec['mean']!r}")
        first = mean[0]
        if not isinstance(std, (int, float)) or std < 0 or (std > 0 and not std ** 2 < first * (1 - first)):
            raise ValueError(f"{field}.std must be >= 0 and, with a mean of {first} at position 1, below "
                             f"{(first * (1 - first)) ** 0.5:.3f} (a Beta distribution's largest), got {std!r}")
        sibling = spec.get("sibling", 0.0)
        if not isinstance(sibling, (int, float)) or not 0 <= sibling < 1:
            raise ValueError(f"{field}.sibling must be in [0, 1), got {sibling!r}")
        return SimulatedAcceptance(tuple(float(a) for a in mean), float(std), float(sibling))

    def rates(self, seed: int, k: int) -> list[float]:
        """A request's acceptance rate per draft position 1 .. k."""
        mean = [self.mean[min(m, len(self.mean) - 1)] for m in range(k)]
        if self.std == 0:
            return mean
        first = mean[0]
        strength = first * (1 - first) / self.std ** 2 - 1  # alpha + beta
        drawn = random.Random(seed).betavariate(first * strength, (1 - first) * strength)
        return [min(1.0, a * drawn / first) for a in mean]

    def check_tree(self, topk: int, field: str) -> None:
        """A node's `topk` children must be the target's token with a total chance of at most 1."""
        if max(self.mean) * sum(self.sibling ** r for r in range(topk)) > 1:
            raise ValueError(f"{field}: a node's {topk} children would be the target's token with a total chance "
                             f"above 1 (rate {max(self.mean):g}, sibling {self.sibling:g})")

    def describe(self) -> str:
        rates = "/".join(f"{a:g}" for a in self.mean)
        return (rates + (f" (per request: Beta, std {self.std:g})" if self.std else "")
                + (f", each further child x{self.sibling:g}" if self.sibling else ""))


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, with vLLM's key names. `policy` decides each request's draft
    length per step; `num_speculative_tokens` is the most it may choose. With `topk` > 1
    the drafter grows a tree (each draft step expands the best `topk` nodes by their `topk`
    likeliest tokens, `num_speculative_tokens` steps deep) and a request verifies its best
    nodes, at most `num_draft_tokens` (the policy's K counts nodes then)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    policy: str = "goodput"
    table: dict | tuple | None = None    # policy "table": {batch size: K}; the largest batch size <= B applies
    cost_model: str = "profile"          # policy "goodput": "profile" (measure at start-up, correct online) or "online"
    profile_seconds: float = 3.0         # start-up profiling budget; shapes not reached are extrapolated
    decision_log: str | None = None      # append one JSON line per step here (goodput: with its decision)
    prompt_lookup_min: int = 2           # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    simulate_acceptance: SimulatedAcceptance | None = None  # benchmarks only (SimulatedAcceptance)
    topk: int = 1                        # tokens per expanded node of a draft tree (1: a chain)
    num_draft_tokens: int | None = None  # nodes a request verifies at most (None: num_speculative_tokens)

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: unknown method {self.method!r}; expected one of {SPEC_METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model: method {self.method!r} needs a drafter directory")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative_config.policy: unknown policy {self.policy!r}; expected one of {SPEC_POLICIES}")
        if self.policy == "table" or self.table is not None:
            if self.policy != "table":
                raise ValueError(f"speculative_config.table is only used by policy 'table', not {self.policy!r}")
            object.__setattr__(self, "table", parse_table(self.table, self.num_draft_tokens or k))
        if self.cost_model not in COST_MODELS:
            raise ValueError(
                f"speculative_config.cost_model: unknown {self.cost_model!r}; expected one of {COST_MODELS}")
        if not isinstance(self.profile_seconds, (int, float)) or self.profile_seconds <= 0:
            raise ValueError(f"speculative_config.profile_seconds must be > 0, got {self.profile_seconds!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        object.__setattr__(self, "simulate_acceptance", SimulatedAcceptance.parse(self.simulate_acceptance))
        self._check_tree()

    def _check_tree(self) -> None:
        topk, n, k = self.topk, self.num_draft_tokens, self.num_speculative_tokens
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"speculative_config.topk must be an integer >= 1, got {topk!r}")
        if n is None:
            object.__setattr__(self, "num_draft_tokens", k)
            n = k
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative_config.num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {n!r}")
        if topk == 1 and n != k:
            raise ValueError(f"speculative_config.num_draft_tokens: a chain (topk 1) verifies its "
                             f"num_speculative_tokens = {k} drafts, got {n}")
        if topk > 1:
            if self.method not in ("draft_model", "eagle3"):
                raise ValueError(f"speculative_config.topk: method {self.method!r} drafts chains only (topk 1)")
            if topk > n:
                raise ValueError(f"speculative_config.topk ({topk}) must not exceed num_draft_tokens ({n})")
            if (k - 1) * topk > MAX_DRAFT_TOKENS:
                raise ValueError(f"speculative_config.num_speculative_tokens: a tree {k} deep and topk {topk} wide "
                                 f"feeds {(k - 1) * topk} nodes to its drafter, more than the {MAX_DRAFT_TOKENS} "
                                 "one attention mask holds")
            if n > topk + (k - 1) * topk * topk:
                raise ValueError(f"speculative_config.num_draft_tokens ({n}) exceeds the {topk + (k - 1) * topk * topk} "
                                 f"nodes a tree of topk {topk}, num_speculative_tokens {k} deep grows")
            if self.simulate_acceptance is not None:
                self.simulate_acceptance.check_tree(topk, "speculative_config.simulate_acceptance")

    @property
    def max_draft_len(self) -> int:
        """The most tokens a request verifies beyond its own: a chain's length, or a tree's nodes."""
        return self.num_draft_tokens

    def draft_depth(self, k: int) -> int:
        """Drafter passes (the catch-up's, then one per draft step) of a request drafting k:
        k for a chain. A tree of k nodes grows min(topk, k) wide and min(depth, k) deep (its
        best k nodes could reach no further), so that it is the best k nodes of the largest
        tree, and a tree of k + 1 nodes is it and one node more: what the policy learns of the
        m-th node's chance holds for every tree."""
        return max(0, min(self.num_speculative_tokens, k))

    def draft_slots(self, k: int) -> int:
        """Slots past its root a request drafting k keeps for the step: its k drafts' (their
        target KV), or more for the drafter KV of the nodes a tree's growth feeds, min(topk,
        k) a level below the first (`ChainDrafter._place`)."""
        return max(k, (self.draft_depth(k) - 1) * min(self.topk, k)) if k > 0 else 0

    @staticmethod
    def from_dict(d: dict | str | "SpecConfig" | None) -> "SpecConfig | None":
        """From a dict of its fields, or that dict as a JSON text (as on the command line)."""
        if d is None or isinstance(d, SpecConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text), got {type(d).__name__}")
        known = {f.name for f in fields(SpecConfig)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known keys {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config: needs 'method' and 'num_speculative_tokens' "
                             "(for no speculation: None, or `none` on the command line)")
        return SpecConfig(**d)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"                  # "auto": cuda when torch sees a GPU, else cpu
    dtype: str = "auto"
    max_model_len: int | None = None      # None = the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048    # token budget of one step (prefill chunks + decodes)
    page_size: int = 16
    num_pages: int | None = None          # None = size from gpu_memory_utilization (cuda) or kv_cache_memory_gb (cpu)
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_gb: float = 1.0       # CPU only
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None = "triton" on cuda, "torch" on cpu
    enforce_eager: bool = False           # cuda: no CUDA graphs (debugging)
    async_scheduling: bool | None = None  # queue the next step behind one whose rows all sample; None: on cuda
    load_format: str = "safetensors"      # "dummy": random weights from config.json (speed runs)
    tensor_parallel_size: int = 1         # ranks the target model is split over (processes the engine starts)
    seed: int = 0
    speculative_config: SpecConfig | None = field(default=None)

    def __post_init__(self):
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.async_scheduling is None:
            # A CPU forward runs as it is launched: a step queued behind it would overlap
            # nothing, only hold back this step's tokens by a step and show the policy the
            # next step's time as this one's.
            object.__setattr__(self, "async_scheduling", self.device != "cpu")
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(f"num_pages must be an integer >= 2, got {self.num_pages!r}")
        if not isinstance(self.kv_cache_memory_gb, (int, float)) or not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        object.__setattr__(self, "speculative_config", SpecConfig.from_dict(self.speculative_config))
        if self.tensor_parallel_size > 1 and self.speculative_config and self.speculative_config.topk > 1:
            raise ValueError("speculative_config.topk: trees of drafts run on one rank only (tensor_parallel_size 1)")
