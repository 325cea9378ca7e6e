"""Start-up measurements on the real device, with dummy requests, before the engine serves:
how much memory the largest step takes (so that the KV cache gets only what is left) and
what steps cost (goodput's cost model, kept in the user's cache directory between runs).

Both run before any request exists: the dummy requests may use any page of the cache, and
what they write there is overwritten before it is ever read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tidal.config import SamplingParams
from tidal.request import Request
from tidal.speculative.cost_model import CostModel, fill_by_tokens, grid_axes, monotone
from tidal.speculative.tree import Tree
from tidal.step import Drafts, StepPlan
from tidal.version import __version__

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)
# Every filter on, and logprobs: the sampler's largest buffers.
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, max_tokens=1 << 30, ignore_eos=True,
                         logprobs=20)


def dummy_plan(batch: int, context: int, k: int, runner, params=GREEDY, num_new: int = 1) -> StepPlan:
    """`batch` requests of `context` computed tokens, each feeding `num_new` tokens (the last
    of its sequence, so it samples) plus k drafts. The tokens are random, as served text's
    are: a Mixture-of-Experts model routes them to its experts as it would real ones (one
    token repeated would route every row to the same few, and price a step far too low)."""
    ps, spec = runner.page_size, runner.config.speculative_config
    pages = -(-(context + num_new + (spec.draft_slots(k) if spec else k)) // ps)
    tokens = random_tokens(runner, (batch, context + num_new)).tolist()
    reqs = []
    for i in range(batch):
        req = Request(f"profile-{i}", None, tokens[i], params, i, ())
        req.num_computed = context
        req.pages = [1 + (i * pages + p) % (runner.num_pages - 1) for p in range(pages)]
        reqs.append(req)
    return StepPlan(reqs, [num_new] * batch, [k] * batch)


def random_tokens(runner, shape: tuple[int, ...]) -> torch.Tensor:
    """Token ids drawn from the model's vocabulary (seeded: every profile sees the same)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(runner.model.config.vocab_size, shape, generator=g)


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Fastest of `repeats` runs after a warm-up: interference only ever adds time."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


# -- memory --------------------------------------------------------------------------------

