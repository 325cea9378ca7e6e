"""The GPU benchmark scripts on tiny shapes on the CPU (`--smoke`): a script that no longer
runs would otherwise be found only when device time is spent on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: str, out: Path, *args: str) -> str:
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "benchmarks", ROOT / "tests"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OUT": str(out), "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_gpu_fastpath_smoke(tmp_path):
    run_smoke("gpu_fastpath.py", tmp_path)
    results = json.loads((tmp_path / "gpu_fastpath.json").read_text())
    assert not results.get("errors"), results.get("errors")
    speed = results["speed"]
    assert speed["plain_b1"]["tokens"] > 0
    assert speed["eagle3_sim08_k4_b1"]["spec_first_request"]["num_drafted"] > 0
    assert 0 < speed["scheduler_overhead"]["fraction"] < 1


def test_trees_gpu_smoke(tmp_path):
    run_smoke("trees_gpu.py", tmp_path)
    results = json.loads((tmp_path / "trees_gpu.json").read_text())
    assert not results.get("errors") and not results["skipped"], results.get("errors")
    assert results["correctness"] and all(results["correctness"].values()), results["correctness"]
    assert results["b1"]["tree 4x5, 16 nodes, sibling 0.3"]["mean_accepted_length"] > 1


def test_policy_sweep_smoke(tmp_path):
    run_smoke("policy_sweep.py", tmp_path)
    results = json.loads((tmp_path / "policy_sweep.json").read_text())
    assert len(results["table"]) == 6  # two acceptance levels x (c = 1, c = 4, bursty)
    for row in results["table"]:
        assert all(row[name] > 0 for name in ("off", "fixed:1", "fixed:2", "fixed:4", "goodput"))
    assert all(r["prefix_hit_pages"] == 0 for runs in results["runs"].values() for r in runs)  # no cell reuses a prompt
    for acc in ("0.6", "0.8"):
        lines = (tmp_path / f"decisions_a{acc}.jsonl").read_text().splitlines()
        assert lines and {"k", "predicted_s", "observed_s"} <= set(json.loads(lines[-1]))
        steps = [json.loads(line) for line in (tmp_path / f"steps_a{acc}.jsonl").read_text().splitlines()]
        assert {s["policy"] for s in steps} == {"off", "fixed:1", "fixed:2", "fixed:4"}
        assert {s["load"] for s in steps} == {"c=1", "c=4", "bursty"}
        assert all(max(s["k"]) <= 4 and s["observed_s"] > 0 for s in steps)
        assert any(max(s["k"]) == 4 for s in steps if s["policy"] == "fixed:4")
        assert not any(any(s["k"]) for s in steps if s["policy"] == "off")


def test_step_anatomy_smoke(tmp_path):
    run_smoke("step_anatomy.py", tmp_path)
    results = json.loads((tmp_path / "step_anatomy.json").read_text())
    assert all(row["equal"] for row in results["argmax"].values())
    assert max(results["weights"]["check"].values()) < 1e-3  # every skinny-GEMM variant computes x @ w.T
    assert all(err < 1e-5 for row in results["splits"].values() for key, err in row.items() if key.startswith("err_"))
    assert results["mixed"]["mixed eager"]["host_ms"] > 0


@pytest.mark.parametrize("shape", ["8b", "moe"])
def test_step_phases_smoke(tmp_path, shape):
    """Every step's parts are timed, per mode and load, and goodput's decisions logged, on a
    dense target and on a Mixture-of-Experts one."""
    run_smoke("step_phases.py", tmp_path, "--shape", shape)
    rows = json.loads((tmp_path / "step_phases.json").read_text())["results"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for m in ("fixed:4", "goodput") for c in (2, 4)]
    for r in rows:
        assert r["steps"] > 0 and r["full_decode_launches"] > 0 and r["host_ms"]["wall"] > 0
        assert r["host_ms"]["launch"] >= r["host_ms"]["propose"]
    for c in (2, 4):  # the policy's own time shows: goodput prices every step, fixed takes its K
        fixed, goodput = (next(r for r in rows if r["mode"] == m and r["concurrency"] == c) for m in ("fixed:4", "goodput"))
        assert goodput["host_ms"]["choose"] > fixed["host_ms"]["choose"] > 0
    assert (tmp_path / "decisions_W5.jsonl").read_text().splitlines()


def test_front_capacity_smoke(tmp_path):
    """The API process and a model-less core stream every token requested."""
    result = json.loads(run_smoke("front_capacity.py", tmp_path).splitlines()[-1])
    assert result["failed"] == 0 and result["output_tok_s"] > 0
    assert 0 < result["of_ideal"] <= 1.05 and result["api_process_cores"] > 0


def run_tool(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_policy_host_time_tool(tmp_path):
    """Its K follows the prices: none with drafts priced as a whole step, long ones nearly free
    (once the estimates have settled: 8 requests' first steps at a = 0.5 can start them low)."""
    run_tool("policy_host_time.py", "--batch-sizes", "1,8", "--steps", "100", "--out", str(tmp_path / "t.json"))
    rows = {(r["draft_price"], r["batch"]): r for r in json.loads((tmp_path / "t.json").read_text())}
    assert all(r["choose_us"] > 0 and r["observe_us"] > 0 for r in rows.values())
    assert rows[(1.0, 8)]["mean_k"] < 0.5 < 3 < rows[(0.02, 8)]["mean_k"]


def test_offline_interleaved_tool(tmp_path):
    """Every mode runs every load in every round, on the demo pair."""
    run_tool("offline_interleaved.py", "--modes", "off,goodput", "--concurrency", "1,2", "--num-prompts", "2",
             "--random-output-len", "4", "--rounds", "2", "--output-json", str(tmp_path / "i.json"))
    report = json.loads((tmp_path / "i.json").read_text())
    rows = report["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["completed"] == 2 and r["failed"] == 0 for r in rows)
    # Each load of a round runs every mode, the modes' order rotating from round to round.
    assert [(r["round"], r["load"], r["mode"]) for r in rows[:4]] == [
        (0, "c=1", "off"), (0, "c=1", "goodput"), (0, "c=2", "off"), (0, "c=2", "goodput")]
    assert [r["mode"] for r in rows[4:6]] == ["goodput", "off"]
    goodput = [s for s in report["summary"] if s["mode"] == "goodput"]
    assert len(goodput) == 2 and all(len(s["ratios"]) == 2 and s["median_ratio"] > 0 for s in goodput)


def test_policy_sim_tool(tmp_path):
    """The simulated closed loop: where drafts are never accepted goodput keeps within 3% of
    off, and where nearly all are, within 3% of the longest fixed K; on the MoE's step
    times too, whose drafts are dear at a few rows and cheap at many."""
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "benchmarks"))
    for acceptance, rival, costs in (("0.0", "none", "h200_8b"), ("0.9", "fixed:4", "h200_8b"),
                                     ("0.7", "fixed:4", "h200_moe")):
        out = tmp_path / f"sim_{acceptance}_{costs}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_sim.py"), "--acceptance", acceptance,
                               "--concurrency", "1,32", "--steps", "400", "--warmup", "100", "--cost-model", costs,
                               "--modes", f"{rival},goodput", "--json", str(out)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = json.loads(out.read_text())["rows"]
        for c in (1, 32):
            rate = {r["mode"]: r["tokens_per_s"] for r in rows if r["concurrency"] == c}
            assert rate["goodput"] >= 0.97 * rate["off" if rival == "none" else rival], (acceptance, c, rate)


