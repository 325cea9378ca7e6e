"""`tidal bench`: the ShareGPT loader on a cut-off file, argument checks, and CPU smoke
runs of the serve sweep (two servers in subprocesses), the offline sweep and the matrix."""

import json

import pytest

from tidal.bench.matrix import (Workload, cell_loads, cell_rate, format_matrix, plot_matrix, run_matrix,
                                server_acceptance)
from tidal.bench.offline import run_offline_sweep
from tidal.bench.serve import run_sweep
from tidal.bench.datasets import random_requests, read_json_array, sharegpt_requests
from tidal.bench.report import format_report, plot, write_json
from tidal.bench.workload import (RequestRecord, build_loads, loaded_throughput, mode_spec_config, parse_bursty,
                                  parse_modes)
from tidal.cli import main
from tidal.tokenizer import Tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def text_of(tokenizer, n: int, char: str = "@") -> str:
    """A text of exactly n tokens (this tokenizer has no merges of these characters)."""
    text = char * n
    assert len(tokenizer.encode(text)) == n
    return text


def conversation(i: int, prompt: str, answer: str | None) -> dict:
    turns = [{"from": "human", "value": prompt}] + ([{"from": "gpt", "value": answer}] if answer else [])
    return {"id": f"c{i}", "conversations": turns}


def test_sharegpt_loader_reads_complete_records_and_filters(tmp_path, checkpoint):
    tok = Tokenizer.from_pretrained(checkpoint("llama"))
    good = [conversation(i, text_of(tok, 5 + i), text_of(tok, 6, "~")) for i in range(4)]
    dropped = [
        conversation(10, text_of(tok, 8), None),                                     # one turn
        conversation(11, text_of(tok, 3), text_of(tok, 8)),                          # prompt < 4 tokens
        conversation(12, text_of(tok, 8), text_of(tok, 3)),                          # output < 4 tokens
        conversation(13, text_of(tok, 1025), text_of(tok, 8)),                       # prompt > 1024
        conversation(14, text_of(tok, 1000), text_of(tok, 1049)),                    # total > 2048
    ]
    text = json.dumps(good + dropped, indent=2)
    cut = text.rindex("]") - 1  # the array ends with the last record; cut a new one in half
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut] + ",\n" + json.dumps(conversation(99, "never", "read"))[:30])
    records, unread = read_json_array(path)
    assert len(records) == len(good) + len(dropped) and unread == 30
    requests, info = sharegpt_requests(tok, 4, seed=1, path=path)
    assert info["records_read"] == 9 and info["conversations"] == 8 and info["chars_ignored"] == 30
    assert sorted(r.prompt_len for r in requests) == [5, 6, 7, 8]
    assert all(r.output_len == 6 for r in requests)
    assert requests == sharegpt_requests(tok, 4, seed=1, path=path)[0]  # the seed fixes the order
    with pytest.raises(ValueError, match="--num-prompts"):
        sharegpt_requests(tok, 5, seed=1, path=path)
    short = sharegpt_requests(tok, 2, seed=1, path=path, max_model_len=12)[0]  # the model's context
    assert sorted(r.prompt_len for r in short) == [5, 6]
    with pytest.raises(ValueError, match="--num-prompts"):
        sharegpt_requests(tok, 3, seed=1, path=path, max_model_len=12)
    path.write_text(text)  # a complete file
    assert read_json_array(path) == (good + dropped, 0)


