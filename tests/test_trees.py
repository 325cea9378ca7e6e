"""Trees of drafts (topk > 1): greedy outputs identical to plain decoding for every drafter
and policy, sampled outputs distributed as the target's, the accepted nodes' KV at the
sequence's positions, and every KV page free afterwards."""

import pytest
import torch

import tidal.runner
import tidal.speculative.proposer
from stats import homogeneity_pvalue
from test_spec import (ALPHA, NEW_TOKENS, RandomPolicy, continuation_counts, greedy, models, plain,  # noqa: F401
                       repetitive_prompts, run)
from tidal import LLM, SamplingParams
from tidal.config import SpecConfig
from tidal.speculative.cost_model import CostModel, grid_axes
from tidal.speculative.policy import Choice, NoFeedback
from tidal.graphs import CudaGraphs
from tidal.profiling import dummy_plan
from tidal.speculative.tree import Tree, accept_tree, simulated_choice, tree_shape
from tidal.speculative.verify import verify as real_verify


def tree_config(models, method, depth=3, topk=2, nodes=6, **extra):
    return {"method": method, "model": models[method], "num_speculative_tokens": depth, "topk": topk,
            "num_draft_tokens": nodes, "policy": "fixed", **extra}


def test_tree_shape_and_walk():
    #        0 (root)
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tree = Tree.of(torch.tensor([[0, 0, 1, 1, 2]]))
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2]]
    assert tree.ancestors.tolist() == [[0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]]
    drafts = torch.tensor([[10, 11, 20, 21, 30]])
    # The target's token at each query index: at the root 11 (node 2), at node 2 30 (node 5), at node 5 99.
    targets = torch.tensor([[11, 0, 30, 0, 0, 99]])
    tokens, lens, path = accept_tree(targets, drafts, tree, torch.tensor([5]))
    assert lens.tolist() == [3] and path[0, :3].tolist() == [0, 2, 5] and tokens[0, :3].tolist() == [11, 30, 99]
    # Only the first 4 nodes are valid: node 5 is not there, so the walk stops at node 2.
    tokens, lens, path = accept_tree(targets, drafts, tree, torch.tensor([4]))
    assert lens.tolist() == [2] and tokens[0, :2].tolist() == [11, 30]
    # A node whose parent is off the path is off it too: node 3 is the target's token at
    # node 1, but node 1 is not the root's.
    tokens, lens, path = accept_tree(torch.tensor([[11, 20, 30, 0, 0, 99]]), drafts, tree, torch.tensor([5]))
    assert lens.tolist() == [3] and path[0].tolist() == [0, 2, 5, 0, 0, 0]
    # A chain is a tree: node r + 1 hangs from node r.
    tokens, lens, _ = accept_tree(torch.tensor([[5, 6, 8, 9]]), torch.tensor([[5, 6, 7]]),
                                  Tree.of(torch.tensor([[0, 1, 2]])), torch.tensor([3]))
    assert lens.tolist() == [3] and tokens[0, :3].tolist() == [5, 6, 8]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
