"""The planner alone (no model): what `Scheduler.schedule` plans, with and without a step
in flight, and how it makes room when pages run out."""

from types import SimpleNamespace

import pytest
import torch

from tidal.config import EngineConfig, SamplingParams, SpecConfig
from tidal.kv_cache import PagePool
from tidal.request import Request
from tidal.scheduler import Scheduler
from tidal.speculative.policy import Fixed
from tidal.step import StepResult

PAGE = 4


def planner(num_pages=64, k=2, budget=64, max_num_seqs=8, drafts_ahead=True, async_scheduling=True,
            spec=None, max_model_len=1024):
    """A scheduler whose policy drafts `k` for every decoding request (chains, unless `spec`
    is a tree's config)."""
    config = EngineConfig(model="unused", device="cpu", page_size=PAGE, max_num_batched_tokens=budget,
                          max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    speculation = SimpleNamespace(max_draft_len=k, proposer=SimpleNamespace(drafts_ahead=drafts_ahead),
                                  config=spec or SpecConfig("draft_model", max(k, 1), model="unused"),
                                  make_policy=lambda demand, queued, config: Fixed(k))
    return Scheduler(PagePool(num_pages, PAGE, enable_prefix_caching=False), config, max_model_len,
                     speculation if k else None)


def request(name, prompt_len, max_tokens=100):
    return Request(name, None, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0, ())


def commit_all(scheduler, plan, accepted=None, in_flight=None):
    """Commit `plan` as if row i had `accepted[i]` drafts accepted (all, by default)."""
    accepted = accepted or plan.draft_lens
    width = 1 + plan.max_draft_len
    tokens = torch.full((len(plan.requests), width), 7, dtype=torch.int64)
    lens = torch.tensor([1 + a if plan.samples(i) else 0 for i, a in enumerate(accepted)], dtype=torch.int64)
    scheduler.commit(plan, StepResult(tokens, lens), in_flight)


def test_a_plan_made_while_a_step_runs_covers_every_draft_there_and_the_next_commit():
    s = planner()
    a, b = request("a", 5), request("b", 9)
    s.add(a), s.add(b)
    first = s.schedule()
    assert first.num_new_tokens == [5, 9] and first.draft_lens == [0, 0]
    commit_all(s, first)
    decode = s.schedule()
    assert decode.num_new_tokens == [1, 1] and decode.draft_lens == [2, 2]
    ahead = s.schedule(decode)  # the step after `decode`, planned while it runs
    assert ahead.requests == [a, b] and ahead.num_new_tokens == [1, 1] and ahead.draft_lens == [2, 2]
    # Pages for the 1 + 2 tokens `decode` feeds, and this step's 1 + 2.
    assert len(a.pages) == -(-(5 + 3 + 3) // PAGE) and len(b.pages) == -(-(9 + 3 + 3) // PAGE)
    commit_all(s, decode, accepted=[0, 2], in_flight=ahead)  # a rejects both drafts: its pages stay, `ahead` uses them
    assert len(a.pages) == 3 and a.num_tokens == 7
    commit_all(s, ahead, accepted=[0, 0])
    assert len(a.pages) == -(-a.num_computed // PAGE)  # rejected drafts' pages back in the pool
    assert s.pool.num_free + sum(len(r.pages) for r in (a, b)) == s.pool.capacity


def test_a_tree_keeps_the_slots_its_growth_feeds_and_gives_them_back():
    """A tree of 8 nodes, 5 deep and 4 wide, feeds 4 nodes at each of 4 levels: its row keeps
    16 slots past its root for the step, not 8, and near max_model_len it drafts a tree whose
    slots fit."""
    spec = SpecConfig("draft_model", 5, model="unused", topk=4, num_draft_tokens=8)
    s = planner(k=8, spec=spec, max_model_len=40)
    a = request("a", 5)
    s.add(a)
    commit_all(s, s.schedule())
    plan = s.schedule()
    assert plan.draft_lens == [8] and len(a.pages) == -(-(5 + 1 + 16) // PAGE)
    commit_all(s, plan, accepted=[1])
    assert len(a.pages) == -(-a.num_computed // PAGE)  # the rest back in the pool
    while a.num_tokens < 26:
        commit_all(s, s.schedule(), accepted=[8])
    # 40 - 26 - 1 = 13 slots left: a tree of 4 nodes (12 slots), not 8 (16)
    assert a.num_tokens == 26 and s.schedule().draft_lens == [4]


def one_decoding(**kw):
    """A planner with request "a" decoding, and the plan of its step (at K = 2), not yet committed."""
    s = planner(**kw)
    a = request("a", 5)
    s.add(a)
    commit_all(s, s.schedule())
    return s, a, s.schedule()


def test_no_plan_ahead_of_an_outcome_that_could_change_it_but_the_choice_is_kept():
    s = planner()
    s.add(request("long", 100))  # more than the budget: chunked
    chunk = s.schedule()
    assert chunk.num_new_tokens == [64] and not chunk.samples_every_row
    assert s.schedule(chunk) is None  # a row that does not sample: nothing to plan ahead of it

    s, a, decode = one_decoding()
    s.add(request("big", 80))  # would have to be chunked after `decode`'s commit
    free = s.pool.num_free
    assert s.schedule(decode) is None
    assert s.pool.num_free == free  # no page taken for a plan not made
    assert s.chosen[0] == {"a": 2}  # the K chosen while `decode` ran ...
    choices, choose = [], s.policy.choose
    s.policy.choose = lambda *args: choices.append(args) or choose(*args)
    commit_all(s, decode)
    plan = s.schedule()  # ... are the ones the plan after its commit takes, without choosing again
    assert plan.requests[0] is a and plan.draft_lens[0] == 2 and choices == []


@pytest.mark.parametrize("kw", [{"drafts_ahead": False}, {"async_scheduling": False}],
                         ids=["a proposer drafting on the host", "async scheduling off"])
def test_where_the_planner_must_not_plan_ahead_the_policy_still_chooses_during_the_step(kw):
    s, _, decode = one_decoding(**kw)
    assert s.schedule(decode) is None and s.chosen[0] == {"a": 2}


def test_short_of_pages_the_latest_arrival_is_preempted_and_drafts_never_preempt():
    s = planner(num_pages=9, k=2)  # 8 pages of 4 tokens
    first, second = request("first", 16), request("second", 16)
    s.add(first), s.add(second)
    commit_all(s, s.schedule())  # 4 pages each
    assert s.pool.num_free == 0
    plan = s.schedule()  # each needs a 5th page for its next token: `second` makes room for `first`
    assert plan.requests == [first] and plan.num_new_tokens == [1] and plan.draft_lens == [2]
    assert second.pages == [] and s.waiting[0] is second and s.num_preemptions == 1

    s = planner(num_pages=10, k=2)  # 9 pages: one spare
    first, second = request("first", 15), request("second", 16)
    s.add(first), s.add(second)
    commit_all(s, s.schedule())
    # `first`'s next token fits its pages, its drafts would need the spare page, which
    # `second`'s next token needs (its drafts then fit there): `first` does not draft, and
    # nobody is preempted.
    plan = s.schedule()
    assert plan.requests == [first, second] and plan.draft_lens == [0, 2] and s.num_preemptions == 0


def test_rows_times_the_width_stay_within_the_token_budget():
    """Verification takes logits at every sampling row's width, 1 + the longest K: ten rows
    under a budget of 64 tokens draft at most 5 each (60 logits rows), though the policy asks
    16 and 10 + 16 tokens would fit the budget; one row alone drafts its 16."""
    spec = SpecConfig("draft_model", 5, model="unused", topk=4, num_draft_tokens=16)
    s = planner(k=16, spec=spec, budget=64, max_num_seqs=10)
    reqs = [request(f"r{i}", 4) for i in range(10)]
    for r in reqs:
        s.add(r)
    commit_all(s, s.schedule())
    plan = s.schedule()
    assert len(plan.requests) == 10 and plan.draft_lens == [5] * 10
    assert len(plan.requests) * (1 + plan.max_draft_len) <= 64
    commit_all(s, plan, accepted=[0] * 10)
    assert all(len(r.pages) == -(-r.num_computed // PAGE) for r in reqs)  # the cut slots' pages back

    s = planner(k=16, spec=spec, budget=64)
    assert s.schedule().requests == []  # (nothing to fit)
    s.add(request("a", 4))
    commit_all(s, s.schedule())
    assert s.schedule().draft_lens == [16]

    # Eight rows would draft 7 each (8 x 8 = 64; the last only the 5 left beside the whole
    # prompt waiting); that prompt, admitted beside them, makes nine rows: 6 at most.
    s = planner(k=16, spec=spec, budget=64, max_num_seqs=10)
    for i in range(8):
        s.add(request(f"r{i}", 4))
    commit_all(s, s.schedule())
    s.add(request("late", 2))
    plan = s.schedule()
    assert plan.num_new_tokens == [1] * 8 + [2] and plan.draft_lens == [6] * 7 + [5, 0]


def test_waiting_prompts_that_fit_whole_go_before_drafts():
    s = planner(budget=16, k=4)
    a = request("a", 4)
    s.add(a)
    commit_all(s, s.schedule())
    s.add(request("b", 12))
    plan = s.schedule()  # 1 (a's token) + 12 (b's whole prompt) leaves 3 for a's drafts
    assert plan.num_new_tokens == [1, 12] and plan.draft_lens == [3, 0]


def test_goodput_drafts_into_its_rows_last_pages_when_no_page_is_free():
    """A full KV cache leaves drafts the slots past each row's next token in its last page:
    goodput, whose drafts nearly cost nothing here, drafts there (the free pages alone left it
    none, and a KV-bound server stopped drafting), and nobody is preempted."""
    from tidal.speculative.cost_model import CostModel, grid_axes
    from tidal.speculative.policy import Goodput

    s = planner(num_pages=9, k=4)  # 8 pages of 4 tokens, two requests of 14 tokens: 4 pages each
    s.policy = Goodput(CostModel.from_function(lambda b, w: 0.010 + 1e-6 * b * w, *grid_axes(8, 4)), 4,
                       token_budget=64, demand=s.prefill_demand)
    reqs = [request("a", 14), request("b", 14)]
    for r in reqs:
        s.add(r)
    commit_all(s, s.schedule())  # 15 tokens each, in 4 pages: room for one draft past the next token
    assert s.pool.num_free == 0
    plan = s.schedule()
    assert plan.draft_lens == [1, 1] and s.num_preemptions == 0
    assert plan.choice.log["kv_room"] == 2


def test_prompts_the_kv_cache_cannot_take_want_no_budget():
    s = planner(num_pages=9, k=2, budget=64)  # 8 pages of 4 tokens
    s.add(request("running", 11))
    commit_all(s, s.schedule())  # 12 tokens, 3 pages: 5 free
    for name in ("fits", "waits", "after"):
        s.add(request(name, 12))
    # "fits" takes 3 pages; "waits" needs 3 of the 2 left, and "after" comes after it.
    assert s.prefill_demand(1000) == 12
    assert s.prefill_demand(10) == 10  # counted up to the limit (the prompt would be chunked)
    s.running[0].pages += s.pool.allocate(3)  # (as if its drafts took 3 of the 5)
    assert s.prefill_demand(1000) == 0


def test_the_queue_counts_prompts_being_fed_and_those_a_seat_and_pages_hold():
    """`queued` (the loop's load beyond the decoding rows, for the policy): a running request
    still feeding its prompt, then waiting ones first come first served, up to the first
    that the free pages or seats cannot hold."""
    s = planner(num_pages=13, k=2, budget=8, max_num_seqs=3)  # 12 pages of 4 tokens
    s.add(request("decoding", 3))
    commit_all(s, s.schedule())  # 4 tokens, 1 page: it decodes from now on
    for name in ("chunked", "fits", "no seat"):
        s.add(request(name, 12))
    plan = s.schedule()  # decoding's next token and 2 drafts, 5 of chunked's 12 prompt tokens
    assert plan.requests[-1].request_id == "chunked" and plan.num_new_tokens[-1] == 5
    commit_all(s, plan)
    assert [r.request_id for r in s.queued()] == ["chunked", "fits"]
    s.pool.allocate(s.pool.num_free - 2)  # 2 pages left: "fits" needs 3
    assert [r.request_id for r in s.queued()] == ["chunked"]
