"""A seeded sampled request's tokens are a function of its prompt, sampling parameters and
seed alone: the same without speculation and under every proposer, K schedule, batch and
scheduling mode, in the engine and through the server's stream (on the trained demo pair,
whose drafts are often accepted, so that the schedules really differ)."""

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from openai import AsyncOpenAI
from safetensors.torch import load_file, save_file

import tidal
from tidal import LLM, EngineConfig, SamplingParams
from tidal.server import AsyncEngine, build_app
from tidal.speculative.cost_model import CostModel, grid_axes
from test_server import uvicorn_thread

PAIR = Path(tidal.__file__).parent / "demo_pair"
TARGET = str(PAIR / "target")
PROMPTS = ["Tell me about the ocean.", "Once upon a time", "The best way to learn", "Why is the sky blue?"]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1000 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    """The demo target's first 2 layers (with its embedding and head): a draft model that
    agrees with it often."""
    out = tmp_path_factory.mktemp("demo-draft")
    config = json.loads((PAIR / "target" / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(PAIR / "target" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2},
              str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PAIR / "target" / name, out / name)
    return str(out)


def tokens(llm, together: bool) -> list[list[int]]:
    if together:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]
    return [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, SEEDED)]


@pytest.fixture(scope="module")
def plain():
    return tokens(LLM(model=TARGET), together=False)


def free_drafts(llm) -> None:
    """Price every step alike, whatever its width: goodput then drafts as each request's
    acceptance estimate says (K moving per request and step), not as this CPU's timings
    say, where a drafter is often not worth its time and goodput rightly stays at K = 0."""
    axes = grid_axes(llm.engine.core.config.max_num_seqs, llm.engine.core.config.speculative_config.num_speculative_tokens)
    flat = np.full((len(axes[0]), len(axes[1])), 0.01)
    llm.engine.core.scheduler.policy.cost = CostModel(*axes, grid=flat, correct_online=False)


# K = 2 is among the K goodput draws per request and step (0 to 4, `free_drafts`), beside
# fixed K = 1 and 4; "off" never calls the proposer, so one drafter's case covers it.
@pytest.mark.parametrize("method, policy", [("eagle3", "off"), ("eagle3", "fixed:1"), ("eagle3", "fixed:4"),
                                            ("eagle3", "goodput"), ("draft_model", "fixed:1"),
                                            ("draft_model", "fixed:4"), ("draft_model", "goodput")])
def test_seeded_outputs_do_not_depend_on_speculation(method, policy, drafter, plain):
    k = int(policy.split(":")[1]) if policy.startswith("fixed") else 4
    spec = {"method": method, "model": str(PAIR / "eagle3") if method == "eagle3" else drafter,
            "num_speculative_tokens": k, "policy": policy.split(":")[0]}
    if policy == "goodput":
        spec["cost_model"] = "online"  # no start-up profile: `free_drafts` prices the steps
    for async_scheduling in (True, False):
        llm = LLM(model=TARGET, speculative_config=spec, async_scheduling=async_scheduling)
        if policy == "goodput":
            free_drafts(llm)
        assert tokens(llm, together=True) == plain
        assert tokens(llm, together=False) == plain
        if policy != "off":
            assert llm.engine.stats()["spec"]["num_accepted"] > 0  # drafts were verified and accepted


def test_seeded_streams_through_the_server_equal_plain_outputs(plain):
    config = EngineConfig(model=TARGET, device="cpu", speculative_config={
        "method": "eagle3", "model": str(PAIR / "eagle3"), "num_speculative_tokens": 4})  # goodput

    async def one(client, prompt, params):
        stream = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all(url):
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, sp) for p, sp in zip(PROMPTS, SEEDED)))

    engine = AsyncEngine(config)
    with uvicorn_thread(build_app(engine, "demo")) as url:
        texts = asyncio.run(run_all(url))
    assert texts == [engine.tokenizer.decode(t) for t in plain]