@pytest.mark.parametrize("shape", [(3, 2, 6), (2, 3, 4), (4, 2, 12)])
def test_greedy_lossless_with_trees(models, plain, method, shape):
    depth, topk, nodes = shape
    llm = LLM(model=models["target"], page_size=4,
              speculative_config=tree_config(models, method, depth, topk, nodes))
    got, _ = run(llm, repetitive_prompts(), greedy())
    assert got == plain, f"{method} tree {shape} changed the greedy output"
    spec = llm.engine.stats()["spec"]
    assert spec["num_drafted"] > 0
    if method == "draft_model":
        assert 0 < spec["num_accepted"] < spec["num_drafted"], "want both acceptance and rejection"


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_greedy_lossless_with_a_tree_size_per_request_and_goodput(models, plain, method):
    llm = LLM(model=models["target"], page_size=4, speculative_config=tree_config(models, method, 3, 2, 6))
    llm.engine.core.scheduler.policy = RandomPolicy(seed=4)
    assert run(llm, repetitive_prompts(), greedy())[0] == plain
    llm = LLM(model=models["target"], page_size=4, max_num_batched_tokens=24,
              speculative_config=tree_config(models, method, 3, 2, 6, policy="goodput", cost_model="online"))
    assert run(llm, repetitive_prompts(), greedy())[0] == plain


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_trees_drafted_ahead_of_a_step_in_flight_change_no_output(models, plain, method):
    """With async scheduling a tree is drafted and verified behind the step before, as if
    that step's every node on its deepest path were accepted, and moved back on the device:
    greedy and seeded outputs are the plain ones."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    seeded = run(LLM(model=models["target"], page_size=4), repetitive_prompts(), params)[0]
    llm = LLM(model=models["target"], page_size=4, async_scheduling=True,
              speculative_config=tree_config(models, method, 3, 3, 8))
    launch, behind_trees = llm.engine.core.runner.launch, []

    def recording(plan, drafts=None, ahead=None):
        behind_trees.append(ahead is not None and ahead.rejected is not None and drafts is not None)
        return launch(plan, drafts, ahead)

    llm.engine.core.runner.launch = recording
    llm.engine.core.scheduler.policy = RandomPolicy(seed=4)
    assert run(llm, repetitive_prompts(), greedy())[0] == plain
    assert run(llm, repetitive_prompts(), params)[0] == seeded
    assert any(behind_trees), "want trees drafted behind a step with drafts"


class ReplayedOnTheCpu(CudaGraphs):
    """CudaGraphs whose graphs, on the CPU, run their forward again at each replay, on the
    same input buffers and into the same output tensors: what a replay reads and returns,
    and its padding, without CUDA. Captured on the inputs a real capture runs."""

    def capture(self, pool=None):
        self.replays = 0
        for w in self.widths:
            for b in self.buckets:
                batch = self.blank_inputs(b, w)
                state = None if self.state is None else self.state[:b * w]
                self.graphs[(b, w)] = (_Rerun(self, batch, state), batch, self.forward(batch, state))
        return pool


class _Rerun:
    def __init__(self, graphs, batch, state):
        self.graphs, self.batch, self.state = graphs, batch, state

    def replay(self):
        self.graphs.replays += 1
        out = self.graphs.graphs[(self.batch.num_seqs, self.batch.max_query_len)][2]
        new = self.graphs.forward(self.batch, self.state)
        for kept, fresh in zip(*((out, new) if isinstance(new, tuple) else ((out,), (new,)))):
            if kept is not None:
                kept.copy_(fresh)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_trees_grown_inside_graphs_change_no_output(models, plain, method, monkeypatch):
    """A tree's growth replays as one graph (its rows padded to the graph's bucket: padding
    rows grow nothing and store nowhere), planned after a commit and ahead of a step in
    flight: the replayed drafts are those grown eagerly (as many accepted), and greedy and
    seeded outputs are the plain ones."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    seeded = run(LLM(model=models["target"], page_size=4), repetitive_prompts(), params)[0]
    for async_scheduling in (False, True):
        accepted = []
        for graphs in (False, True):
            llm = LLM(model=models["target"], page_size=4, max_num_seqs=8, async_scheduling=async_scheduling,
                      speculative_config=tree_config(models, method, 3, 3, 8))
            proposer = llm.engine.core.speculation.proposer
            if graphs:
                monkeypatch.setattr(tidal.speculative.proposer, "CudaGraphs", ReplayedOnTheCpu)
                proposer.capture_graphs()
            llm.engine.core.scheduler.policy = RandomPolicy(seed=4)
            assert run(llm, repetitive_prompts(), greedy())[0] == plain
            assert run(llm, repetitive_prompts(), params)[0] == seeded
            accepted.append(llm.engine.stats()["spec"]["num_accepted"])
        assert accepted[0] == accepted[1] > 0, accepted
        assert sum(g.replays for sets in proposer.draft_graphs.values() for g in sets) > 0


