"""benchmarks/bench_prefill_memory.py end to end on a tiny model: every weight read before the base,
W from the median of the chunk-alone runs, and no reuse of results measured the older way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_prefill_memory.py"
RESULTS = ROOT / "benchmarks" / "results" / "prefill_memory"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def result(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pm") / "r.json"
    res = run("--model", tiny_dir, "--lengths", "512", "--chunk", "128", "--keep", "0.25", "--oneshot-at", "512=",
              "--chunked-at", "512=snapkv", "--alone-reps", "3", "--out", str(out))
    assert res.returncode == 0, res.stderr
    return out, json.loads(out.read_text()), res.stdout


def test_the_base_holds_every_weight_and_w_is_the_median_run(result):
    _, d, _ = result
    runs = d["chunk_alone_runs"]
    assert len(runs) == 3 and all(r["weights_read"] for r in runs)
    ws = sorted(r["peak_rss"] - r["base_rss"] for r in runs)
    assert d["chunk_working_set"] == ws[1]
    assert d["base_rss"] == d["chunk_alone"]["base_rss"] and d["chunk_alone"] in runs
    (rec,) = d["records"]
    assert rec["method"] == "snapkv" and rec["chunk"] == 128 and rec["weights_read"]
    assert rec["bound"] == d["base_rss"] + 2 * rec["kv"] + d["chunk_working_set"]
    assert rec["holds"] == (rec["peak_rss"] <= rec["bound"])
    assert rec["base_rss"] > rec["weights"]  # the weights are all resident, with the runtime on top


def test_the_table_says_how_the_base_and_w_were_measured(result):
    _, d, stdout = result
    assert "resident after loading and reading every weight once (all the weights + runtime)" in stdout
    ws = sorted((r["peak_rss"] - r["base_rss"]) / 2**20 for r in d["chunk_alone_runs"])
    assert f"the median of 3 runs, {ws[0]:.0f}-{ws[-1]:.0f})" in stdout


def test_reuse_takes_the_chunk_alone_runs_and_records_without_measuring(result, tiny_dir, tmp_path):
    path, d, _ = result
    out = tmp_path / "again.json"
    res = run("--model", tiny_dir, "--lengths", "512", "--chunk", "128", "--keep", "0.25", "--oneshot-at", "512=",
              "--chunked-at", "512=snapkv", "--reuse", str(path), "--out", str(out))
    assert res.returncode == 0, res.stderr
    again = json.loads(out.read_text())
    assert again["chunk_alone_runs"] == d["chunk_alone_runs"]
    assert [r["peak_rss"] for r in again["records"]] == [r["peak_rss"] for r in d["records"]]
    assert again["records"][0]["reused_from"] == str(path)


def test_a_result_measured_before_the_weights_were_read_is_not_reused(tmp_path):
    old = RESULTS / "qwen_8k_trim.json"  # committed before the base read every weight
    assert not json.loads(old.read_text())["chunk_alone"].get("weights_read")
    # refused before anything loads (the reference model need not be installed)
    res = run("--model", "qwen2.5-0.5b", "--reuse", str(old), "--out", str(tmp_path / "x.json"))
    assert res.returncode == 2
    assert "measured before this benchmark read every weight" in res.stderr
    assert not (tmp_path / "x.json").exists()


def test_alone_reps_below_one_is_a_usage_error(tmp_path):
    res = run("--alone-reps", "0", "--out", str(tmp_path / "x.json"))
    assert res.returncode == 2 and "--alone-reps must be at least 1" in res.stderr


def test_an_old_table_says_its_base_held_only_the_weights_read_so_far():
    res = run("--table", str(RESULTS / "qwen_8k_trim.json"))
    assert res.returncode == 0, res.stderr
    assert "resident after loading and a 16-token forward (runtime + the weight pages read so far" in res.stdout
