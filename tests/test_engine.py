"""The engine against Hugging Face transformers, and the scheduler's promises: batch
composition, chunked prefill, preemption and prefix caching leave greedy outputs unchanged,
and every KV page is free when the engine is idle."""

import gc
import random

import pytest
import torch
import transformers

from tidal import LLM, SamplingParams

NEW_TOKENS = 24


def prompts(n=4, seed=0, vocab=384, lengths=(3, 17, 40, 9, 25, 1)):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def greedy(max_tokens=NEW_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm):
    stats = llm.engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] == stats["num_pages"], "KV pages leaked"


def hf_greedy(model_dir, prompt, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(checkpoint, arch):
    model_dir = checkpoint(arch)
    batch = prompts(4)
    llm = LLM(model=model_dir, dtype="float32", page_size=8, max_num_batched_tokens=64)
    ours = token_ids(llm.generate(batch, greedy(), use_tqdm=False))
    for prompt, got in zip(batch, ours):
        want = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert got == want
        assert len(set(got)) > 4, "greedy output collapsed onto a few tokens: the test would prove little"
    assert_idle(llm)


def test_tied_and_sharded_checkpoint(checkpoint):
    model_dir = checkpoint("qwen2", tie_embeddings=True, sharded=True)
    batch = prompts(2, seed=3)
    llm = LLM(model=model_dir, page_size=8)
    ours = token_ids(llm.generate(batch, greedy(), use_tqdm=False))
    assert ours == [hf_greedy(model_dir, p, NEW_TOKENS) for p in batch]


def test_batch_composition_and_chunking_do_not_change_greedy_outputs(checkpoint):
    model_dir = checkpoint("llama")
    batch = prompts(6, seed=1)
    alone = [token_ids(LLM(model=model_dir, page_size=4).generate([p], greedy(), use_tqdm=False))[0]
             for p in batch[:3]]
    together = LLM(model=model_dir, page_size=4)
    assert token_ids(together.generate(batch, greedy(), use_tqdm=False))[:3] == alone
    # Tiny token budget: prefills are chunked and mixed with decodes.
    chunked = LLM(model=model_dir, page_size=4, max_num_batched_tokens=7, max_num_seqs=3)
    assert token_ids(chunked.generate(batch, greedy(), use_tqdm=False))[:3] == alone
    assert_idle(together)
    assert_idle(chunked)


def test_preemption_keeps_outputs_and_frees_pages(checkpoint):
    model_dir = checkpoint("llama")
    batch = prompts(6, seed=2)
    roomy = LLM(model=model_dir, page_size=4)
    want = token_ids(roomy.generate(batch, greedy(), use_tqdm=False))
    tight = LLM(model=model_dir, page_size=4, num_pages=32, max_model_len=120, enable_prefix_caching=False)
    got = token_ids(tight.generate(batch, greedy(), use_tqdm=False))
    assert tight.engine.core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert got == want
    assert_idle(tight)


def test_prefix_cache_reuses_pages(checkpoint):
    model_dir = checkpoint("llama")
    prefix = prompts(1, seed=4, lengths=(40,))[0]
    llm = LLM(model=model_dir, page_size=8)
    first = llm.generate([prefix + [5, 6, 7]], greedy(), use_tqdm=False)[0]
    hits_before = llm.engine.core.pool.prefix_hits
    second = llm.generate([prefix + [5, 6, 7]], greedy(), use_tqdm=False)[0]
    # 43 prompt tokens: 5 full pages of 8 can be reused (at least one token is recomputed).
    assert llm.engine.core.pool.prefix_hits - hits_before == 5
    assert second.metrics["num_cached_prompt_tokens"] == 40
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    cold = LLM(model=model_dir, page_size=8, enable_prefix_caching=False)
    assert cold.generate([prefix + [5, 6, 7]], greedy(), use_tqdm=False)[0].outputs[0].token_ids == \
        first.outputs[0].token_ids
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoint):
    model_dir = checkpoint("llama")
    batch = prompts(4, seed=5)
    llm = LLM(model=model_dir, page_size=8)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_ids(llm.generate(batch[:1], params, use_tqdm=False))[0]
    mixed = token_ids(llm.generate(batch[::-1], params, use_tqdm=False))[-1]
    assert alone == mixed
    other = token_ids(llm.generate(batch[:1], SamplingParams(temperature=0.9, seed=99, max_tokens=16,
                                                               ignore_eos=True), use_tqdm=False))[0]
    assert other != alone