def largest_step_pages(config, page_size: int) -> int:
    """Pages the largest steps (`run_largest_steps`) use."""
    spec = config.speculative_config
    k, slots = (spec.max_draft_len, spec.draft_slots(spec.max_draft_len)) if spec else (0, 0)
    rows = verify_rows(config)
    return (rows * -(-(page_size + 2 + k + slots) // page_size)
            + -(-(config.max_num_batched_tokens + k + slots + 2) // page_size) + 1)


def verify_rows(config) -> int:
    """The most rows a verification step can have: the token budget holds 1 + K a row."""
    k = config.speculative_config.max_draft_len if config.speculative_config else 0
    return max(1, min(config.max_num_seqs, config.max_num_batched_tokens // (1 + k)))


@torch.inference_mode()
def run_largest_steps(runner, proposer) -> None:
    """The steps that take the most memory: a prompt chunk of the whole token budget, and
    the widest verification (every row that fits the budget at K drafts, sampled with every
    filter and logprobs) drafted for by a sampling drafter that first absorbs a whole
    budget's worth of missed tokens (its largest forward, `ChainDrafter._absorb`) and then
    catches every row up by K + 2."""
    config, ps = runner.config, runner.page_size
    budget = config.max_num_batched_tokens
    prompt = dummy_plan(1, 0, 0, runner, SAMPLED, num_new=min(budget, runner.max_model_len - 1))
    runner.launch(prompt).result()
    if proposer is None:
        b = verify_rows(config)
        runner.launch(dummy_plan(b, ps, 0, runner, SAMPLED)).result()
        return
    k = runner.max_draft_len
    slots = config.speculative_config.draft_slots(k)
    plan = dummy_plan(verify_rows(config), ps, k, runner, SAMPLED)
    # One row that missed a budget's worth, or all that max_model_len leaves beside its drafts
    # (the model has no positions past it); it takes the pages after the others'.
    first = plan.requests[0]
    first.token_ids = [0] * min(budget + k + 3, runner.max_model_len - slots)
    first.num_computed = len(first.token_ids) - 1
    used = {p for r in plan.requests[1:] for p in r.pages}
    first.pages = [p for p in range(1, runner.num_pages) if p not in used][:-(-(len(first.token_ids) + slots) // ps)]
    for r in plan.requests:
        r.num_absorbed = 0 if r is first else r.num_computed - 1
    drafts = proposer.propose(plan, list(range(len(plan.requests))))
    runner.launch(plan, drafts).result()


def peak_activation_bytes(runner, proposer) -> int:
    """CUDA: the bytes the largest steps allocate beyond what is resident (weights, cache)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    run_largest_steps(runner, proposer)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - resident


def plan_pages(runner, proposer) -> int:
    """Pages for the KV cache: on cuda, what gpu_memory_utilization leaves after the weights
    and the largest step's activations (measured on a small cache, given back first); on
    cpu, what kv_cache_memory_gb holds."""
    per_page = runner.bytes_per_page(proposer.bytes_per_page if proposer else 0)
    if runner.device.type != "cuda":
        return runner.pages_that_fit(per_page, 0)
    small = largest_step_pages(runner.config, runner.page_size)
    runner.allocate_cache(small)
    if proposer is not None:
        proposer.allocate_cache()
    peak = peak_activation_bytes(runner, proposer)
    pages = runner.pages_that_fit(per_page, peak - small * per_page)  # the small cache goes back
    logger.info("the largest step takes %.2f GiB beside the weights; the KV cache gets %d pages of %.2f MiB",
                peak / 2**30, pages, per_page / 2**20)
    return pages


# -- costs ---------------------------------------------------------------------------------

def long_context(runner, max_batch: int, max_draft_len: int, max_model_len: int) -> int:
    """The context at which the profile prices attention: 2,048 tokens, or what fits."""
    k = grid_axes(max_batch, max_draft_len)[1][-1] - 1
    spec = runner.config.speculative_config
    reach = 1 + (spec.draft_slots(k) if spec else k)  # a row's token and its drafts' slots
    return min(2048, max_model_len - reach - 1, (runner.num_pages - 1) // min(8, max_batch) * runner.page_size - reach)


def cached_costs(key: dict, measure: Callable[[], CostModel]) -> CostModel:
    """The cost model measured before for this `key` (everything the profile depends on),
    from the cache directory ($TIDAL_CACHE_DIR, else $XDG_CACHE_HOME/tidal or
    ~/.cache/tidal); else `measure()`, stored there for next time. Online corrections
    refine either as steps run."""
    root = Path(os.environ.get("TIDAL_CACHE_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidal")
    text = json.dumps(key, sort_keys=True, default=str)
    path = root / f"costs-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == json.loads(text):
            model = CostModel(**saved["model"])
            model.source = f"cached profile ({path})"
            return model
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure again
    model = measure()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": json.loads(text), "model": model.to_dict()}))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the cost profile in %s: %s", root, e)
    return model


def cost_key(runner, proposer) -> dict:
    """What a cost profile depends on: the device, the software, the models' shapes, the
    engine's shapes, the shapes it measures and how it guesses those it does not reach (a
    profile of another grid, or one guessed by another rule, is measured again)."""
    config = runner.config
    device = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else \
        f"cpu x{os.cpu_count()}"
    return {"device": device, "torch": torch.__version__, "tidal": __version__,
            "model": asdict(runner.model_config), "drafter": repr(getattr(proposer, "config", None)),
            "method": config.speculative_config.method, "dtype": str(runner.dtype),
            "graphs": runner.graphs is not None, "attention": type(runner.attn).__name__,
            "page_size": runner.page_size, "max_num_seqs": config.max_num_seqs,
            "tensor_parallel_size": config.tensor_parallel_size,
            "long_context": long_context(runner, config.max_num_seqs, runner.max_draft_len, runner.max_model_len),
            "max_num_batched_tokens": config.max_num_batched_tokens, "k": runner.max_draft_len,
            "topk": config.speculative_config.topk, "depth": config.speculative_config.num_speculative_tokens,
            "seconds": config.speculative_config.profile_seconds,
            "grid": grid_axes(config.max_num_seqs, runner.max_draft_len),
            "unreached": "least upper bound; for the target, also by shapes of more rows"}


def drafter_ks(max_draft_len: int) -> list[int]:
    """The drafts the profile times the drafter proposing: one, and the most (its price is a
    fixed part and one per pass, fitted between them)."""
    return sorted({1, max_draft_len})


def profile_order(batch_sizes: list[int], widths: list[int], draft_ks: list[int]) -> list[tuple[int, int, int]]:
    """The shapes a profile measures, in its order, as (0, batch, width) indices of the
    target's grid and (1, batch, k) of the drafter's. The narrowest drafting step at every
    batch size first (width 2, and the drafter's one pass beside width 1): it prices whether
    to draft at all at each load, and a shape left to `fill_by_tokens` gets an upper bound,
    at width 2 twice a plain step's price, where a memory-bound step costs little more than
    a plain one; a price too dear is seldom tried, so seldom corrected. Then the rest, fewest
    tokens first (the narrow steps of the most rows bound the wide ones of fewer that the
    budget may cut)."""
    jobs = sorted([(w > 2, b * w, 0, i, j) for i, b in enumerate(batch_sizes) for j, w in enumerate(widths)]
                  + [(k > 1, b * k, 1, i, j) for i, b in enumerate(batch_sizes) for j, k in enumerate(draft_ks)])
    return [job[2:] for job in jobs]


def measure_costs(runner, proposer, max_batch: int, max_draft_len: int, max_model_len: int,
                  seconds: float) -> CostModel:
    """Time real steps (runner.launch, proposer.propose) on dummy requests, smallest shapes
    first (`profile_order`), until `seconds` are spent; a shape left over gets the least
    upper bound the measured ones put on it (`fill_by_tokens`).

    Runs before the engine serves anything: the page pool is empty, so the dummy requests
    may use any page, and what they write is overwritten before it is ever read."""
    start = time.perf_counter()
    batch_sizes, widths = grid_axes(max_batch, max_draft_len)
    ctx = runner.page_size

    def run_target(b, w, context=ctx):
        plan = dummy_plan(b, context, w - 1, runner)
        drafts = None
        if w > 1:  # (an engine that drafts trees verifies 2+ drafts as a tree: its walk and KV move)
            chain = Tree.of(torch.arange(w - 1, device=runner.device).expand(b, w - 1)) \
                if runner.tree_drafts and w > 2 else None
            drafts = Drafts(random_tokens(runner, (b, w - 1)).to(runner.device), [w - 1] * b, tree=chain)
        return timed(lambda: runner.launch(plan, drafts).result(), runner.device)

    def run_proposer(b, k, backlog=1):
        """The proposer on b rows whose drafter has `backlog` tokens to absorb first."""
        context = max(ctx, backlog)
        plan = dummy_plan(b, context, k, runner)

        def propose():
            for r in plan.requests:
                r.num_absorbed = context - backlog
            proposer.propose(plan, list(range(b)))
        return timed(propose, runner.device)

    # Context cost first (it is cheap, and no grid point can stand in for it): the same
    # small batch at a short and a long context.
    b_ctx = min(8, max_batch)
    ctx_long = long_context(runner, max_batch, max_draft_len, max_model_len)
    context_cost = 0.0
    if ctx_long > 2 * ctx:
        short, long = run_target(b_ctx, 1), run_target(b_ctx, 1, ctx_long)
        context_cost = max(0.0, (long - short) / (b_ctx * (ctx_long - ctx)))
    # Catch-up, for a drafter with a cache of its own (nor can a grid point stand in for it):
    # the same rows absorbing one token more than a proposal after a verify step, and many.
    catch_up_fixed = catch_up_token = 0.0
    usual_backlog, long_backlog = max_draft_len + 1, min(256, ctx_long)
    if proposer.bytes_per_page and long_backlog > 2 * usual_backlog:
        usual, past = run_proposer(b_ctx, 1), run_proposer(b_ctx, 1, usual_backlog + 1)
        many = run_proposer(b_ctx, 1, long_backlog)
        catch_up_token = max(0.0, (many - past) / (b_ctx * (long_backlog - usual_backlog - 1)))
        catch_up_fixed = max(0.0, past - usual - catch_up_token * b_ctx)
    grid = np.full((len(batch_sizes), len(widths)), np.nan)
    draft_ks = drafter_ks(max_draft_len)
    drafts = np.full((len(batch_sizes), len(draft_ks)), np.nan)
    deadline = start + seconds
    for kind, i, j in profile_order(batch_sizes, widths, draft_ks):
        if time.perf_counter() > deadline and (i, j) != (0, 0):  # the smallest shapes always run
            continue
        if kind == 0:
            grid[i, j] = run_target(batch_sizes[i], widths[j])
        else:
            drafts[i, j] = run_proposer(batch_sizes[i], draft_ks[j])
    measured = int(np.isfinite(grid).sum() + np.isfinite(drafts).sum())
    grid = monotone(fill_by_tokens(grid, batch_sizes, widths, rows_add=True))
    drafts = monotone(fill_by_tokens(drafts, batch_sizes, draft_ks))
    # The drafter's price: a fixed part and one per pass (a tree's passes follow its depth).
    passes = [runner.config.speculative_config.draft_depth(k) for k in range(max_draft_len + 1)]
    first, last = drafts[:, 0], drafts[:, -1]
    span = passes[draft_ks[-1]] - passes[1]
    step = np.maximum((last - first) / span if span else first, 0.0)
    fixed = np.maximum(first - step, 0.0)
    return CostModel(batch_sizes, widths, grid, padded=getattr(runner, "graphs", None) is not None,
                     context_ref=ctx, context_cost=context_cost, draft_fixed=fixed, draft_step=step,
                     draft_passes=passes, catch_up_fixed=catch_up_fixed, catch_up_token=catch_up_token,
                     source=f"profile: {measured} of {grid.size + drafts.size} shapes measured in "
                            f"{time.perf_counter() - start:.2f} s (the rest bounded by those)")
