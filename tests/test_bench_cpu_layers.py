"""benchmarks/bench_mlp_slices.py and dense_from_layers.py: a tiny run end to end, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrim.cpu_linear import packing_supported

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not packing_supported(), reason="oneDNN has no bfloat16 support on this CPU")
def test_mlp_slices_runs_every_configuration(tmp_path):
    out = tmp_path / "r.json"
    res = run("bench_mlp_slices.py", "--shapes", "smollm2", "--tokens", "300", "--slices", "64", "128",
              "--reps", "1", "--warmup", "0", "--threads", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert [r["config"] for r in d["rows"]] == ["transformers (unfused)", "fused, one piece", "fused, slices of 64",
                                                "fused, slices of 128"]
    assert all(r["ms"] > 0 for r in d["rows"]) and d["rows"][0]["speedup"] == 1.0
    assert "| fused, slices of 64 |" in res.stdout


def test_dense_from_layers_needs_its_inputs(tmp_path):
    res = run("dense_from_layers.py", "--out", str(tmp_path / "r.json"))
    assert res.returncode == 2 and "are required" in res.stderr


def test_dense_from_layers_recomputes_the_committed_result(tmp_path):
    committed = json.loads((BENCH / "results" / "dense_computed_128k.json").read_text())
    out = tmp_path / "r.json"
    res = run("dense_from_layers.py", "--prefill", str(BENCH / "results" / "minference_prefill_qwen_bf16_128k_yarn4.json"),
              "--kernel", str(BENCH / "results" / "cpu_kernel_rate_128k.jsonl"), "--config", "c64k", "--layers", "24",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert d["dense_seconds"] == committed["dense_seconds"] and d["speedup"] == committed["speedup"]
    bad = run("dense_from_layers.py", "--prefill", str(BENCH / "results" / "minference_prefill_qwen_bf16_128k_yarn4.json"),
              "--kernel", str(BENCH / "results" / "cpu_kernel_rate_128k.jsonl"), "--config", "nope", "--layers", "24",
              "--out", str(tmp_path / "s.json"))
    assert bad.returncode == 2 and "one is needed" in bad.stderr and "Traceback" not in bad.stderr