class OneNode(NoFeedback):
    """A node a request, every step: trees of one node."""

    name = "one node"

    def choose(self, requests, limits, num_waiting, kv_room=None):
        return Choice([min(1, limit) for limit in limits])


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_steps_of_one_node_a_row_draft_chains(models, plain, method):
    """A tree of one node is a chain of one: an engine that drafts trees drafts a step whose
    rows draft one node at most as chains (no growth, no walk, no KV move), greedy and seeded
    outputs the plain ones."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    seeded = run(LLM(model=models["target"], page_size=4), repetitive_prompts(), params)[0]
    llm = LLM(model=models["target"], page_size=4, speculative_config=tree_config(models, method, 3, 2, 6))
    launch, trees = llm.engine.core.runner.launch, []

    def recording(plan, drafts=None, ahead=None):
        if drafts is not None:
            trees.append(drafts.tree)
        return launch(plan, drafts, ahead)

    llm.engine.core.runner.launch = recording
    llm.engine.core.scheduler.policy = OneNode()
    assert run(llm, repetitive_prompts(), greedy())[0] == plain
    assert run(llm, repetitive_prompts(), params)[0] == seeded
    assert trees and all(tree is None for tree in trees)
    assert llm.engine.stats()["spec"]["num_accepted"] > 0


def test_trees_beat_chains_on_accepted_length(models):
    """A wider tree gives the target more chances: with the same drafter, a request accepts
    more tokens per step from a tree of 12 nodes than from a chain of 4."""
    lengths = {}
    for name, cfg in {"chain": {"num_speculative_tokens": 4},
                      "tree": {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 12}}.items():
        llm = LLM(model=models["target"], page_size=4, speculative_config={
            "method": "draft_model", "model": models["draft_model"], "policy": "fixed", **cfg})
        run(llm, repetitive_prompts(), greedy())
        lengths[name] = llm.engine.stats()["spec"]["mean_accepted_length"]
    assert lengths["tree"] > lengths["chain"], lengths


def test_seeded_sampling_with_trees_gives_the_plain_tokens(models):
    """Every committed token is the target's own seeded draw, so a seeded request's tokens
    are those of plain decoding, whatever trees were drafted."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    want = run(LLM(model=models["target"], page_size=4), repetitive_prompts(), params)[0]
    for method in ("draft_model", "eagle3"):
        llm = LLM(model=models["target"], page_size=4, speculative_config=tree_config(models, method, 3, 3, 8))
        llm.engine.core.scheduler.policy = RandomPolicy(seed=9)
        assert run(llm, repetitive_prompts(), params)[0] == want, method