def test_argument_errors(checkpoint, capsys):
    assert parse_modes("off, fixed:3,goodput") == ["off", "fixed:3", "goodput"]
    for bad in ("fast", "fixed:0", "fixed", "off,off"):
        with pytest.raises(ValueError, match="--modes"):
            parse_modes(bad)
    assert mode_spec_config("none", None) is None
    assert mode_spec_config("fixed:3", {**NGRAM, "policy": "goodput"}) == {**NGRAM, "num_speculative_tokens": 3,
                                                                            "policy": "fixed"}
    with pytest.raises(ValueError, match="--speculative-config"):
        mode_spec_config("off", None)
    with pytest.raises(ValueError, match="table"):
        mode_spec_config("table", NGRAM)  # policy table needs a table
    tree = {"method": "draft_model", "model": checkpoint("llama"), "topk": 4, "num_speculative_tokens": 5,
            "num_draft_tokens": 16, "simulate_acceptance": {"mean": 0.7, "sibling": 0.3}}
    assert mode_spec_config("fixed:8", tree)["num_draft_tokens"] == 8  # a tree's K is its nodes
    # A workload's rates reach the servers with the user's sibling factor (trees), or alone.
    assert server_acceptance(0.8, tree) == {"mean": 0.8, "sibling": 0.3}
    assert server_acceptance({"mean": 0.6, "std": 0.25}, tree) == {"mean": 0.6, "std": 0.25, "sibling": 0.3}
    assert server_acceptance(0.8, NGRAM) == 0.8
    assert parse_bursty("1:20,128:200") == ((1, 20), (128, 200))
    with pytest.raises(ValueError, match="--bursty"):
        parse_bursty("1:20,128")
    loads = build_loads()
    assert [(load.label, load.total_requests) for load in loads] == [
        ("c=1", 100), ("c=10", 100), ("c=70", 280), ("c=250", 1000)]
    bursty = build_loads(bursty="1:2,4:8", bursty_cycles=3)[0]
    assert bursty.total_requests == 30
    with pytest.raises(ValueError, match="--concurrency"):
        build_loads(concurrency="1,x")
    with pytest.raises(ValueError, match="--request-rate"):
        build_loads(request_rate="0")
    with pytest.raises(ValueError, match="--random-input-len"):
        random_requests(Tokenizer.from_pretrained(checkpoint("llama")), 2, 0, 4, seed=0)
    assert main(["bench", "serve", "--model", checkpoint("llama"), "--modes", "off,sometimes"]) == 2
    assert "--modes: unknown mode 'sometimes'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--bursty-cycles", "two"])


def check_rows(report: dict, loads, requests_per_load: int, output_len: int) -> None:
    """Tokens counted = tokens requested, and ratios from the same run's throughputs."""
    rows = {(r["mode"], r["load"]): r for r in report["results"]}
    assert set(rows) == {(m, load.label) for m in report["modes"] for load in loads}
    for (mode, load), r in rows.items():
        n = next(x.total_requests for x in loads if x.label == load)
        assert r["completed"] == n and r["failed"] == 0
        assert r["output_tokens"] == r["requested_output_tokens"] == n * output_len
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert 0 < r["median_ttft_ms"] and 0 < r["median_tpot_ms"] <= r["p99_tpot_ms"]
        times = r["request_times_ms"]  # each request's [sent, first token, end], from the first sent
        assert len(times) == n and min(t[0] for t in times) == 0 and all(0 <= a < b <= c for a, b, c in times)
        assert max(t[2] for t in times) == pytest.approx(1000 * r["duration_s"], rel=0.05, abs=50)
        spec = next(x for x in loads if x.label == load)
        if spec.rate is None and spec.total_requests > max(c for c, _ in spec.phases):  # clients sent again
            assert 0 < r["loaded_s"] <= r["duration_s"] and r["loaded_output_throughput"] > 0
        baseline = rows[(report["baseline"], load)]
        assert r["ratio"] == pytest.approx(r["output_throughput"] / baseline["output_throughput"])
        assert r["accepted_tokens"] <= r["drafted_tokens"]
        if mode in ("none", "off"):
            assert r["drafted_tokens"] == 0 and r["mean_k"] == 0
        else:
            assert 0 < r["mean_k"] <= 2 and sum(r["k_share"]) == pytest.approx(1)


def test_loaded_throughput_counts_the_chunks_that_came_before_the_last_request_was_sent():
    """The window ends when the last request is sent; a request's tokens count in the share
    of its chunks that arrived by then; failed requests bring none."""
    a = RequestRecord(0, 4, 8, start=0.0, chunk_times=[1.0, 2.0, 3.0, 3.5], output_tokens=8, end=3.5)
    b = RequestRecord(0, 4, 2, start=2.0, chunk_times=[3.0, 6.0], output_tokens=2, end=6.0)
    c = RequestRecord(0, 4, 1, start=4.0, chunk_times=[6.5], output_tokens=1, end=6.5)
    failed = RequestRecord(0, 4, 4, start=1.0, chunk_times=[1.5], output_tokens=0, end=1.5, error="HTTP 500")
    assert loaded_throughput([a, b, c, failed]) == (pytest.approx((8 + 1) / 4), 4.0)
    # No request sent after another ended: no window.
    assert loaded_throughput([a, RequestRecord(0, 4, 2, start=0.5, chunk_times=[2.5], output_tokens=2, end=2.5)]) \
        == (None, 0.0)


