"""The committed sweep reproduces: sample 0 of the embedded model's 2048-token pass-key sweep
(``benchmarks/results/eval_baseline``), rerun with every method and budget it holds, gives the same
answers and keeps the same number of tokens as the lines committed before policies returned
decisions. (Every other stored case: ``tests/test_decision_replay.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

BASELINE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eval_baseline"


def _lines(folder: Path, task: str, sample: int) -> dict:
    out = {}
    for line in (folder / "runs" / f"{task}-2048.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["sample"] == sample:
            out[(r["method"], r["keep"])] = r
    return out


def test_sample_0_of_the_committed_passkey_sweep_reproduces(tmp_path, real):
    from kvtrim.cli import main

    want = _lines(BASELINE, "passkey", 0)
    methods = sorted({m for m, _ in want if m != "full"})
    keeps = sorted({k for _, k in want if k is not None})
    rc = main(["eval", "passkey", "--methods", ",".join(methods), "--keep", ",".join(map(str, keeps)),
               "--length", "2048", "--samples", "20", "--shard", "0/20", "--quiet", "--out", str(tmp_path / "ev")])
    assert rc in (0, None)
    got = _lines(tmp_path / "ev", "passkey", 0)
    assert set(got) == set(want)
    for key, w in want.items():
        assert got[key]["answer"] == w["answer"], key
        assert got[key]["stored_tokens"] == w["stored_tokens"], key
        assert got[key]["score"] == w["score"], key