def test_a_drafter_equal_to_the_target_has_its_first_child_accepted(models):
    """A sampled row's first child is the drafter's draw in the race the target's own draw
    runs there: with the target as its drafter and a tree of the root's two best children,
    the first is accepted and the second rejected at every step, for sampled and greedy
    rows sharing a step."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    llm = LLM(model=models["target"], page_size=4, speculative_config={
        "method": "draft_model", "model": models["target"], "num_speculative_tokens": 1, "topk": 2,
        "num_draft_tokens": 2, "policy": "fixed"})
    run(llm, repetitive_prompts(), params)
    spec = llm.engine.stats()["spec"]
    assert spec["num_drafted"] > 0 and spec["num_accepted"] == spec["num_steps"], spec


def test_sampling_with_trees_is_lossless_and_the_test_detects_a_wrong_verifier(models, monkeypatch):
    """Four tokens of the top 2 a request, so that the step after the first verifies trees
    of two nodes (one node a row is a chain)."""
    target = continuation_counts(LLM(model=models["target"], page_size=4, max_num_seqs=256), top_k=2, max_tokens=4)
    spec = LLM(model=models["target"], page_size=4, max_num_seqs=256,
               speculative_config=tree_config(models, "draft_model", 2, 3, 6))
    assert homogeneity_pvalue(target, continuation_counts(spec, top_k=2, max_tokens=4)) > ALPHA
    assert spec.engine.stats()["spec"]["num_drafted"] > 0

    # Control: a walk that takes each node's first child whatever the target drew commits
    # the drafter's tokens.
    monkeypatch.setattr(tidal.runner, "verify", _accept_first_children)
    assert homogeneity_pvalue(target, continuation_counts(spec, top_k=2, max_tokens=4)) < ALPHA


def _accept_first_children(logits, tokens, ks, st, counters, tree=None):
    """A wrong verifier: the targets are replaced by each node's first child, so the walk
    commits the drafts of the first branch."""
    b, w, _ = logits.shape
    targets, lens, path = real_verify(logits, tokens, ks, st, counters, tree)
    if tree is None:  # (a plain step)
        return targets, lens, path
    parents = tree.parents
    first = torch.zeros(b, w, dtype=torch.int64)
    for i in range(b):
        for q in range(w):
            kids = [c for c in range(1, int(ks[i]) + 1) if int(parents[i, c - 1]) == q]
            first[i, q] = tokens[i, kids[0] - 1] if kids else targets[i, q]
    return accept_tree(first, tokens, tree, ks)


def test_bad_tree_configs(models):
    target = models["target"]
    base = {"method": "draft_model", "model": models["draft_model"], "num_speculative_tokens": 3}
    for extra, field in [({"topk": 0}, "topk"), ({"topk": 2, "num_draft_tokens": 64}, "num_draft_tokens"),
                         ({"num_draft_tokens": 5}, "num_draft_tokens"),
                         ({"topk": 4, "num_draft_tokens": 3}, "topk"),
                         ({"topk": 2, "num_draft_tokens": 11}, "num_draft_tokens"),
                         ({"topk": 2, "num_draft_tokens": 4, "simulate_acceptance": {"mean": 0.9, "sibling": 0.5}},
                          "simulate_acceptance")]:
        with pytest.raises(ValueError, match=f"speculative_config.{field}"):
            LLM(model=target, speculative_config={**base, **extra})
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens: a tree 9 deep"):
        LLM(model=target, speculative_config={**base, "num_speculative_tokens": 9, "topk": 8, "num_draft_tokens": 8})
    with pytest.raises(ValueError, match="speculative_config.topk"):
        LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "topk": 2,
                                              "num_draft_tokens": 4})


def test_simulated_tree_acceptance_takes_children_by_rank():
    """Benchmarks' rule: at a node of depth m its r-th best child is the target's token with
    probability rate[m] * sibling^r. Over a grid of uniforms the root's three children are
    taken in those shares, and none is taken in the rest."""
    n = 10000
    parents = torch.tensor([[0, 0, 0, 1]]).expand(n, 4)
    depth = tree_shape(parents)[0]
    u = ((torch.arange(n) + 0.5) / n)[:, None].expand(n, 5)
    chosen = simulated_choice(parents, torch.full((n,), 4), depth, torch.tensor([[0.3, 0.5]]).expand(n, 2),
                              torch.full((n, 1), 0.9), u)
    at_root = chosen[:, 0].float().mean(0)  # [nodes]: how often each node is taken at the root
    assert torch.allclose(at_root, torch.tensor([0.3, 0.27, 0.243, 0.0]), atol=1e-3)
    assert chosen[:, 1, 3].float().mean() == pytest.approx(0.5, abs=1e-3)  # node 1's only child, at depth 1's rate


def test_simulated_acceptance_with_trees(models):
    """Every best child taken (rate 1, sibling 0): each step accepts a whole path down the
    tree's depth; rate 0 accepts nothing."""
    for rate, check in ((1.0, lambda s: s["mean_accepted_length"] > 3.5), (0.0, lambda s: s["num_accepted"] == 0)):
        llm = LLM(model=models["target"], page_size=4, speculative_config=tree_config(
            models, "draft_model", 3, 2, 6, simulate_acceptance={"mean": rate, "sibling": 0.0}))
        run(llm, repetitive_prompts(), greedy(40))
        spec = llm.engine.stats()["spec"]
        assert spec["num_drafted"] > 0 and check(spec), spec