@pytest.mark.parametrize("max_tokens", ["128", "1920"])
def test_policy_sim_tool_where_long_prompts_bind_the_budget(tmp_path, max_tokens):
    """128 clients of 2,048-token prompts for 128 output tokens need more budget a step than
    there is even at K = 0 (the MoE's step times): drafting only slows the loop, none is
    best, and goodput keeps within 3% of it (priced as a burst would be, its drafts made 0.91
    of it). Also where the requests ask for 1,920 tokens and stop at an EOS after 128, which
    goodput learns from the requests it sees finish."""
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "benchmarks"))
    out = tmp_path / "sim_bound.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_sim.py"), "--cost-model", "h200_moe",
                           "--burst", "--acceptance", "0.7", "--input-len", "2048", "--output-len", "128",
                           "--max-tokens", max_tokens, "--concurrency", "128", "--steps", "400", "--warmup", "300",
                           "--modes", "none,fixed:2,goodput", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rate = {r["mode"]: r["tokens_per_s"] for r in json.loads(out.read_text())["rows"]}
    assert rate["fixed:2"] < rate["off"] and rate["goodput"] >= 0.97 * rate["off"], rate


def test_policy_sim_tool_counts_a_cell_as_the_matrix_does(tmp_path):
    """With --requests-per-client the simulated cell ends when the last request is sent, as
    `tidal bench matrix` counts while the load is whole: 4 clients, 8 requests of 16 output
    tokens; the first four prompts share step 0 (each its first token), and they finish in
    step 15, when the last four are sent. Drafting finishes them sooner."""
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "benchmarks"))
    out = tmp_path / "sim_cell.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_sim.py"), "--burst", "--warmup", "0",
                           "--requests-per-client", "2", "--min-requests", "8", "--acceptance", "0.9",
                           "--input-len", "64", "--output-len", "16", "--concurrency", "4", "--steps", "1000",
                           "--modes", "none,fixed:4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {r["mode"]: r["steps_counted"] for r in json.loads(out.read_text())["rows"]}
    assert steps["off"] == 16 and steps["fixed:4"] < 16, steps


