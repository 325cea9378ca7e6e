"""Speculative decoding through the one step contract: every proposer, any K schedule,
greedy outputs identical to plain decoding; sampled outputs distributed as the target's;
KV pages all free afterwards."""

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tidal.runner
from checkpoints import make_eagle3_checkpoint
from stats import homogeneity_pvalue
from tidal import LLM, SamplingParams
from tidal.speculative.policy import Choice, NoFeedback
import tidal.speculative.verify as verify_module
from tidal.speculative.verify import verify as real_verify

NEW_TOKENS = 28


def truncated_drafter(target_dir: str, out_dir: Path, num_layers: int) -> str:
    """The target's own first layers (and its embedding and head): a drafter that agrees
    with the target often, but not always."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    weights = {}
    for f in Path(target_dir).glob("*.safetensors"):
        weights |= load_file(f)
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(out_dir / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(target_dir) / name, out_dir / name)
    return str(out_dir)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    target = checkpoint("llama")
    root = tmp_path_factory.mktemp("drafters")
    return {
        "target": target,
        "draft_model": truncated_drafter(target, root / "draft", 3),
        "eagle3": str(make_eagle3_checkpoint(root / "eagle3", target)),
    }


def spec_config(models, method, k, **extra):
    """A fixed K unless `extra` says otherwise: these tests drive the engine through known K schedules."""
    cfg = {"method": method, "num_speculative_tokens": k, "policy": "fixed", **extra}
    if method != "ngram":
        cfg["model"] = models[method]
    return cfg


def repetitive_prompts():
    """Mixed lengths; repeated phrases give the n-gram proposer something to find."""
    rng = random.Random(7)
    phrase = [rng.randrange(3, 384) for _ in range(6)]
    return [phrase * 3, [rng.randrange(3, 384) for _ in range(21)], phrase + [9, 10] + phrase, [5, 6, 7]]


def greedy(max_tokens=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"], "KV pages leaked"
    return [o.outputs[0].token_ids for o in outs], outs


class RandomPolicy(NoFeedback):
    """A K_i per request per step, 0 included: the engine must not care."""

    name = "random"

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.chosen = []

    def choose(self, requests, limits, num_waiting, kv_room=None):
        ks = [self.rng.randint(0, limit) for limit in limits]
        self.chosen.append(ks)
        return Choice(ks)


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(model=models["target"], page_size=4)
    return run(llm, repetitive_prompts(), greedy())[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_lossless_for_every_k(models, plain, method):
    for k in range(1, 7):
        llm = LLM(model=models["target"], page_size=4, speculative_config=spec_config(models, method, k))
        got, _ = run(llm, repetitive_prompts(), greedy())
        assert got == plain, f"{method} K={k} changed the greedy output"
        if method == "draft_model":
            spec = llm.engine.stats()["spec"]
            assert 0 < spec["num_accepted"] < spec["num_drafted"], "want both acceptance and rejection"


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_lossless_with_random_k_per_request(models, plain, method):
    llm = LLM(model=models["target"], page_size=4, speculative_config=spec_config(models, method, 5))
    policy = RandomPolicy(seed=11)
    llm.engine.core.scheduler.policy = policy
    got, outs = run(llm, repetitive_prompts(), greedy())
    assert got == plain
    mixed = [ks for ks in policy.chosen if len(set(ks)) > 1 and 0 in ks]
    assert mixed, "the schedule should mix K = 0 and K > 0 inside one step"
    if method != "ngram":
        # Steps at K = 0 were followed by drafting again: the drafter caught up lazily.
        assert llm.engine.stats()["spec"]["num_steps"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_lossless_when_drafts_share_a_step_with_a_prompt_chunk(models, plain, method):
    """A small token budget chunks the long prompts while the short ones already draft:
    drafting rows and rows that sample nothing share steps, greedy and sampling (the runner
    then verifies only the rows that sample)."""
    llm = LLM(model=models["target"], page_size=4, max_num_batched_tokens=10,
              speculative_config=spec_config(models, method, 3))
    if method == "ngram":
        llm.engine.core.speculation.proposer.lookup = lambda tokens, n: [3] * n  # always propose something
    launch, shared = llm.engine.core.runner.launch, []

    def recording(plan, drafts=None, *args, **kwargs):
        samples = [plan.samples(i) for i in range(len(plan.requests))]
        shared.append(any(plan.draft_lens) and not all(samples))
        return launch(plan, drafts, *args, **kwargs)

    llm.engine.core.runner.launch = recording
    got, _ = run(llm, repetitive_prompts(), greedy())
    assert got == plain
    assert any(shared), "no step had both drafts and a prompt chunk"
    shared.clear()
    fresh = [p[::-1] for p in repetitive_prompts()]  # not in the prefix cache: chunked again
    sampled, _ = run(llm, fresh, SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True, seed=5))
    assert [len(t) for t in sampled] == [NEW_TOKENS] * len(plain) and any(shared)


@pytest.mark.parametrize("method", [None, "draft_model", "eagle3"])
def test_prompts_admitted_beside_a_step_in_flight_change_no_output(models, method):
    """With async scheduling a request that waits for a seat is admitted into the step
    planned while the one before runs (its whole prompt beside rows fed from the device),
    instead of waiting, device idle, for the step to end. Greedy outputs, plain and
    drafted, equal the synchronous engine's, and no page leaks."""
    prompts = repetitive_prompts() + [[11, 12, 13, 14, 15, 16, 17, 18, 19]]
    params = [greedy(max_tokens=n) for n in (6, 17, 9, 28, 12)]
    spec = spec_config(models, method, 3) if method else None
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model=models["target"], page_size=4, max_num_seqs=2, async_scheduling=overlap,
                  speculative_config=spec)
        launch, admitted_ahead = llm.engine.core.runner.launch, []

        def recording(plan, drafts=None, ahead=None):
            admitted_ahead.append(ahead is not None and ahead.carried < len(plan.requests))
            return launch(plan, drafts, ahead)

        llm.engine.core.runner.launch = recording
        outputs[overlap] = run(llm, prompts, params)[0]
        assert any(admitted_ahead) == overlap, "want prompts admitted beside a step in flight"
    assert outputs[True] == outputs[False]
    assert [len(t) for t in outputs[True]] == [6, 17, 9, 28, 12]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_steps_drafted_ahead_of_a_verification_change_no_output(models, method, monkeypatch):
    """With async scheduling a step is planned and drafted for while the verification
    before it runs, as if every draft there were accepted, and moved back on the device by
    those rejected. Greedy outputs (ending by length and by a stop token) equal the
    synchronous engine's, no page leaks, and the random-draw counters the device derives
    for sampled rows, in the drafter and in verification, are each row's true output count.
    (Sampled outputs themselves are not compared: planning ahead starts a request's drafting
    one step later, and another K schedule draws other random numbers.)"""
    prompts = repetitive_prompts()
    probe = run(LLM(model=models["target"], page_size=4), prompts, greedy())[0]
    stop = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=(probe[1][12],))
    params = [greedy(max_tokens=9), stop, greedy()]
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model=models["target"], page_size=4, async_scheduling=overlap,
                  speculative_config=spec_config(models, method, 3))
        launch, behind_drafts = llm.engine.core.runner.launch, []

        def recording(plan, drafts=None, ahead=None):
            behind_drafts.append(ahead is not None and ahead.rejected is not None)
            return launch(plan, drafts, ahead)

        llm.engine.core.runner.launch = recording
        outputs[overlap] = run(llm, prompts[:3], params)[0]
        assert any(behind_drafts) == overlap, "want steps planned ahead of drafting ones"
    assert outputs[True] == outputs[False] == [probe[0][:9], probe[1][:13], probe[2]]

    seen = {"verify": [], "draft": [], "true": []}
    proposer = llm.engine.core.speculation.proposer
    propose, pick, commit = proposer.propose, proposer._pick, llm.engine.core.scheduler.commit

    def verify(logits, tokens, ks, st, counters, tree=None):
        if tokens.shape[1]:  # (a plain step samples through verify at K = 0)
            seen["verify"].append(counters.tolist())
        return real_verify(logits, tokens, ks, st, counters, tree)

    def proposing(plan, rows, ahead=None):
        seen["first draft"] = True
        return propose(plan, rows, ahead)

    def drafting_pick(logits, j, sampled):
        if seen.pop("first draft", False):
            assert j == 0 and sampled
            seen["draft"].append(proposer.counters[:len(logits)].tolist())
        return pick(logits, j, sampled)

    def committing(plan, result, in_flight=None):
        seen["true"].append((plan.draft_lens[:], [r.num_output_tokens for r in plan.requests]))
        return commit(plan, result, in_flight)

    monkeypatch.setattr(tidal.runner, "verify", verify)
    monkeypatch.setattr(proposer, "_pick", drafting_pick)
    monkeypatch.setattr(proposer, "propose", proposing)
    monkeypatch.setattr(llm.engine.core.scheduler, "commit", committing)
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in range(3)]
    run(llm, prompts[:3], sampled)
    drafting = [(ks, true) for ks, true in seen["true"] if any(ks)]
    assert seen["verify"] == [true for _, true in drafting]
    assert seen["draft"] == [[n for n, k in zip(true, ks) if k] for ks, true in drafting]
    assert any(behind_drafts[-len(seen["true"]):])


