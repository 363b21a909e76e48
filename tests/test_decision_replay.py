"""Every method does what it did before policies returned decisions: the stored cases of
``tests/decision_cases.py`` (kept stream indices per layer and KV head, the stored keys' and
values' sums, the generated tokens) replay equal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import decision_cases
import pytest

STORED = json.loads((Path(__file__).with_name("data") / "decision_cases.json").read_text())


@pytest.fixture(scope="module")
def model():
    return decision_cases.tiny_model()


def test_the_stored_cases_are_the_cases_run():
    assert STORED["cases"] == decision_cases.CASES


@pytest.mark.parametrize("name", list(decision_cases.CASES))
def test_case_replays_equal(model, name):
    want = STORED["results"][name]
    got = decision_cases.run_case(model, decision_cases.CASES[name])
    assert got["tokens"] == want["tokens"]
    assert got["seen"] == want["seen"]
    assert len(got["layers"]) == len(want["layers"])
    for i, (g, w) in enumerate(zip(got["layers"], want["layers"])):
        assert g["positions"] == w["positions"], f"layer {i}: kept set differs"
        for k in ("key_sum", "value_sum", "key_abs"):
            assert math.isclose(g[k], w[k], rel_tol=1e-9, abs_tol=1e-9), f"layer {i}: {k} {g[k]} vs {w[k]}"
