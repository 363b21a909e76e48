"""The numbers docs/dtypes.md quotes in prose about fused CPU layers ("Fused CPU layers") are those
of the committed result files (whose tables test_docs checks)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = " ".join((ROOT / "docs" / "dtypes.md").read_text().split())  # prose lines wrap anywhere


def _prefill() -> dict[tuple[int, str], dict]:
    d = json.loads((RESULTS / "minference_prefill_qwen_bf16_fused.json").read_text())
    return {(r["length"], r["config"]): r for r in d["records"]}


def test_prefill_prose_matches_the_result():
    r = _prefill()

    def wall(n, c):
        return r[(n, c)]["wall_seconds"]

    for n in (8192, 32768):
        assert r[(n, "dense")]["cpu_layers_fused"]["mlp"] == 24 and r[(n, "dense:unfused")]["cpu_layers_fused"]["mlp"] == 0
    assert (f"the dense forward takes {wall(8192, 'dense'):.2f} s at 8k against {wall(8192, 'dense:unfused'):.2f} s unfused "
            f"({wall(8192, 'dense:unfused') / wall(8192, 'dense'):.2f}x faster) and {wall(32768, 'dense'):.2f} s against "
            f"{wall(32768, 'dense:unfused'):.2f} s at 32k ({wall(32768, 'dense:unfused') / wall(32768, 'dense'):.2f}x: there "
            f"attention is {r[(32768, 'dense')]['attention_seconds']:.2f} s of the {wall(32768, 'dense'):.2f}") in DOC
    assert (f"{wall(8192, 'minference'):.2f} against {wall(8192, 'minference:unfused'):.2f} s at 8k, "
            f"{wall(32768, 'minference'):.2f} against {wall(32768, 'minference:unfused'):.2f} s at 32k") in DOC
    assert (f"MInference is {r[(8192, 'minference')]['speedup_wall']:.2f}x at 8k and "
            f"{r[(32768, 'minference')]['speedup_wall']:.2f}x at 32k") in DOC
    assert (f"it would be {wall(8192, 'dense:unfused') / wall(8192, 'minference'):.2f}x and "
            f"{wall(32768, 'dense:unfused') / wall(32768, 'minference'):.2f}x") in DOC
    peak = {c: r[(32768, c)]["forward_peak_rss_mib"] / 1024 for c in ("dense", "dense:unfused")}
    assert f"({peak['dense']:.1f} against {peak['dense:unfused']:.1f} GiB for the dense one at 32k)" in DOC


def test_quality_prose_matches_the_result():
    d = json.loads((RESULTS / "cpu_layers_quality.json").read_text())
    s = {r["variant"]: r for r in d["summary"]}
    bf, bu, ff = s["bfloat16 fused"], s["bfloat16 unfused"], s["float32 fused"]
    assert bf["fused_modules"] == {"mlp": 24, "rms_norm": 49} and ff["fused_modules"] == {"mlp": 0, "rms_norm": 49}
    assert f"perplexity {bf['perplexity']:.4f} against {bu['perplexity']:.4f}" in DOC
    assert f"{bf['logit_rel_error']:.2e}" == f"{bu['logit_rel_error']:.2e}"  # "... of 1.03e-02 both"
    assert f"relative error of the logits of {bf['logit_rel_error']:.2e} both" in DOC
    assert f"at {100 * bf['top1_agreement']:.2f}% of the positions against {100 * bu['top1_agreement']:.2f}%" in DOC
    assert f"its logits move by {ff['logit_rel_error']:.2e}" in DOC
    assert f"{ff['perplexity']:.4f}" == f"{s['float32 unfused']['perplexity']:.4f}"  # "not at all in four decimals"


def test_slices_prose_matches_the_result():
    d = json.loads((RESULTS / "mlp_slices.json").read_text())
    r = {x["config"]: x for x in d["rows"]}
    assert d["default_slice"] == 512
    assert f"The post-operations alone make the MLP {r['fused, one piece']['speedup']:.2f}x faster" in DOC
    assert f"({r['fused, slices of 512']['speedup']:.2f}x at 512 tokens, the slice kvtrim uses" in DOC
    best = min(d["rows"], key=lambda x: x["ms"])
    assert best["config"] == "fused, slices of 512"  # MLP_CHUNK_ROWS: "measured fastest of 128-2,048"
    near = [x for x in d["rows"] if x["config"] in ("fused, slices of 256", "fused, slices of 1024", "fused, slices of 2048")]
    assert all(x["ms"] / best["ms"] < 1.05 for x in near)  # "256 to 2,048 are within a few percent of it"
