"""Numbers that docs/memory.md quotes in prose about the Qwen2.5-Coder-0.5B-Instruct chunked prefills are the
committed result files' numbers, rounded as written (the tables themselves are generated blocks,
checked by tests/test_docs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prefill_memory"
MIB = 2**20


def record(name: str, method: str) -> tuple[dict, dict]:
    d = json.loads((RESULTS / name).read_text())
    (r,) = [r for r in d["records"] if r["method"] == method]
    return d, r


def over_loaded(d: dict, r: dict) -> float:
    return (r["peak_rss"] - d["base_rss"]) / MIB


def paragraph(start: str, end: str) -> str:
    """The text of docs/memory.md from ``start`` to ``end``, its line breaks as spaces (prose wraps at any space)."""
    text = (ROOT / "docs" / "memory.md").read_text()
    i = text.index(start)
    return " ".join(text[i:text.index(end, i)].split())


def test_qwen_32k_elastic_paragraph_quotes_the_results():
    before_d, before = record("qwen_32k_elastic.json", "elastic")
    after_d, after = record("qwen_32k_elastic_merge.json", "elastic")
    assert not before["holds"] and after["holds"]
    assert after["kv"] == before["kv"]
    table_d, _ = record("qwen_32k_epyc_mmap.json", "elastic")
    rows = {r["method"]: r for r in table_d["records"]}
    assert rows["elastic"]["peak_rss"] == after["peak_rss"]  # the table shows the measurement after the change
    others = [over_loaded(table_d, r) for m, r in rows.items() if m != "elastic"]
    assert over_loaded(after_d, after) > max(others)  # "the highest of the five"
    bound_over = round(after["bound"] / MIB) - round(after_d["base_rss"] / MIB)  # as the table rounds them
    text = paragraph("SnapKV, H2O, StreamingLLM and Inf-MLLM peak", "The earlier measurement (2026-12-01")
    want = [f"{over_loaded(after_d, after):.0f} MiB over loaded", f"against the same {bound_over:.0f}",
            f"{after['kv'] / MIB:.1f} MiB", f"{after['seconds']:.0f} s", f"{over_loaded(before_d, before):.0f} MiB over loaded",
            f"missed the bound by {(before['peak_rss'] - before['bound']) / MIB:.0f} MiB",
            f"by {over_loaded(before_d, before) - over_loaded(after_d, after):.0f} MiB",
            f"{min(others):.0f}-{max(others):.0f} MiB over loaded"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/memory.md's Qwen 32k paragraph lacks {missing}"


def test_qwen_16k_paragraph_quotes_the_results():
    d = json.loads((RESULTS / "qwen_16k_epyc_mmap.json").read_text())
    rows = {r["method"]: r for r in d["records"]}
    assert set(rows) == {"full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"}
    assert all(r["holds"] for r in rows.values())  # "every method holds the bound"
    full = rows.pop("full")
    over = [over_loaded(d, r) for r in rows.values()]
    kv = {round(r["kv"] / MIB, 1) for r in rows.values()}
    assert len(kv) == 1
    text = paragraph("The five compressing methods peak", "The earlier measurement (2026-12-01")
    ratio = over_loaded(d, full) / max(over)
    want = [f"{min(over):.0f}-{max(over):.0f} MiB over loaded", f"{kv.pop():.1f} MiB of compressed KV",
            f"peaks {over_loaded(d, full):.0f} MiB over loaded", f"{full['kv'] / MIB:.1f} MiB of KV",
            f"by {int(ratio * 10) / 10:.1f}x or more", f"({d['chunk_working_set'] / MIB:.0f} MiB)"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/memory.md's Qwen 16k paragraph lacks {missing}"


def test_qwen_16k_defaults_sentence_quotes_the_results():
    d = json.loads((RESULTS / "qwen_16k_epyc.json").read_text())
    plain = {r["method"]: r for r in d["records"] if not r.get("allocator")}
    fixed = {r["method"]: r for r in d["records"] if r.get("allocator")}
    assert set(plain) == set(fixed) == {"full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"}
    assert not any(r["holds"] for r in plain.values()) and all(r["holds"] for r in fixed.values())
    full = plain.pop("full")
    over = [over_loaded(d, r) for r in plain.values()]
    text = paragraph("With glibc's defaults (item 9b", "The earlier measurement (2026-12-01")
    el = plain["elastic"]
    want = [f"{min(over):.0f}-{max(over):.0f} MiB over loaded", f"full cache {over_loaded(d, full):.0f}",
            f"by {round(el['peak_rss'] / MIB) - round(el['bound'] / MIB)} MiB"]
    missing = [n for n in want if n not in text]
    assert not missing, f"docs/memory.md's Qwen 16k defaults sentence lacks {missing}"


def span(d: dict, recs: list[dict]) -> str:
    over = [over_loaded(d, r) for r in recs]
    return f"{min(over):.0f}-{max(over):.0f}"


def trimmed_against_earlier(name: str, earlier: str, n: int) -> tuple[str, str, str, float]:
    """(the trimmed run's compressing span, the earlier defaults' span, the earlier fixed threshold's
    span, the trimmed full cache's MiB over loaded), all against the same bound."""
    d = json.loads((RESULTS / name).read_text())
    rows = {r["method"]: r for r in d["records"]}
    assert set(rows) == {"full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"}
    assert all(r["length"] == n and not r.get("allocator") for r in rows.values())  # glibc's defaults
    assert all(r["holds"] for r in rows.values())  # "every method holds the bound"
    full = rows.pop("full")
    e = json.loads((RESULTS / earlier).read_text())
    assert (e["base_rss"], e["chunk_working_set"]) == (d["base_rss"], d["chunk_working_set"])  # the same bound
    old = [r for r in e["records"] if r["method"] != "full" and not r.get("allocator")]
    fixed = [r for r in e["records"] if r["method"] != "full" and r.get("allocator")]
    return span(d, list(rows.values())), span(e, old), span(e, fixed), over_loaded(d, full)


def test_qwen_trimmed_paragraph_quotes_the_results():
    t8, o8, f8, full8 = trimmed_against_earlier("qwen_8k_trim.json", "qwen_8k_epyc_mmap4.json", 8192)
    t16, o16, f16, full16 = trimmed_against_earlier("qwen_16k_trim.json", "qwen_16k_epyc.json", 16384)
    text = paragraph("With the trimming, every method holds the bound", "The earlier measurement (2026-12-01")
    want = [f"at 8k {t8} MiB over loaded (before: {o8} with the defaults, {f8} with the fixed threshold)",
            f"at 16k {t16} (before: {o16} and {f16})", f"peaks {full8:.0f} MiB over loaded at 8k and {full16:.0f} at 16k"]
    missing = [w for w in want if w not in text]
    assert not missing, f"docs/memory.md's trimmed-heap paragraph lacks {missing}"


def test_qwen_32k_trimmed_paragraph_quotes_the_results():
    d = json.loads((RESULTS / "qwen_32k_trim.json").read_text())
    rows = {r["method"]: r for r in d["records"]}
    assert set(rows) == {"full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic"}
    assert all(r["length"] == 32768 and not r.get("allocator") for r in rows.values())  # glibc's defaults
    el_d, el = record("qwen_32k_elastic_trim.json", "elastic")
    assert rows["elastic"]["peak_rss"] == el["peak_rss"]  # the Elastic row is item 10b's
    fixed_d = json.loads((RESULTS / "qwen_32k_epyc_mmap.json").read_text())
    fixed = {r["method"]: r for r in fixed_d["records"]}
    for e in (el_d, fixed_d):
        assert (e["base_rss"], e["chunk_working_set"]) == (d["base_rss"], d["chunk_working_set"])  # the same bound
    full, elastic = rows.pop("full"), rows.pop("elastic")
    assert full["holds"] and elastic["holds"] and not any(r["holds"] for r in rows.values())  # "Elastic Cache only"
    bound_over = round(elastic["bound"] / MIB) - round(d["base_rss"] / MIB)  # as the table rounds them
    missed = [round(r["peak_rss"] / MIB) - round(r["bound"] / MIB) for r in rows.values()]
    old = [over_loaded(fixed_d, fixed[m]) for m in rows]
    text = paragraph("at 32k only Elastic Cache held the bound with the trimming", "Where the 32k excess comes from")
    want = [f"peaks {over_loaded(d, elastic):.0f} MiB over loaded against the bound's {bound_over}",
            f"peaked {over_loaded(fixed_d, fixed['elastic']):.0f}, the 32k table above",
            f"peak {span(d, list(rows.values()))} MiB over loaded, {min(missed)}-{max(missed)} MiB over the bound",
            f"they peaked {min(old):.0f}-{max(old):.0f}", f"peaks {over_loaded(d, full):.0f} MiB over loaded",
            f"its {full['kv'] / MIB:.1f} MiB of KV"]
    missing = [w for w in want if w not in text]
    assert not missing, f"docs/memory.md's 32k trimmed paragraph lacks {missing}"


def test_heap_trim_cost_sentence_quotes_the_results():
    text = paragraph("The trimming makes this prefill", "The earlier measurement (2026-12-01")
    want = []
    for name in ("heap_trim_time_qwen.json", "heap_trim_time_smollm2.json"):
        d = json.loads((RESULTS / name).read_text())
        on, off = d["results"]["on"], d["results"]["off"]
        assert on["trims"] > 0 and off["trims"] == 0
        assert d["ratio_on_over_off"] == on["median"] / off["median"]
        want += [f"{(d['ratio_on_over_off'] - 1) * 100:.0f}% slower", f"{on['median']:.2f} against {off['median']:.2f} s",
                 f"{on['trims']:,} trims", f"{(on['median'] - off['median']) / on['trims'] * 1000:.1f} ms"]
    missing = [w for w in want if w not in text]
    assert not missing, f"docs/memory.md's trimming-cost sentence lacks {missing}"


def test_qwen_12k_same_budget_sentence_quotes_the_results():
    trimmed, fixed, ws = {}, {}, []
    for m in ("streaming_llm", "snapkv"):
        d = json.loads((RESULTS / f"qwen_12k_budget3277_{m}.json").read_text())
        assert d["keep"] == 0.2667 and math.floor(12288 * d["keep"]) == math.floor(32768 * 0.1) + 1  # about 32k's budget
        recs = {bool(r.get("allocator")): r for r in d["records"] if r["method"] == m and r["length"] == 12288}
        assert all(r["holds"] for r in recs.values())
        trimmed[m], fixed[m] = over_loaded(d, recs[False]), over_loaded(d, recs[True])
        ws.append(d["chunk_working_set"] / MIB)
    d32 = json.loads((RESULTS / "qwen_32k_trim.json").read_text())
    el = next(r for r in d32["records"] if r["method"] == "elastic")
    bound_over = (el["bound"] - d32["base_rss"]) / MIB
    assert max(trimmed.values()) < bound_over and max(fixed.values()) < bound_over  # "inside the 32k bound's 416 too"
    saved = [trimmed[m] - fixed[m] for m in trimmed]
    w10 = json.loads((RESULTS / "qwen_8k_trim.json").read_text())["chunk_working_set"] / MIB
    budget = paragraph("Where the 32k excess comes from", "There the peaks are")
    assert f"budget ({math.floor(32768 * 0.1):,} tokens)" in budget and f"= {math.floor(32768 * 0.1) + 2048:,} keys" in budget
    assert f"keep 0.2667: {math.floor(12288 * 0.2667):,} tokens" in budget
    text = paragraph("There the peaks are", "**What the trimming costs in time.**")
    want = [f"{trimmed['streaming_llm']:.0f} (StreamingLLM) and {trimmed['snapkv']:.0f} MiB (SnapKV) over loaded",
            f"{fixed['streaming_llm']:.0f} and {fixed['snapkv']:.0f} with the fixed threshold",
            f"32k bound's {round(el['bound'] / MIB) - round(d32['base_rss'] / MIB)} too",
            f"only {min(saved):.0f}-{max(saved):.0f} MiB", f"measured {w10:.0f} MiB", f"{ws[0]:.0f} and {ws[1]:.0f} (item 12)"]
    missing = [w for w in want if w not in text]
    assert not missing, f"docs/memory.md's same-budget sentence lacks {missing}"


def test_weights_read_paragraph_quotes_the_results():
    """The rerun with every weight resident before the base: every row holds; the numbers in its prose."""
    d = json.loads((RESULTS / "qwen_read.json").read_text())
    assert all(r["weights_read"] for r in [*d["chunk_alone_runs"], *d["records"]])
    assert {(r["length"], r["method"]) for r in d["records"]} == {
        (n, m) for n in (8192, 16384, 32768) for m in ("full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic")}
    assert all(r["holds"] and not r.get("allocator") and r["chunk"] == 2048 for r in d["records"])
    ws = sorted(round((r["peak_rss"] - r["base_rss"]) / MIB) for r in d["chunk_alone_runs"])
    w = round(d["chunk_working_set"] / MIB)
    assert w == ws[1]  # the median run
    by = {n: [r for r in d["records"] if r["length"] == n and r["method"] != "full"] for n in (8192, 16384, 32768)}
    full32 = next(r for r in d["records"] if r["length"] == 32768 and r["method"] == "full")
    # with the smallest chunk-alone increment measured that day (the two processes' own runs included) too
    own = [json.loads((RESULTS / f"qwen_read_{x}.json").read_text())["chunk_working_set"] for x in "ab"]
    smallest = min([d["chunk_working_set"], *own])
    assert all(r["peak_rss"] <= d["base_rss"] + 2 * r["kv"] + smallest for r in d["records"])
    old = json.loads((RESULTS / "qwen_32k_trim.json").read_text())
    now32 = {r["method"]: r for r in by[32768]}
    drop = [over_loaded(old, r) - over_loaded(d, now32[r["method"]]) for r in old["records"]
            if r["method"] in ("snapkv", "h2o", "streaming_llm", "inf_mllm")]

    def bound_over(rs):
        (b,) = {round(r["bound"] / MIB) - round(d["base_rss"] / MIB) for r in rs}
        return b

    text = paragraph("Every method holds the bound at 8k, 16k and 32k with glibc's defaults", "**What the trimming costs")
    want = [f"at 32k the compressing methods peak {span(d, by[32768])} MiB over loaded against the bound's {bound_over(by[32768])}",
            f"twice {now32['snapkv']['kv'] / MIB:.1f} MiB of KV and W, {w} MiB",
            f"at 16k {span(d, by[16384])} against {bound_over(by[16384])}",
            f"at 8k {span(d, by[8192])} against {bound_over(by[8192])}",
            f"peaks {over_loaded(d, full32):.0f} MiB over loaded at 32k, its {full32['kv'] / MIB:.1f} MiB of KV",
            f"are {min(drop):.0f}-{max(drop):.0f} MiB lower here",
            f"measured {ws[0]}, {ws[1]} and {ws[2]} MiB, and {max(own) / MIB:.0f} and {min(own) / MIB:.0f}",
            f"with the smallest ({round(smallest / MIB)}) every row holds"]
    missing = [x for x in want if x not in text]
    assert not missing, f"docs/memory.md's weights-read paragraph lacks {missing}"
    intro = paragraph("On SmolLM2, whose output layer", "The bound of")
    assert f"it was {min(drop):.0f}-{max(drop):.0f} MiB at 32k" in intro