def test_policy_sim_tool_with_trees(tmp_path):
    """Trees in the simulated closed loop: every tree of K nodes is the best K of one tree
    (`SpecConfig.draft_depth`), so what goodput learns of each node's chance is what a larger
    tree buys, and at one client it keeps within 3% of the largest tree."""
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "benchmarks"))
    out = tmp_path / "sim_trees.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_sim.py"),
                           "--acceptance", '{"mean": 0.7, "sibling": 0.3}', "--topk", "4", "--depth", "5", "--k", "16",
                           "--concurrency", "1", "--steps", "600", "--warmup", "100",
                           "--modes", "fixed:16,goodput", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rate = {r["mode"]: r["tokens_per_s"] for r in json.loads(out.read_text())["rows"]}
    assert rate["goodput"] >= 0.97 * rate["fixed:16"], rate


def test_step_kinds_tool(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_kinds import summarize

    def line(step, new_tokens, drafted, accepted, seconds):
        return {"policy": "fixed:2", "step": step, "rows": 2, "new_tokens": new_tokens, "observed_s": seconds,
                "drafted": drafted, "accepted": accepted}

    lines = [line(1, 2, [2, 2], [1, 2], 0.01), line(2, 30, [2, 0], [0, 0], 0.03), line(3, 2, [1, 1], [0, 1], 0.01)]
    lines[1]["catch_up"] = 500  # its drafter absorbed a prompt (goodput's lines say so)
    decode, prompt = summarize(lines)
    assert (decode["kind"], decode["steps"], decode["tokens"], decode["drafts_per_row"]) == ("decode", 2, 8, 1.5)
    assert (decode["with_catch_up"], prompt["with_catch_up"]) == (0, 1)
    assert (prompt["kind"], prompt["tokens"], prompt["share"]) == ("prompt", 2, pytest.approx(0.6))
    assert [r["kind"] for r in summarize(lines, split="k")] == ["decode K=1", "decode K=2", "prompt K=2"]
    assert [r["kind"] for r in summarize(lines, split="around")] == ["after a prompt step", "before a prompt step",
                                                                     "prompt"]
    lines[0]["catch_up_s"], lines[1]["catch_up_s"] = 0.0031, 0.0006  # a slow catch-up and a quick one
    assert [(r["kind"], r["steps"]) for r in summarize(lines, split="catch-up")] == [
        ("decode, catch-up > 1.5 ms", 1), ("decode, catch-up none", 1), ("prompt, catch-up <= 1.5 ms", 1)]
    assert summarize(lines, split="catch-up", catch_up_ms=5)[0]["kind"] == "decode, catch-up <= 5 ms"
    (cell,) = summarize(lines, steps={"fixed:2": (2, 2)})  # one cell's steps of the policy
    assert (cell["kind"], cell["steps"]) == ("prompt", 1)
    assert summarize(lines, steps={"goodput": (1, 3)}) == []


def test_step_kinds_fits_what_a_prompt_adds():
    """Steps with prompts that take a decode step of their K, 2 ms and 10 us a prompt token
    give back those two numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_kinds import prompt_fit

    def line(prompt, k, seconds):
        return {"policy": "fixed:2", "step": 0, "rows": 4, "new_tokens": 4 + prompt, "observed_s": seconds,
                "drafted": [k] * 4, "accepted": [0] * 4}

    decode = {0: 0.020, 2: 0.030}
    lines = [line(0, k, s) for k, s in decode.items() for _ in range(5)]
    lines += [line(p, k, decode[k] + 0.002 + 1e-5 * p) for k in decode for p in (100, 500, 1500)]
    (fit,) = prompt_fit(lines)
    assert fit["steps"] == 6 and fit["median_abs_residual"] < 1e-9
    assert (fit["fixed_ms"], fit["us_per_prompt_token"]) == (pytest.approx(2.0), pytest.approx(10.0))


def test_price_replay_learns_a_prompt_steps_price():
    """A log whose steps with prompts take 5 ms more than their decode step and carry a
    catch-up (as decode steps now and then do, at its price), replayed through the cost
    model, ends with both kinds priced at what they took."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from price_replay import replay

    def line(prompt, seconds, catch_up=0):
        return {"policy": "goodput", "step": 0, "rows": 100, "new_tokens": 100 + prompt, "observed_s": seconds,
                "drafted": [4] * 100, "accepted": [2] * 100, "catch_up": catch_up}

    catch_up = 0.0003 + 2000 * 1e-6  # the replay's price of catching up over 2,000 tokens
    lines = [line(0, 0.030), line(0, 0.030), line(0, 0.030 + catch_up, 2000),
             line(1000, 0.035 + catch_up, 2000)] * 60
    assert [(r["kind"], r["k"], r["median_price_over_taken"]) for r in replay(lines, max_num_seqs=128)] == [
        ("decode", 4, pytest.approx(1.0, abs=0.01)), ("prompt", 4, pytest.approx(1.0, abs=0.01))]


def test_profile_refill_guesses_the_shapes_a_budget_cut_again():
    """A stored profile (its grid filled) whose budget measured the first 12 of its 15
    shapes, as its source says: the tool finds the two target shapes that were guessed and guesses them again,
    2 rows of width 3 by 4 rows of width 2 (more rows, more tokens); and it takes the median
    of served decode steps without a catch-up."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_refill import refill, served

    model = {"batch_sizes": [1, 2, 4], "widths": [1, 2, 3], "source": "profile: 12 of 15 shapes measured in 3 s",
             "grid": [[1.0, 2.0, 3.0], [2.0, 3.5, 9.9], [4.0, 4.2, 9.9]]}
    rows, widths, guessed, grid = refill(model)
    assert guessed.tolist() == [[False] * 3, [False, False, True], [False, False, True]]
    assert grid[1, 2] == 4.2 and grid[2, 2] == pytest.approx(4.2 * 3 / 2)

    def line(rows, drafted, seconds, new_tokens=None, catch_up_s=None):
        return {"policy": "fixed:4", "rows": rows, "new_tokens": new_tokens or rows, "drafted": [drafted] * rows,
                "observed_s": seconds, "catch_up_s": catch_up_s}

    lines = [line(100, 4, 0.030), line(101, 4, 0.040), line(100, 4, 0.050, new_tokens=600),
             line(100, 4, 0.060, catch_up_s=0.001), line(40, 4, 0.020)]
    assert served(lines, ["fixed:4"], min_rows=64) == {("fixed:4", 4, 96): (2, pytest.approx(0.035))}
    assert served(lines, ["fixed:4"], min_rows=8) == {("fixed:4", 4, 40): (1, pytest.approx(0.020)),
                                                     ("fixed:4", 4, 88): (2, pytest.approx(0.035))}
