"""kvtrim report's plots: no method's line hides another's (issue 50: in the report's plot one
method's line hid another's completely). Methods that score the same are drawn nested (each later
one thinner, with a smaller marker of another shape, on top), and methods that hold the same KV
bytes at every budget are one line naming all of them."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from kvtrim.eval.report import kv_time_figure, line_styles, score_figure

METHODS = ["elastic", "h2o", "snapkv", "streaming_llm"]


def _cells() -> list[dict]:
    """Two tasks where every method scores the same (passkey) or two do (vt), and every method holds
    the same bytes at each budget, as a sweep gives them."""
    out = []
    for task, m, keep in itertools.product(("passkey", "vt"), METHODS, (0.25, 0.5)):
        score = 1.0 if task == "passkey" else (0.4 if m in ("h2o", "snapkv") else keep)
        out.append({"task": task, "length": 2048, "method": m, "keep": keep, "prefill": "dense", "score": score,
                    "kv_bytes": keep * 2**24, "prefill_s": 1.0, "decode_ms": 20.0, "decode_ms_any": 20.0})
    for task in ("passkey", "vt"):
        out.append({"task": task, "length": 2048, "method": "full", "keep": None, "prefill": "dense", "score": 1.0,
                    "kv_bytes": 2**24, "prefill_s": 1.0, "decode_ms": 20.0, "decode_ms_any": 20.0})
    return out


def _check_nothing_hidden(ax) -> None:
    """Every two lines of ``ax`` with the same points: the one on top is thinner and has a smaller marker of
    another shape, so the one beneath shows around it."""
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 1 or ln.get_marker() not in ("None", "")]
    for a, b in itertools.combinations(lines, 2):
        same = list(a.get_xydata().tolist()) == list(b.get_xydata().tolist())
        if not same:
            continue
        below, above = sorted((a, b), key=lambda ln: ln.get_zorder())
        assert below.get_zorder() < above.get_zorder(), (below.get_label(), above.get_label())
        assert above.get_linewidth() < below.get_linewidth(), (below.get_label(), above.get_label())
        assert above.get_markersize() < below.get_markersize() and above.get_marker() != below.get_marker()
        assert above.get_color() != below.get_color()


def test_methods_that_score_the_same_stay_visible():
    fig = score_figure(_cells(), 2048, ["passkey", "vt"], METHODS)
    try:
        passkey, vt = fig.axes[:2]
        assert len([ln for ln in passkey.get_lines() if ln.get_label() in METHODS]) == 4  # all four drawn
        for ax in (passkey, vt):
            _check_nothing_hidden(ax)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == [*METHODS, "full"]
    finally:
        plt.close(fig)


def test_the_same_kv_bytes_are_one_line_naming_every_method():
    fig = kv_time_figure(_cells(), [2048], METHODS)
    try:
        kv, prefill, decode = fig.axes
        labels = [ln.get_label() for ln in kv.get_lines()]
        assert labels == ["full 2048", "elastic, h2o, snapkv, streaming_llm 2048"]
        for ax in (prefill, decode):  # equal times: nested, never merged (measurements)
            assert len(ax.get_lines()) == 1 + len(METHODS)
            _check_nothing_hidden(ax)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_each_later_method_is_drawn_thinner_on_top(k):
    names = [f"m{i}" for i in range(k)]
    styles = [line_styles(names)[n] for n in names]
    assert len({s["marker"] for s in styles}) == k and len({s["color"] for s in styles}) == k
    for a, b in itertools.pairwise(styles):
        assert b["zorder"] > a["zorder"] and b["linewidth"] < a["linewidth"] and b["markersize"] < a["markersize"]
