"""Start-up measurements (`tidal.profiling`): the largest step the memory plan runs stays
within the step's bounds and leaves the engine serving exactly; the cost profile is kept
between engines of the same shape and measured again for another; kernels built after
start-up are counted."""

import logging

import numpy as np
import pytest

from checkpoints import make_eagle3_checkpoint
from tidal import LLM, SamplingParams, profiling
from tidal.compiles import CompileWatch
from tidal.config import SpecConfig
from tidal.profiling import largest_step_pages, measure_costs, plan_pages, run_largest_steps
from tidal.speculative.cost_model import fill_by_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13], list(range(20, 60))]


def test_largest_steps_are_bounded_and_leave_the_engine_exact(checkpoint, tmp_path):
    target = checkpoint("llama")
    head = str(make_eagle3_checkpoint(tmp_path / "eagle3", target))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "policy": "fixed"}
    want = [o.outputs[0].token_ids for o in LLM(model=target).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model=target, max_num_batched_tokens=64, max_num_seqs=8, speculative_config=spec)
    engine = llm.engine
    runner, proposer = engine.core.runner, engine.core.speculation.proposer
    assert runner.num_pages >= largest_step_pages(engine.config, engine.config.page_size)
    sizes = {"target": [], "drafter": []}
    model_forward, draft_forward = runner.model.forward, proposer.forward
    runner.model.forward = lambda ids, batch, kv: sizes["target"].append(len(ids)) or model_forward(ids, batch, kv)
    proposer.forward = lambda batch, state: sizes["drafter"].append(batch.num_tokens) or draft_forward(batch, state)
    run_largest_steps(runner, proposer)
    assert sizes["target"] == [64, 8 * 4]  # a budget-long prompt chunk, then 8 rows verifying 3 drafts
    assert sizes["drafter"][0] == 64 and max(sizes["drafter"]) == 64  # one budget-long absorb, none larger
    assert max(sizes["drafter"][1:]) <= 8 * (3 + 2)
    runner.model.forward, proposer.forward = model_forward, draft_forward
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert engine.core.pool.num_free == engine.core.pool.capacity
    assert plan_pages(runner, proposer) == int(engine.config.kv_cache_memory_gb * 2**30
                                               // runner.bytes_per_page(proposer.bytes_per_page))


def test_the_cost_profile_is_kept_for_the_same_shapes(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "profile_seconds": 0.2}

    def costs(**kw):
        return LLM(model=checkpoint("llama"), speculative_config={**spec, **kw}).engine.core.scheduler.policy.cost

    first, again, other = costs(), costs(), costs(num_speculative_tokens=2)
    assert first.source.startswith("profile:") and again.source.startswith("cached profile")
    assert (again.grid == first.grid).all() and again.catch_up_token == first.catch_up_token
    assert other.source.startswith("profile:")  # another K: another grid
    assert len(list((tmp_path / "cache").glob("costs-*.json"))) == 2


def test_the_profile_prices_drafting_at_every_batch_size_before_wider_steps(monkeypatch):
    """Out of time, the profile has measured the target's width 2 (K = 1) and the drafter's
    one pass at every batch size, up to 256, before any wider step: the price of drafting at
    all is measured at every load, not guessed. Each timing takes 10 ms of a 0.3 s budget."""
    from types import SimpleNamespace

    clock, timings, shape = [0.0], [], {}
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])

    def plan(batch, context, k, runner, params=None, num_new=1):
        shape.update(kind="drafter", batch=batch, width=1 + k)  # (the target's are told by their drafts)
        return None

    def drafts(tokens, lens, tree=None):
        shape.update(kind="target", width=1 + lens[0])

    def timed(fn, device, repeats=3):
        clock[0] += 0.01
        timings.append((shape.pop("kind", "target"), shape["batch"], shape["width"]))
        return 1e-3 * shape["batch"] * shape["width"]

    monkeypatch.setattr(profiling, "dummy_plan", plan)
    monkeypatch.setattr(profiling, "Drafts", drafts)
    monkeypatch.setattr(profiling, "timed", timed)
    spec = SpecConfig("eagle3", 5, model="unused", topk=4, num_draft_tokens=16)
    runner = SimpleNamespace(page_size=16, num_pages=10_000, tree_drafts=False, device="cpu",
                             config=SimpleNamespace(speculative_config=spec),
                             model=SimpleNamespace(config=SimpleNamespace(vocab_size=100)))
    measure_costs(runner, SimpleNamespace(bytes_per_page=0), 256, 16, 4096, seconds=0.3)
    every = {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {b for kind, b, w in timings if kind == "target" and w == 2} == every
    assert {b for kind, b, w in timings if kind == "drafter" and w == 2} == every
    first_wide = next(i for i, (_, _, w) in enumerate(timings) if w > 2)
    assert first_wide == 2 + 3 * len(every)  # (after the context cost's two: widths 1 and 2, the drafter's pass)
    assert len(timings) < 2 + 9 * 6 + 9 * 2  # the budget cut the rest


def test_a_wide_step_the_budget_cut_is_priced_by_narrower_steps_of_more_rows():
    """At 128 rows a memory-bound step of width 4 costs little more than one of width 3;
    scaled by tokens from it, as if compute-bound, it would be priced a third over, too dear
    to be tried and so corrected. 256 rows of width 2 hold as many tokens in more rows: that
    bound is the guess. The drafter's passes run one after another: more rows bound nothing."""
    nan = np.nan
    rows, widths = [64, 128, 256], [1, 2, 3, 4, 5]
    grid = np.array([[23.3, 24.5, 25.4, 25.8, 27.6],
                     [24.6, 26.1, 28.3, nan, nan],
                     [26.4, 30.2, nan, nan, nan]])
    filled = fill_by_tokens(grid, rows, widths, rows_add=True)
    assert filled[1, 3] == 30.2                                   # 256 x 2: as many tokens
    assert filled[1, 4] == pytest.approx(30.2 * 640 / 512)        # fewer tokens, scaled up
    assert filled[2, 2] == pytest.approx(30.2 * 3 / 2)            # no more rows: its own row
    assert np.isnan(grid[1, 3])                                   # (the measurements stay as they were)
    assert fill_by_tokens(grid, rows, widths)[1, 3] == pytest.approx(28.3 * 4 / 3)


def test_kernels_built_while_serving_are_counted_and_logged(monkeypatch, caplog):
    """A Triton kernel built after start-up is a stall in a user's step: the watch counts
    and logs those (and only those) through Triton's compile hooks, and leaves any hook
    that was there before in the chain."""
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["key"]))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    watch.start_up()

    def build(key):
        info = dict(key=key, repr="_kernel[num_warps=4](x_ptr: *fp32)", fn=None, is_manual_warmup=False,
                    compile={"signature": {"x_ptr": "*fp32", "n": key}, "configs": [{(0,): [["tt.divisibility", 16]]}]},
                    already_compiled=False)
        knobs.runtime.jit_cache_hook(**info)
        knobs.runtime.jit_post_compile_hook(**info)

    build("at start-up")
    assert watch.count == 0
    watch.serving()
    with caplog.at_level(logging.WARNING, logger="tidal.compiles"):
        build("mid-serving")
    assert watch.count == 1 and "while serving" in caplog.text
    assert "_kernel {'x_ptr': '*fp32', 'n': 'mid-serving'} [{(0,): [['tt.divisibility', 16]]}]" in caplog.text
    assert seen == ["at start-up", "mid-serving"]
    watch.start_up()  # another engine's start-up in the same process
    build("its start-up")
    assert watch.count == 1


def test_the_largest_steps_stay_within_max_model_len(checkpoint, tmp_path):
    """A model whose context is shorter than the token budget: the row that absorbs a
    budget's worth stops at max_model_len (a position past it has no rotary angle)."""
    target = checkpoint("llama")
    head = str(make_eagle3_checkpoint(tmp_path / "eagle3", target))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "policy": "fixed"}
    engine = LLM(model=target, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=40,
                 speculative_config=spec).engine
    runner, proposer = engine.core.runner, engine.core.speculation.proposer
    positions = []
    model_forward, draft_forward = runner.model.forward, proposer.forward
    runner.model.forward = lambda ids, batch, kv: positions.append(int(batch.positions.max())) or model_forward(
        ids, batch, kv)
    proposer.forward = lambda batch, state: positions.append(int(batch.positions.max())) or draft_forward(batch, state)
    run_largest_steps(runner, proposer)
    assert max(positions) < 40
