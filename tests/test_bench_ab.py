"""``benchmarks/bench_ab.py`` end to end on a tiny model: both sides run in fresh processes that import
the checkout they name, the repetitions alternate, and the table and ratios come from the samples."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_two_checkouts_interleaved_on_a_tiny_model(tmp_path, tiny_dir, capsys):
    ab = load_benchmark("bench_ab")
    out = tmp_path / "ab.json"
    # the same checkout on both sides: the mechanics, not a comparison
    assert ab.main(["--old", SRC, "--new", SRC, "--model", tiny_dir, "--length", "300", "--new-tokens", "3",
                    "--methods", "full,snapkv", "--reps", "2", "--warmup", "0", "--threads", "1",
                    "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["methods"]) == {"full", "snapkv"} and r["reps"] == 2
    for m in r["methods"].values():
        assert len(m["samples"]["old"]) == len(m["samples"]["new"]) == 2
        assert m["same_tokens"]  # one checkout, greedy: the same tokens every time
        assert abs(m["prefill_ratio"] - m["new"]["prefill_s"] / m["old"]["prefill_s"]) < 1e-12
    assert r["machine"]["loadavg_end"]
    table = capsys.readouterr().out
    assert "| snapkv |" in table and "new/old" in table
    capsys.readouterr()
    assert ab.main(["--table", str(out)]) == 0
    assert capsys.readouterr().out.strip() == ab.table(r).strip()
