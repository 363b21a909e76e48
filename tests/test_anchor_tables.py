"""The kvpress anchor's pure helpers (benchmarks/anchor_kvpress.py): join, cells, table, resumption keys.

The anchor itself needs its own venv (kvpress pins transformers < 5.3); these functions import
nothing heavy, so they are tested here on a tiny fixture.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "anchor_kvpress.py"
_spec = importlib.util.spec_from_file_location("anchor_kvpress", SCRIPT)
ak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ak)


def row(method, keep, sample, score, task="passkey", length=2048, seed=None, depth=None):
    return {"task": task, "length": length, "sample": sample, "seed": sample if seed is None else seed,
            "depth": sample / 19 if depth is None else depth, "method": method, "keep": keep, "score": score}


def test_join_keeps_only_samples_on_both_sides_with_same_seed_and_depth():
    anchor = [row("kvpress:none", None, i, 1.0) for i in (0, 2, 4)]
    kvtrim = [row("full", None, 0, 1.0), row("full", None, 2, 1.0, depth=0.5), row("full", None, 6, 1.0)]
    keys, mismatched = ak.joined_keys(anchor, kvtrim)
    assert keys == {("passkey", 2048, 0)}  # 2: depth differs; 4 and 6: one side only
    assert mismatched == 1


def test_cells_and_table_count_only_joined_samples():
    anchor = [row("kvpress:snapkv", 0.1, 0, 1.0), row("kvpress:snapkv", 0.1, 2, 0.0), row("kvpress:none", None, 0, 1.0),
              row("kvpress:snapkv", 0.5, 4, 1.0)]
    kvtrim = [row("snapkv", 0.1, 0, 0.0), row("snapkv", 0.1, 2, 1.0), row("full", 1.0, 0, 1.0)]
    keys, _ = ak.joined_keys(anchor, kvtrim)
    stats = ak.cell_stats(anchor + kvtrim, keys)
    assert stats[("kvpress:snapkv", "passkey", 2048, 0.1)] == (2, 0.5)
    assert stats[("snapkv", "passkey", 2048, 0.1)] == (2, 0.5)
    assert stats[("full", "passkey", 2048, "full")] == (1, 1.0)  # keep 1.0 counts as the full cache
    assert ("kvpress:snapkv", "passkey", 2048, 0.5) not in stats  # sample 4 has no kvtrim side
    table = ak.markdown_table(stats)
    lines = table.splitlines()
    assert lines[0].startswith("| method | passkey 2k @0.1 | passkey 2k @0.25 | passkey 2k @0.5 | passkey 2k full |")
    assert [ln.split(" | ")[0][2:] for ln in lines[2:]] == ["kvpress:none", "kvpress:snapkv", "full", "snapkv"]
    assert "| kvpress:snapkv | 0.50 (2) |  |  |  |" in lines


def test_resumption_keys_order_and_torn_lines(tmp_path):
    p = tmp_path / "passkey-2048.jsonl"
    d = row("kvpress:tova", 0.25, 3, 1.0)
    p.write_text(json.dumps(d) + "\n" + '{"task": "passk')  # an interrupted last write
    rows = ak.load_lines([p, tmp_path / "missing.jsonl"])
    assert rows == [d]
    assert ak.line_key(rows[0]) == ("passkey", 2048, 3, "kvpress:tova", 0.25)
    assert ak.keep_of(0.75) == 0.25 and ak.keep_of(None) is None
    assert ak.method_name("ExpectedAttention") == "kvpress:expectedattention" and ak.method_name(None) == "kvpress:none"
    assert ak.sample_order(20, 12) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 1, 3]


def test_full_agreement_compares_full_caches_on_joined_samples():
    a = [dict(row("kvpress:none", None, 0, 1.0), answer=" The key is 12345. Done"),
         dict(row("kvpress:none", None, 2, 0.0), answer="no idea")]
    k = [dict(row("full", None, 0, 1.0), answer="The key is 12345"), dict(row("full", None, 2, 1.0), answer="42")]
    keys, _ = ak.joined_keys(a, k)
    assert ak.full_agreement(a, k, keys) == (2, 1, 1)


def test_keep_table_rows_per_keep_means_over_tasks_and_the_verdict():
    rows = []
    for task in ("passkey", "multiturn"):
        rows += [row("kvpress:none", None, 0, 1.0, task=task), row("full", None, 0, 1.0, task=task),
                 row("kvpress:tova", 0.1, 0, 0.5, task=task), row("kvpress:snapkv", 0.1, 0, 0.0, task=task),
                 row("tova", 0.1, 0, 1.0 if task == "passkey" else 0.25, task=task)]
    rows.append(row("snapkv", 0.1, 0, 1.0))  # one task only: no mean, not in the verdict
    text = ak.keep_table(ak.cell_stats(rows, None), 2048)
    lines = text.splitlines()
    assert lines[0] == "| method @ keep | passkey | multiturn | mean |"
    assert "| kvpress:tova @0.1 | 0.50 (1) | 0.50 (1) | 0.50 |" in lines
    assert "| tova @0.1 | 1.00 (1) | 0.25 (1) | 0.62 |" in lines
    assert "| snapkv @0.1 | 1.00 (1) |  |  |" in lines
    assert ("- keep 0.1: kvtrim's best, `tova` (0.625), is ahead of the best press, `kvpress:tova` (0.500), "
            "on the mean over the 2 tasks.") in lines
    assert ak.keep_table({}, 2048) == "(no matched samples)"
