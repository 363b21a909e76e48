"""benchmarks/anchor_vllm.py: its summary arithmetic, and docs/anchors.md shows the committed numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _mod():
    return load_benchmark("anchor_vllm")


def _meas(engine, rep, prefill, decode_s, *, warm=False, tokens=(1, 2, 3), kv=None, usage=None):
    m = {"length": 100, "prompt_tokens": 130, "rep": rep, "warmup": warm, "engine": engine,
         "method": "full (dense)" if engine.startswith("vllm") else engine.split(":")[1],
         "dtype": "float32", "prefill_seconds": prefill, "decode_seconds": decode_s, "decode_steps": 4,
         "decode_ms_per_token": 1000 * decode_s / 4, "token_ids": list(tokens), "loadavg_before": [1.0, 1, 1],
         "loadavg_after": [1.0, 1, 1], "kvtrim_process_cpu_seconds": prefill + decode_s,
         "vllm_worker_cpu_seconds": {"float32": 0.0}, "prefill_cpu_seconds": prefill / 2, "decode_cpu_seconds": decode_s / 2}
    if engine.startswith("vllm"):
        m["vllm_worker_cpu_seconds"] = {"float32": 2 * (prefill + decode_s)}
        m["engine_metrics"] = {"prefill_seconds": prefill, "decode_seconds": decode_s, "num_generation_tokens": 5}
        m["kv_usage"] = usage or []
        m["prefill_cpu_seconds_model_worker"] = prefill / 4
        m["decode_cpu_seconds_model_worker"] = decode_s / 4
    else:
        m["kv_bytes"] = kv
        m["kv_bytes_stored"] = kv
    return m


def test_summary_medians_ratios_and_vllm_kv_bytes():
    mod = _mod()
    res = {
        "setting": {"max_new_tokens": 5, "threads": 1, "reps": 3},
        "machine": {"date": "d"}, "kvtrim": {"dtype": "float32"},
        "vllm": {"float32": {"block_size": 16, "block_bytes": 1000, "num_blocks": 100, "pool_bytes": 100_000}},
        "measurements": [
            _meas("vllm:float32", -1, 9.0, 9.0, warm=True, usage=[{"kv_cache_usage": 0.09}]),
            _meas("vllm:float32", 0, 1.0, 0.4), _meas("vllm:float32", 1, 3.0, 0.8, tokens=(1, 2, 9)),
            _meas("vllm:float32", 2, 2.0, 0.2),
            _meas("kvtrim:full", 0, 4.0, 0.4, kv=4000), _meas("kvtrim:full", 1, 4.0, 0.4, kv=4000),
            _meas("kvtrim:full", 2, 5.0, 0.8, kv=4000),
            _meas("kvtrim:snapkv", 0, 4.0, 0.2, kv=1000, tokens=(1, 5, 3)),
        ],
    }
    rows = {r["engine"]: r for r in mod.summarize(res)["summary"]}
    v, f, s = rows["vllm:float32"], rows["kvtrim:full"], rows["kvtrim:snapkv"]
    assert v["n"] == 3 and v["prefill_seconds"] == 2.0 and math.isclose(v["decode_ms_per_token"], 100.0)
    assert f["prefill_seconds"] == 4.0 and math.isclose(v["prefill_seconds_vs_kvtrim_full"], 0.5)
    assert math.isclose(v["engine_decode_ms_per_token"], 100.0)  # decode / (5 generated - 1)
    # KV: 130 prompt + 4 stored generated tokens = 134 -> 9 blocks of 16; the gauge says 9 of 100 too
    assert v["kv_bytes_computed"] == 9 * 1000 and v["kv_blocks_used_gauge"] == 9 and v["kv_bytes"] == 9000
    assert math.isclose(v["kv_bytes_vs_kvtrim_full"], 9000 / 4000)
    assert v["greedy_prefix_match_vs_kvtrim_full"] == [3, 2, 3]
    assert s["greedy_prefix_match_vs_kvtrim_full"] == [1] and math.isclose(s["kv_bytes_vs_kvtrim_full"], 0.25)
    assert math.isclose(v["cpu_seconds_per_wall_second"], 2.0) and math.isclose(f["cpu_seconds_per_wall_second"], 1.0)
    assert v["prefill_cpu_seconds"] == 1.0 and math.isclose(v["prefill_cpu_seconds_vs_kvtrim_full"], 0.5)
    assert math.isclose(v["decode_cpu_ms_per_token"], 50.0) and math.isclose(v["decode_cpu_ms_per_token_model_worker"], 25.0)
    table = mod.table(res)
    assert "| 130 | vllm full (dense) | float32 | 2.00 | 0.50x | 1.00 | 0.50x | 100.0 | 1.00x | 50.0 | 1.00x | 0.0 | 2.25x |" in table


def test_docs_table_is_the_committed_result():
    """docs/anchors.md's vLLM section shows exactly what ``--table`` prints for the committed JSON."""
    res = json.loads((ROOT / "benchmarks" / "results" / "anchor_vllm.json").read_text())
    section = (ROOT / "docs" / "anchors.md").read_text().split("## Anchor: vLLM CPU", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in _mod().table(_mod().summarize(res)).splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows and all(row in section for row in rows)
