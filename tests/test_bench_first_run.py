"""benchmarks/first_run.py and benchmarks/test_suite.py: the README's first-run costs and test times
come from committed result files through their tables (tests/test_docs.py checks the blocks)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_first_run_table_quotes_the_committed_result():
    first_run = load_benchmark("first_run")
    r = json.loads((ROOT / "benchmarks/results/first_run.json").read_text())
    text = first_run.table(r)
    assert set(r["models"]) == {"smollm2", "qwen2.5-0.5b"}
    for name, x in r["models"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {x['first_load_seconds']:.0f} s |" in row and f"| {x['later_load_seconds']:.1f} s |" in row
        assert x["cache_bytes"] == sum(x["cache_parts"].values()) > x["source_bytes"] > 0
    assert "pip downloads are not included" in text


def test_du_counts_allocated_blocks(tmp_path):
    first_run = load_benchmark("first_run")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 10_000)
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "a")
    assert 10_000 <= first_run._du(tmp_path / "d") < 10_000 + 8192  # the link is not counted twice
    assert first_run._du(tmp_path / "missing") == 0


def test_test_suite_reads_junit_times_as_node_ids(tmp_path):
    suite = load_benchmark("test_suite")
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_files" name="test_bytes_and_text" '
                   'time="1.5"/><testcase classname="tests.test_files" name="test_x[a-b]" time="0.25"/>'
                   '</testsuite></testsuites>')
    assert suite._junit_times(xml) == {"tests/test_files.py::test_bytes_and_text": 1.5,
                                       "tests/test_files.py::test_x[a-b]": 0.25}