def test_a_drafter_equal_to_the_target_has_every_sampled_draft_accepted(models):
    """Sampled drafts are drawn with the noise of the target's own draw at the same output
    index, so a drafter that is the target agrees with it on every draft, at every draft
    position, for sampled and greedy rows sharing a step, planned ahead or not."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True)
              for s, t in enumerate((0.8, 1.3, 0.0, 0.6))]
    for async_scheduling in (True, False):
        llm = LLM(model=models["target"], page_size=4, async_scheduling=async_scheduling,
                  speculative_config={"method": "draft_model", "model": models["target"],
                                      "num_speculative_tokens": 3, "policy": "fixed"})
        run(llm, repetitive_prompts(), params)
        spec = llm.engine.stats()["spec"]
        assert spec["num_drafted"] > 0 and spec["num_accepted"] == spec["num_drafted"]


def test_proposer_not_called_when_every_k_is_zero(models, plain, monkeypatch):
    llm = LLM(model=models["target"], page_size=4,
              speculative_config=spec_config(models, "draft_model", 4, policy="off"))
    monkeypatch.setattr(llm.engine.core.speculation.proposer, "propose", lambda *a: pytest.fail("proposer called at K = 0"))
    got, _ = run(llm, repetitive_prompts(), greedy())
    assert got == plain
    assert llm.engine.stats()["spec"]["num_drafted"] == 0


def test_catch_up_after_off_periods_is_lossless(models, plain):
    """Drafting on for a few steps, then off for a few, repeatedly."""
    class Bursts(NoFeedback):
        name = "bursts"
        step = 0

        def choose(self, requests, limits, num_waiting, kv_room=None):
            self.step += 1
            on = (self.step // 3) % 2 == 0
            return Choice([limit if on else 0 for limit in limits])

    for method in ("draft_model", "eagle3"):
        llm = LLM(model=models["target"], page_size=4, speculative_config=spec_config(models, method, 3))
        llm.engine.core.scheduler.policy = Bursts()
        got, _ = run(llm, repetitive_prompts(), greedy())
        assert got == plain


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_catch_up_larger_than_a_forward_is_split_and_drafts_the_same(models, plain, method):
    """A drafter that missed more than a forward may take (a whole prompt, K = 0 spells)
    absorbs it in forwards of at most `absorb_tokens`, and drafts what one forward drafts."""
    drafts, sizes = {}, {}
    for absorb in (1 << 20, 8):
        llm = LLM(model=models["target"], page_size=4, speculative_config=spec_config(models, method, 3))
        proposer = llm.engine.core.speculation.proposer
        proposer.absorb_tokens = absorb
        forward, propose = proposer.forward, proposer.propose
        sizes[absorb], drafts[absorb] = [], []

        def recording_forward(batch, state, sizes=sizes[absorb], forward=forward):
            sizes.append(batch.num_tokens)
            return forward(batch, state)

        def recording_propose(plan, rows, ahead=None, drafts=drafts[absorb], propose=propose):
            out = propose(plan, rows, ahead)
            drafts.append([out.tokens[i, :k].tolist() for i, k in enumerate(out.lens)])
            return out

        proposer.forward, proposer.propose = recording_forward, recording_propose
        got, _ = run(llm, repetitive_prompts(), greedy())
        assert got == plain
    assert drafts[8] == drafts[1 << 20]
    assert max(sizes[1 << 20]) > 20 and max(sizes[8]) <= 4 * (3 + 2)  # 8 absorbed, or the last K + 2 of 4 rows


def test_preemption_and_prefix_cache_with_speculation(models, plain):
    llm = LLM(model=models["target"], page_size=4, num_pages=28, max_model_len=96,
              speculative_config=spec_config(models, "draft_model", 4))
    got, _ = run(llm, repetitive_prompts(), greedy())
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert got == plain
    again, _ = run(llm, repetitive_prompts()[:1], greedy())  # prefix-cache hit, drafter catches up
    assert again[0] == plain[0]


def test_acceptance_statistics(models):
    llm = LLM(model=models["target"], page_size=4, speculative_config=spec_config(models, "draft_model", 3))
    _, outs = run(llm, repetitive_prompts(), greedy())
    per_request = [o.metrics["spec"] for o in outs]
    server = llm.engine.stats()["spec"]
    assert sum(s["num_drafted"] for s in per_request) == server["num_drafted"]
    assert sum(s["num_accepted"] for s in per_request) == server["num_accepted"]
    rates = server["acceptance_per_position"]
    assert len(rates) == 3 and all(0 <= r <= 1 for r in rates)
    assert 1 <= server["mean_accepted_length"] <= 4


def test_simulated_acceptance(models):
    a, k = 0.7, 4
    llm = LLM(model=models["target"], page_size=4,
              speculative_config=spec_config(models, "ngram", k, simulate_acceptance=a))
    llm.engine.core.speculation.proposer.lookup = lambda tokens, n: [3] * n  # always propose something
    run(llm, repetitive_prompts() * 4, greedy(64))
    spec = llm.engine.stats()["spec"]
    # Accepted drafts per step: geometric, truncated at K (steps near max_tokens draft fewer).
    expected = sum(a ** m for m in range(1, k + 1))
    assert abs((spec["mean_accepted_length"] - 1) - expected) < 0.35
    assert all(abs(r - a) < 0.1 for r in spec["acceptance_per_position"][:1])


def continuation_counts(llm, n=800, top_k=3, max_tokens=3):
    """Distribution of the continuations of one prompt over n seeds (at most top_k **
    max_tokens outcomes; every token after the first can come from a verified draft)."""
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=max_tokens, ignore_eos=True, seed=s)
              for s in range(n)]
    outs = llm.generate([[5, 6, 7, 8]] * n, params, use_tqdm=False)
    counts = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_speculation_on_a_moe_target_is_lossless(checkpoint, tmp_path, arch):
    """A draft model (the MoE target's own first layers) and an EAGLE-3 head on a
    Mixture-of-Experts target, K random per request and step: greedy outputs are the plain
    ones, and so are seeded sampled ones (each position is the target's own seeded draw)."""
    target = checkpoint(arch)
    drafters = {"draft_model": truncated_drafter(target, tmp_path / "draft", 2),
                "eagle3": str(make_eagle3_checkpoint(tmp_path / "eagle3", target))}
    prompts = repetitive_prompts()
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = LLM(model=target, page_size=4)
    want_greedy, want_seeded = run(plain, prompts, greedy())[0], run(plain, prompts, seeded)[0]
    for method, drafter in drafters.items():
        llm = LLM(model=target, page_size=4, speculative_config={
            "method": method, "model": drafter, "num_speculative_tokens": 3, "policy": "fixed"})
        llm.engine.core.scheduler.policy = RandomPolicy(seed=5)
        assert run(llm, prompts, greedy())[0] == want_greedy, f"{method} changed the greedy output"
        assert run(llm, prompts, seeded)[0] == want_seeded, f"{method} changed the seeded output"
        assert llm.engine.stats()["spec"]["num_drafted"] > 0


ALPHA = 0.001  # significance level of the sampling-losslessness test


def test_sampling_is_lossless_and_the_test_detects_a_wrong_verifier(models, monkeypatch):
    target = continuation_counts(LLM(model=models["target"], page_size=4, max_num_seqs=256))
    spec = LLM(model=models["target"], page_size=4, max_num_seqs=256,
               speculative_config=spec_config(models, "draft_model", 2))
    drafted = continuation_counts(spec)
    assert spec.engine.stats()["spec"]["num_drafted"] > 0
    assert homogeneity_pvalue(target, drafted) > ALPHA, (target, drafted)

    # Control: a verifier that accepts every draft samples the drafter's distribution.
    def accept_all(logits, tokens, ks, st, counters, tree=None):
        return real_verify(logits, tokens, ks, replace(st, simulated=torch.ones(tokens.shape)), counters)

    monkeypatch.setattr(tidal.runner, "verify", accept_all)
    wrong = continuation_counts(spec)
    assert homogeneity_pvalue(target, wrong) < ALPHA


def test_sampling_is_lossless_with_a_k_per_request_and_the_test_detects_shared_noise(models, monkeypatch):
    """Rows drafting different K (0 included) in one step, sampled: outputs are distributed
    as the target's. Control: a verifier whose draws ignore the request's seed (the rows of
    a step raced against the same noise) must be caught."""
    shape = dict(n=3000, top_k=2, max_tokens=5)
    target = continuation_counts(LLM(model=models["target"], page_size=4, max_num_seqs=256), **shape)
    spec = LLM(model=models["target"], page_size=4, max_num_seqs=256,
               speculative_config=spec_config(models, "draft_model", 3))
    spec.engine.core.scheduler.policy = RandomPolicy(seed=3)
    assert homogeneity_pvalue(target, continuation_counts(spec, **shape)) > ALPHA
    assert spec.engine.stats()["spec"]["acceptance_per_position"][1] > 0, "want rows verifying 2+ drafts"
    draw = verify_module.sample
    monkeypatch.setattr(verify_module, "sample",
                        lambda logits, st, counters: draw(logits, replace(st, seeds=st.seeds * 0), counters))
    assert homogeneity_pvalue(target, continuation_counts(spec, **shape)) < ALPHA


def test_bad_speculative_configs(models, tmp_path):
    target = models["target"]
    cases = [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 100}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "policy": "sometimes"}, "policy"),
        ({"method": "ngram", "num_speculative_tokens": 2, "policy": "table"}, "table"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ({"method": "eagle3", "model": target, "num_speculative_tokens": 2}, "EAGLE-3"),
        ({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}, "config.json"),
    ]
    for cfg, needle in cases:
        with pytest.raises(ValueError, match=needle):
            LLM(model=target, speculative_config=cfg)
    # A drafter with another vocabulary.
    from checkpoints import make_checkpoint
    other = make_checkpoint(tmp_path / "other", "llama", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=target, speculative_config={"method": "draft_model", "model": str(other),
                                              "num_speculative_tokens": 2})
