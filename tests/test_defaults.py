"""Defaults that agree with the docs: sparse prefill's minimum length is one number for the command line,
the Python hook and the vLLM plugin, and the docs say why it is not the measured break-even, quoting
the committed timings."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvtrim.cli import build_parser
from kvtrim.integrations import prefill
from kvtrim.integrations.vllm import config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _speedup(name: str, length: int) -> float:
    rows = {r["config"]: r for r in json.loads((RESULTS / name).read_text())["records"] if r["length"] == length}
    return rows["dense"]["wall_seconds"] / rows["minference"]["wall_seconds"]


def _quality_speedup(length: int) -> float:
    rows = [r for r in json.loads((RESULTS / "minference_quality.json").read_text())["rows"]
            if r["kind"] == "passkey" and r["length"] == length]
    med = {p: statistics.median(r["prefill_seconds"] for r in rows if r["prefill"] == p) for p in ("dense", "minference")}
    return med["dense"] / med["minference"]


def test_one_minimum_length_for_the_cli_the_hook_and_the_vllm_plugin():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    cli = next(a for a in sub.choices["generate"]._actions if a.dest == "prefill_min_length").default
    assert cli == prefill.DEFAULT_MIN_LENGTH == config.DEFAULT_MIN_LENGTH == config.PluginConfig().min_length
    assert prefill.SparsePrefill("a_shape").min_length == prefill.DEFAULT_MIN_LENGTH


def test_the_docs_say_why_the_default_is_not_the_break_even():
    crossover = json.loads((RESULTS / "minference_prefill.json").read_text())["summary"]["minference"]["crossover_length"]
    assert crossover < prefill.DEFAULT_MIN_LENGTH
    text = (ROOT / "docs" / "minference.md").read_text()
    why = text[text.index("- **Why 4096**"):]
    why = why[:why.index("\n- **")]
    at_2k = [_speedup("minference_prefill.json", 2048), _speedup("minference_prefill_epyc.json", 2048), _quality_speedup(2048)]
    at_4k = [_speedup("minference_prefill.json", 4096), _speedup("minference_prefill_epyc.json", 4096), _quality_speedup(4096)]
    for s in at_2k:
        assert f"{s:.2f}x" in why, (s, why)
    assert f"{min(at_4k):.2f}-{max(at_4k):.2f}x" in why, (at_4k, why)
    assert str(prefill.DEFAULT_MIN_LENGTH) in why and "--prefill-min-length 2048" in why
    readme = (ROOT / "README.md").read_text()
    assert f"break-even at {crossover} tokens, and `--prefill-min-length` keeps prompts under {prefill.DEFAULT_MIN_LENGTH} dense" in readme
