"""benchmarks/bench_sparse_kernel.py: a tiny run with both native variants, end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_grouped_and_ungrouped_native_rows(tmp_path):
    out = tmp_path / "rate.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("KVTRIM_NATIVE_QUERY_GROUPS", None)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sparse_kernel.py"), "--dtype", "bfloat16",
                          "--q-heads", "4", "--kv-heads", "2", "--lengths", "700", "--patterns", "all_blocks", "a_shape",
                          "--cpu-kernels", "native", "native-ungrouped", "--reps", "1", "--warmup", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kernels = {(r["kind"], r["kernel"]) for r in rows if "kernel" in r and r["kind"] != "dense_sdpa"}
    assert kernels == {(p, k) for p in ("all_blocks", "a_shape") for k in ("native", "native-ungrouped")}
    assert "| 700 | bfloat16 | a_shape | native-ungrouped |" in res.stdout


def test_ungrouped_variant_sets_the_switch_only_for_its_call(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_sparse_kernel as bsk
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    seen = []
    monkeypatch.delenv("KVTRIM_NATIVE_QUERY_GROUPS", raising=False)
    monkeypatch.setattr(bsk, "sparse_attention_cpu",
                        lambda q, k, v, lay, kernel: seen.append((kernel, os.environ.get("KVTRIM_NATIVE_QUERY_GROUPS"))))
    bsk.cpu_attention(None, None, None, None, "native-ungrouped")
    bsk.cpu_attention(None, None, None, None, "native")
    assert seen == [("native", "0"), ("native", None)]
    assert "KVTRIM_NATIVE_QUERY_GROUPS" not in os.environ
