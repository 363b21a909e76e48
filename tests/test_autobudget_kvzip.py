"""The reference model's calibration with ``kvzip`` (docs/autobudget.md): its calibration lines were
appended to ``qwen-bits-calib`` from ``eval_kvzip_rest``, a sweep of the same samples, so every such
line must be one of that sweep's and the two sweeps' full-cache answers must agree; the prose's
numbers are the committed held-out result's."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIB = ROOT / "benchmarks/results/autobudget/qwen-bits-calib"
REST = ROOT / "benchmarks/results/eval_kvzip_rest"
TASKS = ("passkey", "niah_single", "labelfree")


def lines(d: Path, task: str) -> list[dict]:
    return [json.loads(x) for x in (d / "runs" / f"{task}-4096.jsonl").read_text().splitlines() if x.strip()]


def test_kvzip_calibration_lines_are_the_sweeps_and_the_full_answers_agree():
    for task in TASKS:
        calib, rest = lines(CALIB, task), lines(REST, task)
        moved = [r for r in calib if r["method"] == "kvzip"]
        assert len(moved) == 30 and all(r in rest for r in moved), task
        full_c = {r["sample"]: r for r in calib if r["method"] == "full" and r.get("kv_bits", 16) == 16}
        full_r = {r["sample"]: r for r in rest if r["method"] == "full"}
        assert sorted(full_r) == sorted(full_c) == list(range(10))
        for s, r in full_r.items():
            c = full_c[s]
            assert (r["answer"], r["prompt_tokens"], r["seed"]) == (c["answer"], c["prompt_tokens"], c["seed"])
            assert abs(float(r["score"]) - float(c["score"])) <= 1e-9
    assert json.loads((CALIB / "config.json").read_text()) == json.loads((REST / "config.json").read_text())


def test_shipped_calibration_is_the_committed_build_with_kvzip():
    shipped = json.loads((ROOT / "src/kvtrim/calibration/qwen2.5-0.5b.json").read_text())
    built = json.loads((ROOT / "benchmarks/results/autobudget/qwen2.5-0.5b-bits.json").read_text())
    assert shipped == built and "kvzip" in shipped["methods"]
    assert {p["bits"] for p in shipped["methods"]["kvzip"]} == {16}


def test_autobudget_md_kvzip_prose():
    res = json.loads((ROOT / "benchmarks/results/autobudget/heldout_bits_qwen.json").read_text())["result"]
    grid = {(g["method"], g["keep"], g["bits"]): g for g in res["grid"]}
    k25 = grid["kvzip", 0.25, 16]
    assert (round(k25["heldout_agreement"], 2), round(k25["heldout_worst_task"], 2)) == (0.99, 0.97)
    best16 = max((g for g in res["grid"] if g["bits"] == 16), key=lambda g: g["heldout_agreement"])
    assert (best16["method"], best16["keep"]) == ("kvzip", 0.25)
    cal = json.loads((ROOT / "benchmarks/results/autobudget/qwen2.5-0.5b-bits.json").read_text())
    p25 = next(p for p in cal["methods"]["kvzip"] if p["keep"] == 0.25)
    assert round(p25["tasks"]["labelfree"]["agreement"], 2) == 0.47
    rows = [r for r in res["rows"] if r["method"] == "kvzip"]
    assert all(r["hindsight_16bit_keep"] == 0.25 and round(r["hindsight_16bit_kv_share"], 3) == 0.271 for r in rows)
    assert all(r["pick"]["picks"] in (["1@4"], ["1@8"]) for r in rows)  # never picked compressed: the full cache at 4 or 8 bits
    text = " ".join((ROOT / "docs/autobudget.md").read_text().split())
    assert "(`labelfree`, 0.47 at keep 0.25), while on the held-out tasks keep 0.25 agrees 0.99 (worst task 0.97)" in text
    assert "reaches every `Q` up to 0.95 in hindsight (0.271 of the full cache)" in text