def test_stop_token_ids_max_tokens_and_text(checkpoint):
    model_dir = checkpoint("llama")
    llm = LLM(model=model_dir, page_size=8)
    base = llm.generate(["The quick brown fox"], greedy(), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == NEW_TOKENS
    assert base.text == llm.tokenizer.decode(base.token_ids)
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    stopped = llm.generate(["The quick brown fox"], greedy(stop_token_ids=(stop_at,)), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert stopped.token_ids == base.token_ids[:first + 1]
    text = base.text
    needle = text[len(text) // 2:len(text) // 2 + 3]
    if needle.strip():
        cut = llm.generate(["The quick brown fox"], greedy(stop=(needle,)), use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == needle
        assert cut.text == text[:text.index(needle)]
    assert_idle(llm)


def test_streaming_requests_get_every_step_others_their_result(checkpoint):
    llm = LLM(model=checkpoint("llama"), page_size=8)
    engine = llm.engine
    streamed = engine.make_request("The quick brown fox", greedy(), stream=True)
    quiet = engine.make_request("The quick brown fox", greedy())
    engine.add_request(streamed)
    engine.add_request(quiet)
    seen = {streamed.request_id: [], quiet.request_id: []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[quiet.request_id]) == 1 and seen[quiet.request_id][0].finished
    chunks = seen[streamed.request_id]
    assert len(chunks) == NEW_TOKENS and chunks[-1].finished
    final = seen[quiet.request_id][0].outputs[0]
    assert "".join(c.outputs[0].delta for c in chunks) == chunks[-1].outputs[0].text == final.text
    assert chunks[-1].outputs[0].token_ids == final.token_ids
    assert_idle(llm)


def test_logprobs(checkpoint):
    llm = LLM(model=checkpoint("llama"), page_size=8)
    out = llm.generate([[5, 6, 7]], greedy(max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == token
        assert max(entry.values()) == entry[token]  # greedy picks the most likely token
        assert all(v <= 0 for v in entry.values())


def test_bad_inputs_raise_value_errors_naming_the_field(checkpoint):
    model_dir = checkpoint("llama")
    llm = LLM(model=model_dir, page_size=8, max_model_len=64)
    cases = {
        "max_tokens": lambda: SamplingParams(max_tokens=0),
        "temperature": lambda: SamplingParams(temperature=-1),
        "top_p": lambda: SamplingParams(top_p=0),
        "top_k": lambda: SamplingParams(top_k=-2),
        "prompt": lambda: llm.generate([[], [1, 2]], greedy(), use_tqdm=False),
    }
    for field, call in cases.items():
        with pytest.raises(ValueError, match=field):
            call()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 70))], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_tokens: 40 prompt tokens \+ max_tokens 25 are more than max_model_len 64"):
        llm.generate([list(range(3, 43))], greedy(max_tokens=25), use_tqdm=False)  # never capped silently
    with pytest.raises(ValueError, match="max_model_len: 4096 is more than the model's context of"):
        LLM(model=model_dir, max_model_len=4096)
    with pytest.raises(ValueError, match="KV cache has 7 pages of 8 tokens, fewer than one request of max_model_len 64"):
        LLM(model=model_dir, page_size=8, max_model_len=64, num_pages=8)
    with pytest.raises(ValueError, match="speculative_config: not valid JSON"):
        LLM(model=model_dir, speculative_config='{"method": "ngram",')
    assert LLM(model=model_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}') \
        .engine.config.speculative_config.method == "ngram"  # the JSON text of a config is one too
    with pytest.raises(ValueError, match="does not exist: tidal reads checkpoints from a local folder"):
        LLM(model="meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=model_dir, dtype="int7")
    with pytest.raises(ValueError, match="device"):
        LLM(model=model_dir, device="tpu")
    # A rejected batch left nothing behind; the engine still serves.
    assert_idle(llm)
    assert len(llm.generate([[3, 4, 5]], greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_async_scheduling_changes_no_output(checkpoint):
    """Planning each plain decode step while the one before runs (its input tokens still on
    the device) gives the outputs of the synchronous engine: requests ending at different
    steps by length, by a stop token and by a stop string, and seeded sampling."""
    model_dir = checkpoint("llama")
    batch = prompts(6, seed=11)
    probe = [o.outputs[0] for o in LLM(model=model_dir, page_size=8).generate(batch, greedy(), use_tqdm=False)]
    params = [greedy(max_tokens=5), greedy(stop_token_ids=(probe[1].token_ids[7],)),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
              greedy(stop=(probe[3].text[-9:-6],)), greedy(max_tokens=1), greedy(logprobs=2)]
    runs, logprobs = {}, {}
    for overlap in (False, True):
        llm = LLM(model=model_dir, page_size=8, async_scheduling=overlap)
        outs = llm.generate(batch, params, use_tqdm=False)
        runs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
        logprobs[overlap] = outs[-1].outputs[0].logprobs
        assert (llm.engine.stats()["num_steps_ahead"] > 0) == overlap
        assert_idle(llm)
    assert runs[True] == runs[False]
    # A batch of another composition rounds differently: logprobs agree to float32 noise.
    for a, b in zip(logprobs[True], logprobs[False], strict=True):
        assert list(a) == list(b) and a == pytest.approx(b, abs=1e-4)
    assert [r[1] for r in runs[True]] == ["length", "stop", "length", "stop", "length", "length"]


def test_a_cpu_step_returns_the_forward_it_ran(checkpoint):
    """A CPU forward runs as it is launched, so by default nothing is queued behind it: each
    step runs one forward and returns its tokens, not held back behind the next one's."""
    llm = LLM(model=checkpoint("llama"), page_size=8)
    engine, launches = llm.engine, []
    launch = engine.core.runner.launch
    engine.core.runner.launch = lambda *args: launches.append(1) or launch(*args)
    engine.add_request(engine.make_request([3, 4, 5], greedy(max_tokens=4), stream=True))
    for n in range(1, 5):
        out = engine.step()
        assert len(launches) == 1 and [len(o.outputs[0].token_ids) for o in out] == [n]
        launches.clear()
    assert not engine.has_unfinished() and engine.stats()["num_steps_ahead"] == 0


def test_abort_while_a_step_is_queued_ahead(checkpoint):
    llm = LLM(model=checkpoint("llama"), page_size=8, async_scheduling=True)
    engine = llm.engine
    reqs = [engine.make_request(p, greedy()) for p in prompts(3, seed=2)]
    for req in reqs:
        engine.add_request(req)
    while engine.core.num_steps_ahead == 0:
        engine.step()
    assert engine.core.in_flight is not None
    assert engine.abort(reqs[1].request_id).finished
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    assert sorted(done) == [reqs[0].request_id, reqs[2].request_id]
    alone = llm.generate([reqs[2].token_ids[:reqs[2].num_prompt_tokens]], greedy(), use_tqdm=False)[0]
    assert done[reqs[2].request_id].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(llm)


def test_sampling_tensors_are_built_once_per_set_of_rows(checkpoint, monkeypatch):
    """A drafting step asks for its drafting rows' and its sampling rows' tensors; while the
    two sets alternate from step to step, neither is built again."""
    from tidal.layers import sampler

    engine = LLM(model=checkpoint("llama"), page_size=8).engine
    runner, builds, real = engine.core.runner, [], sampler.SamplingTensors.build
    monkeypatch.setattr(sampler.SamplingTensors, "build", lambda *a: builds.append(1) or real(*a))
    reqs = [engine.make_request(p, greedy()) for p in prompts(3)]
    drafting, sampling = reqs[:2], reqs
    first = [runner.sampling_tensors(drafting), runner.sampling_tensors(sampling)]
    for _ in range(3):
        assert runner.sampling_tensors(drafting) is first[0] and runner.sampling_tensors(sampling) is first[1]
    assert len(builds) == 2
    runner.sampling_tensors(reqs[1:])  # a third set pushes out the one used longest ago
    assert runner.sampling_tensors(sampling) is first[1] and len(builds) == 3
    assert runner.sampling_tensors(drafting) is not first[0] and len(builds) == 4


def test_generate_freezes_the_start_up_heap_and_thaws_it(checkpoint):
    """While generate runs, the objects that existed before it are out of the collector's
    scans (a full scan of them is a stall mid-step); afterwards they are back, so that an
    engine dropped later is collected even if it sits in a reference cycle."""
    llm = LLM(model=checkpoint("llama"), dtype="float32", num_pages=64)
    frozen = []
    step = llm.engine.step
    llm.engine.step = lambda: frozen.append(gc.get_freeze_count()) or step()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert min(frozen) > 1000 and gc.get_freeze_count() == 0


@pytest.mark.parametrize("budget", [8, 100, 1024, 1100, 2048, 3000, 8192])
def test_piecewise_buckets_cover_the_budget_with_bounded_padding(budget):
    """Prompt steps replay graphs up to the budget (or PIECEWISE_MAX_TOKENS): the buckets rise
    to it, and past 1,024 tokens a step is padded by at most a quarter of its tokens."""
    from tidal.graphs import PIECEWISE_BUCKETS, PIECEWISE_MAX_TOKENS, piecewise_buckets

    buckets = piecewise_buckets(budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] == min(budget, PIECEWISE_MAX_TOKENS)
    assert [t for t in buckets[:-1] if t <= 1024] == [t for t in PIECEWISE_BUCKETS if t < min(budget, 1025)]
    for smaller, larger in zip(buckets, buckets[1:]):
        if smaller >= 1024:
            assert larger - (smaller + 1) < (smaller + 1) / 4  # the worst padding: one past `smaller`
