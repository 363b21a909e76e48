"""The speed-ups docs/minference.md quotes for the rerun of the prefill sweep are the committed result
files' numbers, as the generated tables round them."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def speedup(name: str, length: int) -> str:
    rows = {r["config"]: r for r in json.loads((RESULTS / name).read_text())["records"] if r["length"] == length}
    return f"{rows['dense']['wall_seconds'] / rows['minference']['wall_seconds']:.2f}x"


def test_rerun_paragraph_quotes_both_tables():
    text = (ROOT / "docs" / "minference.md").read_text()
    i = text.index("At 8k the searched config is")
    para = text[i:text.index("\n\n", i)]
    want = [speedup("minference_prefill_epyc.json", 8192), speedup("minference_prefill.json", 8192),
            speedup("minference_prefill_epyc.json", 2048), speedup("minference_prefill.json", 2048),
            speedup("minference_prefill_epyc.json", 1024), speedup("minference_prefill.json", 1024)]
    missing = [n for n in want if n not in para]
    assert not missing, f"docs/minference.md's rerun paragraph lacks {missing}"


def test_results_page_quotes_the_rerun():
    """docs/results.md (where the README's measurements moved) quotes both prefill runs at 8k."""
    text = (ROOT / "docs" / "results.md").read_text()
    i = text.index("prefill is\n")
    assert f"{speedup('minference_prefill_epyc.json', 8192)} in a rerun" in text
    assert speedup("minference_prefill.json", 8192) in text[i:i + 200]
