"""benchmarks/beat_vllm.py: its pure pieces (context and RoPE plan, config names, summary, tables) on synthetic data."""

from __future__ import annotations

import math

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def mod():
    return load_benchmark("beat_vllm")  # with anchor_vllm, which it imports from beside it


def test_context_and_rope_plan(mod):
    assert mod.needed_context(7710, 65) == 8192 and mod.needed_context(8128, 65) == 9216
    assert mod.rope_plan(8192, 8192) == {"context": 8192, "factor": 1.0}
    assert mod.rope_plan(32768, 8192) == {"context": 32768, "factor": 4.0}
    assert mod.rope_plan(32768, 32768)["factor"] == 1.0 and mod.rope_plan(2048, 32768)["context"] == 2048


def test_parse_config(mod):
    assert mod.parse_config("snapkv+minference", 0.25) == {"name": "snapkv@0.25+minference", "method": "snapkv",
                                                           "keep": 0.25, "prefill": "minference"}
    assert mod.parse_config("snapkv@0.1", 0.25)["keep"] == 0.1
    assert mod.parse_config("full", 0.25) == {"name": "full", "method": "full", "keep": None, "prefill": None}
    with pytest.raises(SystemExit, match="only '\\+minference'"):
        mod.parse_config("snapkv+dense", 0.25)


def _m(engine, rep, prefill, decode_s, correct, *, warm=False, kv=None, usage=None):
    m = {"model": "M", "length": 100, "prompt_tokens": 130, "rep": rep, "warmup": warm, "engine": engine,
         "config": "dense" if engine.startswith("vllm") else engine.split(":", 1)[1], "dtype": "bfloat16",
         "prefill_seconds": prefill, "decode_seconds": decode_s, "decode_steps": 4, "e2e_seconds": prefill + decode_s,
         "decode_ms_per_token": 1000 * decode_s / 4, "correct": correct, "prefill_cpu_seconds": prefill / 2,
         "decode_cpu_seconds": decode_s, "loadavg_before": [1.0, 1, 1],
         "token_ids": [1, 2, 3, 4, 5] if engine.startswith("vllm") or rep else [1, 2, 9, 4, 5]}
    if engine.startswith("vllm"):
        m.update(vllm_worker="M|rope x1", kv_usage=usage or [])
    else:
        m.update(kv_bytes=kv, stored_tokens=40, prefill_stats={"density": 0.5})
    return m


def _res(kvtrim_prefill: float, kvtrim_kv: int, kvtrim_correct=(True, True)):
    return {
        "setting": {"label": "SMOKE", "threads": 2, "kvtrim_dtype": "bfloat16", "vllm_dtype": "bfloat16", "reps": 2,
                    "max_new_tokens": 5},
        "machine": {"date": "d"},
        "models": {"M": {"rope": {"100": {"context": 1024, "factor": 1.0}}}},
        "vllm": {"M|rope x1": {"block_size": 16, "block_bytes": 1000, "num_blocks": 100, "pool_bytes": 100_000}},
        "measurements": [
            _m("kvtrim:snapkv@0.25+minference", -1, 50.0, 50.0, False, warm=True, kv=1),
            _m("vllm:bfloat16", -1, 50.0, 50.0, False, warm=True, usage=[{"kv_cache_usage": 0.09}]),
            _m("kvtrim:snapkv@0.25+minference", 0, kvtrim_prefill, 0.2, kvtrim_correct[0], kv=kvtrim_kv),
            _m("vllm:bfloat16", 0, 2.0, 0.4, True), _m("vllm:bfloat16", 1, 4.0, 0.4, False),
            _m("kvtrim:snapkv@0.25+minference", 1, kvtrim_prefill, 0.2, kvtrim_correct[1], kv=kvtrim_kv),
        ],
    }


def test_summary_comparison_and_table(mod):
    res = mod.summarize(_res(1.0, 2500))
    v, k = res["summary"]  # vLLM's row first, whatever ran first
    assert k["prefill_density"] == 0.5 and k["stored_tokens"] == 40
    assert v["n"] == 2 and v["prefill_seconds"] == 3.0 and math.isclose(v["e2e_seconds"], 3.4)  # warm-up left out
    assert v["kv_bytes"] == 9000 and v["kv_blocks_used_gauge"] == 9  # 130 + 4 tokens -> 9 blocks of 16
    assert v["correct"] == 1 and k["correct"] == 2 and k["kv_bytes"] == 2500
    (c,) = res["comparison"]
    assert math.isclose(c["e2e_seconds_vllm_over_kvtrim"], 3.4 / 1.2) and math.isclose(c["kv_ratio"], 2500 / 9000)
    assert c["decode_ms_per_token_vllm_over_kvtrim"] == 2.0 and c["answers_kept"] and c["target_met"]
    text = mod.table(res)
    assert text.startswith("**SMOKE**")
    assert "| M | 100 | 130 | vllm | dense (bfloat16) | 3.00 | 1 (dense) | 100.0 | 3.40 | 1.50 | 100.0 | 0.0 | 1/2 | 1.00 |" in text
    assert ("| M | 100 | snapkv@0.25+minference | kvtrim 2.83x | kvtrim 3.00x | kvtrim 2.00x | 0.278x | 2/2 / 1/2 | 2, 5 of 5 | met |"
            in text)


def test_targets_missed_are_named(mod):
    # kvtrim slower (prefill 5 s), KV above 0.3x of vLLM's, and the sample vLLM answered is lost
    res = mod.summarize(_res(5.0, 4000, kvtrim_correct=(False, True)))
    (c,) = res["comparison"]
    assert not c["target_e2e"] and not c["target_kv"] and not c["answers_kept"] and not c["target_met"]
    row = next(line for line in mod.table(res).splitlines() if "snapkv@0.25+minference | vLLM" in line)
    assert "| vLLM 1.53x | vLLM 1.67x | kvtrim 2.00x | 0.444x | 1/2 / 1/2 | 2, 5 of 5 | missed: end to end, KV, answers |" in row


def test_verdict_states_each_configuration_both_ways(mod):
    """--verdict: one line per kvtrim configuration, with who is faster, the KV ratio and what was
    missed; the machine line says whether AMX was there, or that the flags were not recorded."""
    res = mod.summarize(_res(5.0, 4000, kvtrim_correct=(False, True)))
    res["machine"].update(cpu_model="CPU X", cpu_matrix_flags=["avx2", "amx_tile"])
    text = mod.verdict(res, "r.json")
    assert text.startswith("`r.json` (d, CPU X, with AMX, 2 threads per side, medians of 2):")
    assert ("- M, 100 tokens, snapkv@0.25+minference: end to end vLLM 1.53x, prefill vLLM 1.67x, decode kvtrim 2.00x; "
            "KV 0.44x vLLM's; target missed (end to end, KV, answers).") in text.splitlines()
    res = mod.summarize(_res(1.0, 2500))
    assert "CPU flags not recorded" in mod.verdict(res, "r.json") and mod.verdict(res, "r.json").endswith("target met.")
    res["machine"]["cpu_matrix_flags"] = ["avx2"]
    assert "without AMX" in mod.verdict(res, "r.json")
