"""Tensor parallelism on the CPU: two ranks over gloo give the greedy tokens of one rank and
of transformers, for a dense, a grouped-query (one kv head, held by both ranks) and a
Mixture-of-Experts model, with and without speculation, and free every page; a rank that
fails ends the engine with its error instead of a hang."""

import multiprocessing
import time

import pytest
import torch.distributed as dist

import failing_rank
import tidal.parallel
from checkpoints import make_eagle3_checkpoint
from test_engine import assert_idle, greedy, hf_greedy, prompts, token_ids
from test_spec import RandomPolicy, truncated_drafter
from tidal import LLM
from tidal.parallel import TensorParallelError
from tidal.speculative.policy import Off

SMALL_CACHE = dict(page_size=4, kv_cache_memory_gb=0.02)


def worker_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tidal-rank-")]


@pytest.fixture
def two_ranks():
    """two_ranks(model, **kwargs): an LLM split over two ranks, shut down after the test (a
    process holds one process group, so one such engine at a time)."""
    made = []

    def make(model, **kwargs):
        made.append(LLM(model=model, tensor_parallel_size=2, **SMALL_CACHE, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()
    assert not worker_processes() and not dist.is_initialized()


def one_rank_and_transformers(model_dir, batch):
    """The greedy tokens of one rank, checked against transformers'."""
    ours = token_ids(LLM(model=model_dir, **SMALL_CACHE).generate(batch, greedy(), use_tqdm=False))
    for prompt, got in zip(batch, ours):
        assert got == hf_greedy(model_dir, prompt, len(got))
        assert len(set(got)) > 4, "greedy output collapsed onto a few tokens: the test would prove little"
    return ours


def test_two_ranks_without_speculation_give_one_ranks_tokens(checkpoint, two_ranks):
    """Llama, prompts longer than a step's budget (chunked: steps where no row samples)."""
    model_dir, batch = checkpoint("llama"), prompts(4)
    want = one_rank_and_transformers(model_dir, batch)
    llm = two_ranks(model_dir, max_num_batched_tokens=16)
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == want
    assert_idle(llm)
    llm.shutdown()
    assert not worker_processes() and not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="the engine was shut down"):
        llm.generate(batch, greedy(), use_tqdm=False)


def test_two_ranks_with_a_draft_model_planned_ahead(checkpoint, two_ranks, tmp_path):
    """Drafts and the tokens of a step still in flight reach the other rank as tensors
    (async scheduling), for a fixed K and for a K per request and step, 0 included."""
    model_dir, batch = checkpoint("llama"), prompts(4, seed=1)
    want = one_rank_and_transformers(model_dir, batch)
    llm = two_ranks(model_dir, async_scheduling=True, speculative_config={
        "method": "draft_model", "model": truncated_drafter(model_dir, tmp_path / "draft", 3),
        "num_speculative_tokens": 3, "policy": "fixed"})
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == want
    llm.engine.core.scheduler.policy = RandomPolicy(seed=3)
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == want
    stats = llm.engine.stats()
    assert stats["spec"]["num_accepted"] > 0 and stats["num_steps_ahead"] > 0
    assert_idle(llm)


@pytest.mark.parametrize("arch, kv_heads, head_embedding", [("qwen3", 1, False), ("qwen3moe", 2, True)])
def test_two_ranks_with_an_eagle3_head(checkpoint, two_ranks, tmp_path, arch, kv_heads, head_embedding):
    """Qwen3 with one kv head (each rank holds it) and a head that borrows the target's
    embedding (whole, read from the checkpoint: the target's is split); Qwen3-MoE (experts
    split within each expert) priced at start-up by goodput's profile, which runs on both
    ranks. K = 0 throughout (no speculation), then a K per request and step."""
    model_dir, batch = checkpoint(arch, num_kv_heads=kv_heads), prompts(3, seed=2)
    want = one_rank_and_transformers(model_dir, batch)
    head = make_eagle3_checkpoint(tmp_path / "eagle3", model_dir, with_embedding=head_embedding)
    policy = {"policy": "goodput", "profile_seconds": 0.5} if arch == "qwen3moe" else {"policy": "fixed"}
    llm = two_ranks(model_dir, speculative_config={"method": "eagle3", "model": str(head),
                                                   "num_speculative_tokens": 2, **policy})
    if arch == "qwen3moe":
        assert llm.engine.core.speculation.cost_model.source.startswith("profile")
    llm.engine.core.scheduler.policy = Off()
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == want
    assert llm.engine.stats()["spec"]["num_drafted"] == 0
    llm.engine.core.scheduler.policy = RandomPolicy(seed=4)
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == want
    assert llm.engine.stats()["spec"]["num_drafted"] > 0
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, error", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size: 3 does not divide num_attention_heads 4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
    (dict(tensor_parallel_size=8), "tensor_parallel_size: 8 does not divide num_attention_heads 4"),
    (dict(tensor_parallel_size=4, device="cuda"), "tensor_parallel_size: 4 is more ranks than the"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "tensor_parallel_size: 2 needs device 'cuda'"),
])
def test_bad_tensor_parallel_sizes_are_value_errors_naming_the_field(checkpoint, kwargs, error):
    with pytest.raises(ValueError, match=error):
        LLM(model=checkpoint("llama"), **kwargs)
    assert not worker_processes() and not dist.is_initialized()


@pytest.mark.parametrize("when", ["at_start", "in_a_step"])
def test_a_failing_rank_ends_the_engine_with_its_error(checkpoint, monkeypatch, when):
    """The other rank raises while building its runner, or in a step's forward while rank 0
    waits for it in a collective: the engine raises that error (its traceback names the
    rank), stops, and leaves no process or process group behind."""
    monkeypatch.setattr(tidal.parallel, "run_worker", getattr(failing_rank, f"failing_{when}"))
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed") as raised:
        llm = LLM(model=checkpoint("llama"), tensor_parallel_size=2, **SMALL_CACHE)
        llm.generate(prompts(2), greedy(), use_tqdm=False)
    assert "a failure injected into this rank" in str(raised.value)
    assert time.monotonic() - started < 60
    assert not worker_processes() and not dist.is_initialized()
    if when == "in_a_step":
        with pytest.raises(TensorParallelError, match="the tensor-parallel ranks have stopped"):
            llm.generate(prompts(1), greedy(), use_tqdm=False)
        llm.shutdown()