def test_a_tree_is_priced_by_its_depth_and_its_nodes(models):
    """A tree of K nodes costs the drafter a pass per level it grows (min(depth, K),
    `draft_depth`) and the target K verified tokens, and keeps a slot for each node it feeds
    (`draft_slots`): goodput's start-up profile (which verifies trees) keeps the passes, and a
    wider tree of the same depth adds no drafting price."""
    chain = SpecConfig(method="draft_model", model=models["draft_model"], num_speculative_tokens=4)
    assert [chain.draft_depth(k) for k in range(5)] == [chain.draft_slots(k) for k in range(5)] == [0, 1, 2, 3, 4]
    config = tree_config(models, "draft_model", 5, 4, 16, policy="goodput", profile_seconds=1.0)
    spec = SpecConfig.from_dict(config)
    passes = [0, 1, 2, 3, 4] + [5] * 12
    assert [spec.draft_depth(k) for k in range(17)] == passes
    assert [spec.draft_slots(k) for k in range(17)] == [0, 1, 2, 6, 12] + [16] * 12  # 4 fed a level below the first
    llm = LLM(model=models["target"], page_size=4, max_num_seqs=8, speculative_config=config)
    assert llm.engine.core.scheduler.policy.cost.draft_passes.tolist() == passes
    # Priced as the profile fits it: 1 ms a proposal and 2 ms a pass.
    batch_sizes, widths = grid_axes(8, 16)
    cost = CostModel(batch_sizes, widths, [[5e-3] * len(widths)] * len(batch_sizes), draft_fixed=[1e-3] * 4,
                     draft_step=[2e-3] * 4, draft_passes=passes)
    drafting = [float(cost.step_time(1, k, k, 1, 0.0) - cost.step_time(1, k, k, 0, 0.0)) for k in (1, 4, 5, 16)]
    assert drafting == pytest.approx([3e-3, 9e-3, 11e-3, 11e-3])


def test_a_tree_of_k_nodes_is_the_best_k_of_the_largest(models):
    """Trees are nested: a request drafting K nodes gets the first K nodes (parents too) of
    the tree it would draft at the most, grown in the slots the scheduler keeps for its fed
    nodes, so that what the policy learns of the m-th node's chance holds for every K."""
    # Simulated odds (0.9 for a node's best child, 0.09 for its second) make the best nodes
    # a deep chain's: a tree of 3 nodes is 3 deep.
    llm = LLM(model=models["target"], page_size=4, speculative_config=tree_config(
        models, "draft_model", 3, 3, 8, simulate_acceptance={"mean": 0.9, "sibling": 0.1}))
    runner, proposer = llm.engine.core.runner, llm.engine.core.speculation.proposer
    ks = [8, 7, 5, 4, 3, 2, 1]
    # Each row's pages hold 8 slots past its root: a tree of 3 or 4 nodes uses 6 of them, for
    # the nodes its growth feeds (2 levels of 3), more than the slots it verifies.
    plan = dummy_plan(len(ks), 13, 8, runner)
    for r in plan.requests:
        r.token_ids, r.num_absorbed = list(plan.requests[0].token_ids), 0
        r.simulated_acceptance = [0.9, 0.9, 0.9, 0.1]  # (per depth, then the sibling factor)
    plan.draft_lens[:] = ks
    drafts = proposer.propose(plan, list(range(len(ks))))
    tokens, parents = drafts.tokens.tolist(), drafts.tree.parents.tolist()
    assert parents[0][:3] == [0, 1, 2]
    for i, k in enumerate(ks):
        assert (tokens[i][:k], parents[i][:k]) == (tokens[0][:k], parents[0][:k]), k
    # One node a row is a chain of one, of the largest tree's first node.
    plan.draft_lens[:] = [1] * len(ks)
    for r in plan.requests:
        r.num_absorbed = 0
    chains = proposer.propose(plan, list(range(len(ks))))
    assert chains.tree is None and chains.tokens.tolist() == [[tokens[0][0]]] * len(ks)