def test_serve_sweep_smoke(checkpoint, tmp_path):
    model = checkpoint("llama")
    loads = build_loads(concurrency="1,3", num_prompts=6)
    requests, dataset = random_requests(Tokenizer.from_pretrained(model), 13, 8, 8, seed=0)
    report = run_sweep(["off", "fixed:2"], loads, requests, model=model, spec_config=NGRAM,
                       server_args=["--device", "cpu", "--dtype", "float32"], num_warmups=1, dataset=dataset,
                       server_timeout=120)
    assert report["baseline"] == "off" and report["mode_configs"]["fixed:2"]["policy"] == "fixed"
    check_rows(report, loads, 6, 8)
    table = format_report(report)
    fixed = next(r for r in report["results"] if r["mode"] == "fixed:2" and r["load"] == "c=3")
    assert "fixed:2 ratio" in table and f"{fixed['ratio']:.2f}" in table and "c=3" in table
    write_json(report, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offline_sweep_smoke(checkpoint):
    model = checkpoint("llama")
    loads = build_loads(concurrency="2", request_rate="100", bursty="1:2,3:3", bursty_cycles=1, num_prompts=4)
    requests, dataset = random_requests(Tokenizer.from_pretrained(model), 14, 6, 5, seed=0)
    report = run_offline_sweep(["none", "fixed:2"], loads, requests, model=model, spec_config=NGRAM,
                               engine_args={"dtype": "float32"}, num_warmups=1, dataset=dataset)
    assert report["baseline"] == "none"
    check_rows(report, loads, 4, 5)
    bursty = next(r for r in report["results"] if r["load"].startswith("bursty"))
    assert [(p["clients"], p["completed"], p["output_tokens"]) for p in bursty["phases"]] == [(1, 2, 10), (3, 3, 15)]
    assert "phase 2: 3 clients" in format_report(report)


def test_matrix_smoke(checkpoint, tmp_path):
    """Every mode serves every workload under every load, each workload's own simulated
    acceptance reaching the server with its requests; goodput's ratio is to the best
    other mode of its cell; the report so far is handed on after every cell."""
    model = checkpoint("llama")
    workloads = [Workload("spread", 8, 6, 0.7, {"mean": 0.6, "std": 0.25}), Workload("never", 6, 6, 0.0, 0.0)]
    loads = cell_loads([1, 3], requests_per_client=1, min_requests=2)
    # Drafts every step; goodput's start-up profile is cut short (its 3 s default is server start-up alone).
    drafter = {"method": "draft_model", "model": model, "num_speculative_tokens": 2, "profile_seconds": 0.5}
    cells_seen = []
    report = run_matrix(["none", "fixed:2", "goodput"], workloads, loads, model=model, spec_config=drafter,
                        server_args=["--device", "cpu", "--dtype", "float32"], num_warmups=1, server_timeout=120,
                        on_cell=lambda partial: cells_seen.append(len(partial["results"])))
    rows = {(r["workload"], r["mode"], r["load"]): r for r in report["results"]}
    assert cells_seen == list(range(1, len(rows) + 1))
    assert set(rows) == {(w.name, m, load.label) for w in workloads for m in report["modes"] for load in loads}
    for (workload, mode, load), r in rows.items():
        n = next(x.total_requests for x in loads if x.label == load)
        assert r["completed"] == n and r["failed"] == 0 and r["output_tokens"] == n * 6
        assert r["kernel_compiles"] == 0  # every row reports it (the CPU builds no Triton kernel)
        if mode == "none":
            assert r["drafted_tokens"] == 0
        if mode == "goodput":
            others = [rows[(workload, m, load)] for m in ("none", "fixed:2")]
            assert r["vs_best_other"] == pytest.approx(cell_rate(r) / max(map(cell_rate, others)))
            assert r["vs_best_other_whole_run"] == pytest.approx(
                r["output_throughput"] / max(x["output_throughput"] for x in others))
    # Each workload's acceptance reached the server: none of "never"'s drafts was accepted,
    # some of "spread"'s were.
    for load in loads:
        never, spread = rows[("never", "fixed:2", load.label)], rows[("spread", "fixed:2", load.label)]
        assert never["drafted_tokens"] > 0 and never["accepted_tokens"] == 0
        assert 0 < spread["accepted_tokens"] <= spread["drafted_tokens"]
    table = format_matrix(report)
    assert "spread: 8 prompt / 6 output tokens" in table and "goodput / best other" in table
    assert "kernels built" in table
    plot_matrix(report, tmp_path / "matrix.png")
    assert (tmp_path / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
