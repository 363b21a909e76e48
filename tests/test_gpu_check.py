"""benchmarks/gpu_check.py: skips cleanly without CUDA, and --tiny runs every code path on CPU (Triton's
interpreter), so the prepared GPU script is known not to crash before a GPU is lent."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark


def _mod():
    return load_benchmark("gpu_check")


def test_without_cuda_it_skips_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert _mod().main(["--out", str(out)]) == 0
    assert "gpu_check: no CUDA: skipped" in capsys.readouterr().out
    assert not out.exists()


def test_time_guard_skips_the_rest_and_still_writes_json(tmp_path):
    out = tmp_path / "gpu.json"
    assert _mod().main(["--tiny", "--budget", "0", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["machine"]["loadavg_end"] is not None and set(d["sections"]) == {"kernels", "searched", "decode", "lowbit"}
    cases = [c for s in d["sections"].values() for key in ("correctness", "cases") for c in s.get(key, [])]
    assert cases and all(c.get("skipped", "").startswith("time guard") for c in cases)


@pytest.mark.slow
def test_tiny_runs_every_code_path(tmp_path):
    """Every section on CPU at tiny sizes: no errors, the Triton kernel within the tolerance rule,
    and the compressed cache smaller than the full one (--tiny measures nothing worth keeping)."""
    out = tmp_path / "gpu.json"
    assert _mod().main(["--tiny", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["tiny"] and d["dtype"] == "bfloat16"
    ker, srch, dec = (d["sections"][k] for k in ("kernels", "searched", "decode"))
    assert [c["pattern"] for c in ker["correctness"]] == ["a_shape", "vertical_slash", "block_sparse"]
    assert all(c["ok"] for c in ker["correctness"]), ker["correctness"]
    assert {c["pattern"] for c in ker["cases"]} == {"dense (SDPA)", "a_shape", "vertical_slash", "block_sparse"}
    assert all("total_s" in c or "sdpa_s" in c for c in ker["cases"])
    assert srch["cases"] and all(c["sparse_layers"] == srch["config"]["layers_timed"] for c in srch["cases"])
    rows = {(c["model"], c["config"]): c for c in dec["cases"]}
    assert set(rows) == {(m, c) for m in ("qwen2.5-0.5b", "qwen2.5-7b") for c in ("full", "snapkv@0.1", "hf_dynamic")}
    for m in ("qwen2.5-0.5b", "qwen2.5-7b"):
        assert all(rows[(m, c)]["steps"] >= 1 for c in ("full", "snapkv@0.1", "hf_dynamic"))
        assert rows[(m, "snapkv@0.1")]["kv_bytes"] < rows[(m, "full")]["kv_bytes"]
        assert rows[(m, "full")]["stored_tokens"] == rows[(m, "hf_dynamic")]["stored_tokens"]
    low = d["sections"]["lowbit"]
    assert [c["bits"] for c in low["correctness"]] == [8, 4, 2] and all(c["ok"] for c in low["correctness"]), low
    kinds = {(c["kernel"], c["bits"]) for c in low["cases"]}
    assert kinds == {("SDPA", 16), ("triton lowbit", 8), ("triton lowbit", 4), ("triton lowbit", 2)}
    by_bits = {c["bits"]: c["kv_bytes"] for c in low["cases"]}
    assert by_bits[2] < by_bits[4] < by_bits[8] < by_bits[16]  # fewer bits read fewer bytes
    assert all("speedup_vs_sdpa" in c for c in low["cases"] if c["bits"] != 16)
    assert not any("error" in c for s in d["sections"].values() for c in s.get("cases", []))
