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
    b = block(md, "kvtrim.tools.docs_tables kvzip_qwen -->")
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
    assert mem["kvzip @0.25"][0].startswith("26.2 ") and mem["tova @0.25"][0].startswith("25.8 ")
    assert "(26.2 MiB at keep 0.25 against 25.8)" in prose
    mean = head.index("mean score (full ≥ 0.5)")
    m = {(k, meth): score[f"{meth} @{k}"][mean] for k in ("0.1", "0.25", "0.5") for meth in ("kvzip", "tova", "snapkv")}
    assert (m["0.25", "kvzip"], m["0.25", "tova"], m["0.25", "snapkv"]) == ("0.89", "0.86", "0.74")
    assert (m["0.5", "kvzip"], m["0.5", "tova"], m["0.1", "tova"], m["0.1", "kvzip"]) == ("0.96", "0.95", "0.71", "0.56")
    assert ("`kvzip` has the best mean at keep 0.25 (0.89;\n  `tova` 0.86, `snapkv` 0.74) and 0.5 (0.96; `tova` 0.95), "
            "and **`tova` the best at keep 0.1 (0.71\n  against `kvzip`'s 0.56)**") in prose
    lf, vt = head.index("labelfree"), head.index("vt")
    assert [score[f"{x} @{k}"][lf] for x in ("kvzip", "tova") for k in ("0.1", "0.25")] == ["0.29", "0.47", "0.59", "0.65"]
    assert [score[f"{x} @0.1"][vt] for x in ("kvzip", "tova", "streaming_llm")] == ["0.00", "0.08", "0.22"]
    assert "0.29 / 0.47 at keep 0.1 / 0.25 against `tova`'s 0.59 / 0.65" in prose
    assert "(`vt` 0.00, `tova` 0.08, `streaming_llm` 0.22)" in prose


def test_anchors_md_kvzip_prose():
    md = ROOT / "docs" / "anchors.md"
    b = block(md, "benchmarks/anchor_kvpress.py --table benchmarks/results/anchor_kvpress_qwen")
    t = cells(b, "| method @ keep")
    head = t["method @ keep"]
    col = {c: head.index(c) for c in ("multiturn", "niah_multikey", "labelfree", "vt", "mean")}

    def v(row, c):
        return re.match(r"[0-9.]+", t[row][col[c]]).group(0)
    assert (v("kvzip @0.1", "multiturn"), v("kvpress:kvzip @0.1", "multiturn")) == ("0.80", "0.65")
    assert (v("kvzip @0.25", "multiturn"), v("kvpress:kvzip @0.25", "multiturn")) == ("0.97", "0.95")
    assert (v("kvzip @0.5", "labelfree"), v("kvpress:kvzip @0.5", "labelfree")) == ("0.82", "0.73")
    assert (v("kvzip @0.25", "labelfree"), v("kvpress:kvzip @0.25", "labelfree")) == ("0.47", "0.51")
    assert [v(r, "vt") for r in ("kvpress:kvzip @0.25", "kvpress:kvzip @0.5", "kvzip @0.25", "kvzip @0.5")] == [
        "0.38", "0.44", "0.34", "0.26"]
    assert v("kvzip @0.25", "niah_multikey") == v("kvpress:kvzip @0.25", "niah_multikey") == "1.00"
    assert (v("kvzip @0.1", "mean"), v("kvpress:kvzip @0.1", "mean")) == ("0.47", "0.29")
    bullets = b[b.index("- keep 0.1:"):]
    assert "`tova` (0.604), is ahead of the best press, `kvpress:tova` (0.389)" in bullets
    assert "`kvzip` (0.798), is behind the best press, `kvpress:kvzip` (0.807)" in bullets
    assert "`kvzip` (0.846), is behind the best press, `kvpress:kvzip` (0.862)" in bullets
    prose = " ".join(md.read_text().split())
    assert ("**kvpress's KVzip is ahead at keep 0.25 (0.807 against 0.798) and 0.5 (0.862 against 0.846)**, and "
            "kvtrim's is ahead at keep 0.1 (0.47 against 0.29)") in prose
    assert "multi-turn chat at keep 0.1 (0.80 against kvpress's 0.65) and 0.25 (0.97 against 0.95)" in prose
    assert "(`labelfree`) at keep 0.5 (0.82 against 0.73)" in prose
    assert "(0.38 and 0.44 against 0.34 and 0.26) and the open question at keep 0.25 (0.51 against 0.47)" in prose
    counts = {c[c.index("("):] for row in t.values() for c in row if "(" in c}
    assert counts == {"(10)"}, counts  # every cell holds the pool's 10 samples


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
    t = cells(block(md, "benchmarks/bench_spans.py --merge"), "| config")
    assert t["kvzip@0.2"] == ["4/8", "3/5", "", "", "7/13"]
    assert t["tova@0.2"][-1] == "3/13" and t["snapkv window=64@0.2"][-1] == "6/13"
    assert "7 of 13, as many as default `snapkv` and fewer than `kernel=11`\n(11)" in text


def test_methods_md_kvzip_16k_prose():
    md = ROOT / "docs" / "methods.md"
    b = block(md, "kvtrim.tools.docs_tables kvzip_qwen16k")
    score = cells(b)
    mt = score["method @ keep"].index("multiturn")
    assert (score["kvzip @0.25"][mt], score["tova @0.25"][mt], score["full"][mt], score["snapkv @0.25"][mt]) == (
        "0.82", "0.82", "0.97", "0.60")
    turns = cells(b, "#### multiturn score per turn")
    assert turns["kvzip @0.25"][1:] == ["1.00", "1.00", "0.70", "0.60"]
    assert turns["tova @0.25"][2] == "0.80"  # two of ten second questions missed
    prose = " ".join(md.read_text().split())
    assert ("`kvzip` scores 0.82 on the 16k chat, the same as `tova`** (full cache 0.97, `snapkv` 0.60)") in prose
    assert "(turn 3: 0.70, turn 4: 0.60)" in prose


def test_readme_one_question_pick_numbers():
    """The README's one-question pick quotes tova against snapkv from the joined 4k tables and the spans table."""
    md = ROOT / "docs" / "methods.md"
    score = cells(block(md, "kvtrim.tools.docs_tables kvzip_qwen -->"))
    head = score["method @ keep"]
    ns, vt = head.index("niah_single"), head.index("vt")
    assert (score["tova @0.1"][ns], score["snapkv @0.1"][ns]) == ("0.90", "0.60")
    assert all(float(score[f"tova @{k}"][vt]) < float(score[f"snapkv @{k}"][vt]) for k in ("0.1", "0.25", "0.5"))
    for task in ("passkey", "niah_single", "niah_multikey", "labelfree"):
        i = head.index(task)
        assert all(float(score[f"tova @{k}"][i]) >= float(score[f"snapkv @{k}"][i]) for k in ("0.1", "0.25", "0.5")), task
    text = md.read_text()
    spans = cells(block(md, "benchmarks/bench_spans.py --merge"), "| config")
    assert spans["tova@0.2"][-1] == "3/13"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "(one needle at keep 0.1: 0.90 against `snapkv`'s 0.60) except the variable chains (`vt`)" in readme
    assert "`tova` found 3 of 13 natural needles where `snapkv` found 7" in readme
    assert "(`snapkv` 7, `kernel=11` 11 on the same 13)" in " ".join(text.split())
