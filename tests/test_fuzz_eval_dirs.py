"""Property-based fuzzing of eval directories: one to three generated directories (result lines that
are whole, cut, retyped, out of range or not JSON; a ``config.json`` of either format, damaged, or a
FIFO; a result file replaced by a FIFO, a directory or a symbolic link; a directory named twice),
reported with ``kvtrim report`` (tables, ``--json``, ``--pool``) and resumed into with
:func:`kvtrim.eval.store.check_out_dir`.

The property: exit 0, or exit 2 with one ``kvtrim: error:`` line (``KVTrimError`` in Python);
never a traceback, never a hang, never a changed file outside the report's ``--out`` (and, for a
resume, the directory's ``config.json`` and ``runs/``). Examples per run: ``tests/fuzzing.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from pathlib import Path

from fuzzing import changed_outside, check_cli_outcome, count, fuzz_settings, no_hang, snapshot
from hypothesis import given
from hypothesis import strategies as st

from kvtrim.cli import main
from kvtrim.errors import KVTrimError
from kvtrim.eval.store import check_out_dir

TASKS = ["passkey", "ppl", "labelfree", "niah_single", "x"]
METHODS = ["full", "snapkv", "h2o", "y"]
ODD = st.sampled_from([0, -1, 1, 2**63, 1e308, -1e308, math.nan, math.inf, "1", "", None, True, [], {}])


@st.composite
def result_line(draw) -> bytes:
    d = {"task": draw(st.sampled_from(TASKS)), "length": draw(st.sampled_from([128, 512, 4096])),
         "sample": draw(st.integers(0, 3)), "method": draw(st.sampled_from(METHODS)),
         "keep": draw(st.sampled_from([None, 0.1, 0.5])), "prefill": draw(st.sampled_from(["dense", "minference"])),
         "score": draw(st.floats(0, 1)), "kv_bytes": draw(st.integers(0, 10**9)),
         "prefill_seconds": draw(st.floats(0, 100)), "nll_sum": draw(st.floats(0, 1000)),
         "n_target": draw(st.integers(0, 50)), "decode_seconds": draw(st.floats(0, 10) | st.none()),
         "decode_steps": draw(st.integers(0, 20) | st.none()), "seed": draw(st.integers(0, 99)),
         "ref_nll_sum": draw(st.floats(0, 1000)), "ref_tokens": draw(st.integers(0, 20))}
    for key in draw(st.lists(st.sampled_from(sorted(d)), max_size=2, unique=True)):
        if draw(st.booleans()):
            del d[key]
        else:
            d[key] = draw(ODD)
    raw = json.dumps(d).encode()
    how = draw(st.sampled_from(["whole"] * 6 + ["cut", "junk", "list"]))
    if how == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    if how == "junk":
        return draw(st.binary(max_size=20))
    return b"[1, 2]" if how == "list" else raw


@st.composite
def eval_dir(draw, root: Path, name: str) -> Path:
    d = root / name
    (d / "runs").mkdir(parents=True)
    cfg = draw(st.sampled_from(["v1", "v2", "other", "damaged", "none", "fifo", "list"]))
    sweep = {"weights": draw(st.sampled_from(["a" * 64, "b" * 64])), "sweep_seed": draw(st.integers(0, 1)),
             "haystack": "pydoc", "samples": 4}
    body = {"v1": {"model": "m", "format": 1}, "v2": {"model": "m", "format": 2, **sweep},
            "other": {"model": "other", "format": 1, "dtype": "bfloat16"}, "list": [1]}.get(cfg)
    if cfg == "damaged":
        (d / "config.json").write_bytes(b'{"model": "m", "form')
    elif cfg == "fifo":
        os.mkfifo(d / "config.json")
    elif body is not None:
        (d / "config.json").write_text(json.dumps(body))
    for i in range(draw(st.integers(0, 3))):
        p = d / "runs" / f"{draw(st.sampled_from(TASKS))}-{512 * (i + 1)}.jsonl"
        kind = draw(st.sampled_from(["lines"] * 5 + ["fifo", "dir", "link"]))
        if p.exists():
            continue
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        elif kind == "link":
            p.symlink_to(root / "victim.txt")
        else:
            lines = draw(st.lists(result_line(), min_size=1, max_size=6))
            p.write_bytes(b"\n".join(lines) + draw(st.sampled_from([b"\n", b""])))
    return d


@fuzz_settings(0.2)
@given(data=st.data())
def test_any_eval_directory_reports_or_refuses_in_one_line(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("ev")
    (root / "victim.txt").write_text("precious\n")
    dirs = [data.draw(eval_dir(root, f"d{i}")) for i in range(data.draw(st.integers(1, 3)))]
    names = [str(data.draw(st.sampled_from(dirs))) for _ in range(data.draw(st.integers(1, 3)))]
    out = root / "report"
    mode = data.draw(st.sampled_from([["--no-plots", "--out", str(out)], ["--json"], ["--no-plots", "--pool", "--out",
                                                                                       str(out)]]))
    before = snapshot(root)
    err = io.StringIO()
    with no_hang(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["report", *names, *mode])
    count("eval dirs: report", check_cli_outcome(rc, err.getvalue()))
    assert changed_outside(before, snapshot(root), [str(out)]) == []
    # resuming into the first: a refusal, or config.json (and runs/) made or kept
    d = Path(names[0])
    before = snapshot(root)
    sweep = {"weights": "a" * 64, "sweep_seed": 0, "haystack": "pydoc", "samples": 4}
    with no_hang():
        try:
            check_out_dir(d, "m", sweep=sweep)
            count("eval dirs: resume", "ok")
        except KVTrimError as e:
            assert "\n" not in str(e)
            count("eval dirs: resume", "refused")
    assert changed_outside(before, snapshot(root), [str(d / "config.json"), str(d / "runs")]) == []
    assert (root / "victim.txt").read_text() == "precious\n"
