"""benchmarks/bench_heap_trim.py: usage errors before anything loads, and the committed tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_heap_trim.py"
RESULTS = ROOT / "benchmarks" / "results" / "prefill_memory"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


def test_a_chunk_not_shorter_than_the_prompt_is_a_usage_error(tmp_path):
    out = tmp_path / "r.json"
    res = run("--model", "/nonexistent", "--length", "1024", "--chunk", "1024", "--out", str(out))
    assert res.returncode == 2
    assert "--length must be longer than --chunk" in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["heap_trim_time_qwen.json", "heap_trim_time_smollm2.json"])
def test_table_of_a_committed_result(name):
    res = run("--table", str(RESULTS / name))
    assert res.returncode == 0, res.stderr
    d = json.loads((RESULTS / name).read_text())
    assert f"| on | {d['results']['on']['median']:.2f} |" in res.stdout
    assert f"| off | {d['results']['off']['median']:.2f} |" in res.stdout
    assert f"ratio of medians: {d['ratio_on_over_off']:.3f}" in res.stdout


def test_it_counts_generates_own_trims(tiny_dir, tmp_path):
    out = tmp_path / "r.json"
    res = run("--model", str(tiny_dir), "--length", "256", "--chunk", "64", "--reps", "1", "--warmup", "0",
              "--threads", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    layers = 3  # tiny_llama's
    # 4 chunks, each at least every decoder layer with its attention and MLP; none with the trimming off
    assert d["results"]["on"]["trims"] >= 4 * 3 * layers
    assert d["results"]["off"]["trims"] == 0
