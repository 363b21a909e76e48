"""The numbers docs/methods.md and docs/anchors.md quote in prose about ``kvzip`` are the cells of the
generated tables beside them (which test_docs checks against the committed results)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def block(path: Path, marker: str) -> str:
    text = path.read_text()
    i = text.index(f"<!-- generated: {marker}")
    return text[i:text.index("<!-- end generated -->", i)]


def cells(table_text: str, heading: str | None = None) -> dict[str, list[str]]:
    """Row label -> its cells, from the first markdown table after ``heading`` (or the first one)."""
    text = table_text if heading is None else table_text[table_text.index(heading):]
    rows: dict[str, list[str]] = {}
    started = False
    for line in text.splitlines():
        if line.startswith("|"):
            started = True
            parts = [p.strip() for p in line.strip("|").split("|")]
            rows.setdefault(parts[0], parts[1:])
        elif started:
            break
    return rows


def test_methods_md_kvzip_prose():
    md = ROOT / "docs" / "methods.md"
    b = block(md, "kvtrim.tools.docs_tables kvzip_qwen")
    score = cells(b)
    head = score["method @ keep"]
    col = {name: head.index(name) for name in ("multiturn", "niah_multikey")}
    turns = cells(b, "#### multiturn score per turn")
    prose = md.read_text()

    def later(row):  # turns 2-4
        v = [float(x) for x in turns[row][2:5]]
        return f"{min(v):.2f}-{max(v):.2f}"
    assert later("kvzip @0.1") == "0.70-0.80" and later("tova @0.1") == "0.20-0.30" and later("snapkv @0.1") == "0.00-0.10"
    assert ("(per turn above: 0.70-0.80 of\n  turns 2-4 at keep 0.1, where `tova`, chat's default, answers 0.20-0.30 and "
            "`snapkv` 0.00-0.10)") in prose
    mk = {m: score[f"{m} @0.1"][col["niah_multikey"]] for m in ("tova", "snapkv", "kvzip")}
    assert (mk["tova"], mk["snapkv"], mk["kvzip"]) == ("0.60", "0.30", "0.20")
    assert "**`tova` (0.60) and `snapkv` (0.30) are ahead of\n  `kvzip` (0.20)**" in prose
    mk25 = {m: score[f"{m} @0.25"][col["niah_multikey"]] for m in ("tova", "snapkv", "kvzip")}
    assert (mk25["kvzip"], mk25["tova"], mk25["snapkv"]) == ("1.00", "0.80", "0.70")
    assert "answers all (1.00; `tova` 0.80, `snapkv` 0.70)" in prose
    mem = cells(b, "#### Memory and time")
    assert mem["kvzip @0.25"][0].startswith("26.8 ") and mem["tova @0.25"][0].startswith("25.8 ")
    assert "(26.8 MiB at keep 0.25 against 25.8)" in prose


def test_anchors_md_kvzip_prose():
    md = ROOT / "docs" / "anchors.md"
    b = block(md, "benchmarks/anchor_kvpress.py --table benchmarks/results/anchor_kvpress_qwen")
    t = cells(b, "| method @ keep")
    head = t["method @ keep"]
    mt, mk = head.index("multiturn"), head.index("niah_multikey")

    def v(row, c):
        return re.match(r"[0-9.]+", t[row][c]).group(0)
    assert (v("kvzip @0.1", mt), v("kvpress:kvzip @0.1", mt)) == ("0.80", "0.60")
    assert (v("kvzip @0.25", mt), v("kvpress:kvzip @0.25", mt)) == ("1.00", "0.95")
    assert (v("kvzip @0.1", mk), v("kvpress:kvzip @0.1", mk)) == ("0.17", "0.00")
    assert v("kvzip @0.25", mk) == v("kvpress:kvzip @0.25", mk) == "1.00"
    prose = md.read_text()
    assert "multi-turn chat at keep 0.1 (kvtrim's 0.80 against kvpress's 0.60) and 0.25 (1.00 against 0.95)" in prose
    assert "both near zero at keep 0.1 (0.17 and 0.00)" in prose


def test_methods_md_kvzip_cost_prose():
    """The prefill ratio the prose quotes is the generated cost table's, rounded to one decimal."""
    md = ROOT / "docs" / "methods.md"
    b = block(md, "benchmarks/bench_kvzip_cost.py --table benchmarks/results/kvzip_cost.json")
    t = cells(b, "| configuration")
    ratio = float(t["kvzip"][1])
    decode = float(t["kvzip"][3])
    prose = md.read_text()
    assert f"The prefill is about {ratio:.1f} times the full cache's" in prose
    assert decode <= 1.10 and "The decode step is within 10% of a full cache" in prose


def test_methods_md_kvzip_natural_needles_prose():
    """The natural-needle counts quoted for kvzip are the spans table's cells."""
    md = ROOT / "docs" / "methods.md"
    text = md.read_text()
    i = text.index("<!-- generated: benchmarks/bench_spans.py --merge")
    t = cells(text[i:text.index("<!-- end generated -->", i)], "| config")
    assert t["kvzip@0.2"] == ["4/8", "3/5", "", "", "7/13"]
    assert t["tova@0.2"][-1] == "3/13" and t["snapkv window=64@0.2"][-1] == "6/13"
    assert "7 of 13, as many as default `snapkv` and fewer than `kernel=11`\n(11)" in text
