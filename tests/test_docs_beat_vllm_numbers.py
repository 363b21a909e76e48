"""The numbers docs/dtypes.md quotes in prose about the 2026-12-07 kvtrim-vs-vLLM rerun on the AMX
CPU are those of the committed result files (whose tables test_docs checks)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = " ".join((ROOT / "docs" / "dtypes.md").read_text().split())  # prose lines wrap anywhere


def _rows(name: str) -> dict[tuple[int, str], dict]:
    d = json.loads((RESULTS / "beat_vllm" / name).read_text())
    qwen = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
    return ({(r["length"], r["engine"].split(":")[0]): r for r in d["summary"] if r["model"] == qwen},
            {r["length"]: r for r in d["comparison"] if r["model"] == qwen})


def test_amx_rerun_prose_matches_the_result():
    rows, cmp = _rows("idle_qwen_amx_flat.json")
    old, _ = _rows("idle_amx.json")
    v8, v32, k8, k32 = rows[(7680, "vllm")], rows[(32000, "vllm")], rows[(7680, "kvtrim")], rows[(32000, "kvtrim")]
    assert (f"({v8['prefill_seconds']:.2f} s at 8k and {v32['prefill_seconds']:.2f} s at 32k, against "
            f"{old[(7680, 'vllm')]['prefill_seconds']:.2f} and {old[(32000, 'vllm')]['prefill_seconds']:.2f} s on 2026-12-02)") in DOC
    assert f"took {k8['prefill_seconds']:.2f} s and {k32['prefill_seconds']:.2f} s" in DOC
    assert f"At 32k vLLM is ahead by {1 / cmp[32000]['e2e_seconds_vllm_over_kvtrim']:.2f}x end to end, at 8k by " \
           f"{1 / cmp[7680]['e2e_seconds_vllm_over_kvtrim']:.2f}x" in DOC
    assert not cmp[7680]["target_met"] and not cmp[32000]["target_met"]  # "Missed at both lengths"
    assert all(c["answers_kept"] and round(c["kv_ratio"], 2) == 0.26 for c in cmp.values())
    flat = {(r["length"], r["config"]): r for r in json.loads((RESULTS / "minference_prefill_qwen_bf16_flat.json").read_text())["records"]}
    d8, d32 = flat[(8192, "dense")]["wall_seconds"], flat[(32768, "dense")]["wall_seconds"]
    assert f"takes {d8:.2f} s at 8k and {d32:.2f} s at 32k" in DOC
    assert f"about {d8 / v8['prefill_seconds']:.1f} and {d32 / v32['prefill_seconds']:.1f} times vLLM's dense prefill" in DOC


def test_results_md_names_the_amx_rerun_loss():
    _, cmp = _rows("idle_qwen_amx_flat.json")
    text = " ".join((ROOT / "docs" / "results.md").read_text().split())
    assert (f"by {1 / cmp[32000]['e2e_seconds_vllm_over_kvtrim']:.2f}x at 32k and "
            f"{1 / cmp[7680]['e2e_seconds_vllm_over_kvtrim']:.2f}x at 8k") in text
