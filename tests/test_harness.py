"""kvtrim.harness: interleaving order, warm-up discarded, medians, the output contract, the machine
record, isolated runs. A fake timed function and a fake clock: nothing here asserts a duration."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from kvtrim import harness
from kvtrim.errors import KVTrimError


class FakeClock:
    """A clock that only the fake timed function advances."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_run(durations: dict[str, list[float]], clock: FakeClock, calls: list):
    """A timed function: config ``c`` on its i-th call 'takes' ``durations[c][i]`` seconds."""
    seen: dict[str, int] = {}

    def run(name: str, rep: int):
        i = seen.get(name, 0)
        seen[name] = i + 1
        calls.append((name, rep))
        clock.now += durations[name][i]
        return {"inner": 10 * durations[name][i]}

    return run


def test_interleave_alternates_order_and_discards_warmup():
    clock, calls = FakeClock(), []
    durations = {"a": [100.0, 1.0, 3.0, 2.0], "b": [200.0, 5.0, 4.0, 6.0], "c": [300.0, 7.0, 9.0, 8.0]}
    got = harness.interleave(["a", "b", "c"], fake_run(durations, clock, calls), reps=3, warmup=1, clock=clock)
    assert calls == [("a", -1), ("b", -1), ("c", -1),   # warm-up round
                     ("c", 0), ("b", 0), ("a", 0),      # order alternates between rounds
                     ("a", 1), ("b", 1), ("c", 1),
                     ("c", 2), ("b", 2), ("a", 2)]
    assert [s.rep for s in got["a"]] == [0, 1, 2]
    assert [s.seconds for s in got["a"]] == [1.0, 3.0, 2.0]  # the 100 s warm-up is not among them
    st = harness.stats(got["a"])
    assert st == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "all": [1.0, 3.0, 2.0]}
    assert harness.median(got["b"]) == 5.0
    assert harness.stats(got["c"], "inner")["all"] == [70.0, 90.0, 80.0]  # a key of the returned values
    assert harness.median(got["c"], lambda v: v["inner"] / 10) == 8.0


def test_rotate_and_fixed_orders_and_on_sample():
    assert [harness.order("abc", r, "rotate") for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert harness.order("abc", 1, "fixed") == list("abc")
    with pytest.raises(KVTrimError, match="alternate"):
        harness.order("ab", 0, "random")
    seen = []
    harness.interleave(["x", "y"], lambda n, r: None, reps=2, warmup=2, how="rotate", on_sample=seen.append)
    assert [(s.config, s.rep) for s in seen] == [("x", 0), ("y", 0), ("y", 1), ("x", 1)]
    with pytest.raises(KVTrimError, match="reps"):
        harness.interleave(["x"], lambda n, r: None, reps=0)


def test_stats_of_plain_numbers_and_even_count_median():
    assert harness.stats([4, 1, 3, 2])["median"] == 2.5
    with pytest.raises(KVTrimError, match="no samples"):
        harness.stats([])


def _parser(**kw):
    return argparse.ArgumentParser(parents=[harness.options(**kw)])


def test_existing_out_is_refused_before_work_unless_force(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("{}")
    ap = _parser()
    with pytest.raises(SystemExit):
        harness.start(ap, ap.parse_args(["--out", str(out)]))
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "{}"
    args = ap.parse_args(["--out", str(out), "--force"])
    assert harness.start(ap, args) is False
    with pytest.raises(KVTrimError, match="exists"):
        harness.check_out(out)
    with pytest.raises(KVTrimError, match="directory"):
        harness.check_out(tmp_path)


def test_out_required_new_parent_created_and_bad_reps(tmp_path, capsys):
    ap = _parser(reps=5, warmup=2)
    with pytest.raises(SystemExit):
        harness.start(ap, ap.parse_args([]))
    assert "--out is required" in capsys.readouterr().err
    args = ap.parse_args(["--out", str(tmp_path / "new" / "deeper" / "r.json")])
    assert (args.reps, args.warmup) == (5, 2)
    assert harness.start(ap, args) is False
    assert (tmp_path / "new" / "deeper").is_dir()
    with pytest.raises(SystemExit):
        harness.start(ap, ap.parse_args(["--out", str(tmp_path / "x.json"), "--reps", "0"]))
    assert "--reps must be >= 1" in capsys.readouterr().err
    assert not hasattr(_parser(reps=None, warmup=None).parse_args([]), "reps")


def test_directory_out_is_reused(tmp_path):
    d = tmp_path / "runs"
    assert harness.check_out(d, directory=True) == d and d.is_dir()
    assert harness.check_out(d, directory=True) == d  # resumable: an existing folder is continued
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(KVTrimError, match="not a directory"):
        harness.check_out(f, directory=True)


def test_table_renders_json_and_jsonl_without_out(tmp_path, capsys):
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"x": 3}))
    ap = _parser()
    assert harness.start(ap, ap.parse_args(["--table", str(j)]), table=lambda d: f"x={d['x']}") is True
    assert capsys.readouterr().out == "x=3\n"
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"a": 1}\n{"a": 2}\n')
    assert harness.read_result(lines) == [{"a": 1}, {"a": 2}]
    one = tmp_path / "one.jsonl"
    one.write_text('{"a": 1}\n')
    assert harness.read_result(one) == [{"a": 1}]  # one line is still a list of lines


def test_several_tables_render_one_table_of_all_the_files(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"x": 1}))
    b.write_text(json.dumps({"x": 2}))
    ap = argparse.ArgumentParser(parents=[harness.options(reps=None, warmup=None, several_tables=True)])
    assert harness.start(ap, ap.parse_args(["--table", str(a), str(b)]), table=lambda ds: "+".join(str(d["x"]) for d in ds))
    assert capsys.readouterr().out == "1+2\n"
    args = ap.parse_args(["--out", str(tmp_path / "new.json")])
    assert harness.start(ap, args, table=str) is False and args.table is None


def test_machine_record_keys_and_load_at_end():
    rec = harness.machine_record()
    for key in ("date", "machine", "processor", "cpus", "torch_threads", "python", "torch", "transformers",
                "kvtrim", "cpu_matrix_flags", "cpu_model", "l2_cache_kib", "loadavg_start"):
        assert key in rec
    flags = rec["cpu_matrix_flags"]
    assert flags is None or (flags == sorted(flags) and set(flags) <= {"avx2", "fma", "avx512f", "avx512_bf16",
                                                                      "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})
    assert rec["l2_cache_kib"] is None or (isinstance(rec["l2_cache_kib"], int) and rec["l2_cache_kib"] > 0)
    assert rec["cpu_model"] is None or isinstance(rec["cpu_model"], str)
    assert "loadavg_end" not in rec
    assert harness.finish_record(rec) is rec and "loadavg_end" in rec


def test_write_json_and_append_jsonl(tmp_path):
    p = tmp_path / "o.json"
    harness.write_json(p, {"a": [1, 2]})
    harness.write_json(p, {"a": [3]})  # the run's own file is rewritten (partial saves)
    assert json.loads(p.read_text()) == {"a": [3]}
    assert [f.name for f in tmp_path.iterdir()] == ["o.json"]  # no temporary file left beside it
    q = tmp_path / "o.jsonl"
    harness.append_jsonl(q, {"i": 1})
    harness.append_jsonl(q, {"i": 2})
    assert harness.read_result(q) == [{"i": 1}, {"i": 2}]


def test_isolated_runs_a_fresh_process_and_reads_its_result(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(
        "import os, sys\n"
        "from kvtrim import harness\n"
        "print('noise on stdout')\n"
        "harness.child_result({'argv': sys.argv[1:], 'pid': os.getpid()})\n"
    )
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    a = harness.isolated(child, ["--one", "4096", "dense"], env=env)
    b = harness.isolated(child, [], env=env)
    assert a["argv"] == ["--one", "4096", "dense"]
    assert a["pid"] != b["pid"] != os.getpid()
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)\n")
    with pytest.raises(KVTrimError, match="exit code 3"):
        harness.isolated(bad, [], env=env)


def test_threads_option_sets_torch_threads_and_refuses_zero(tmp_path, capsys):
    import torch

    ap = argparse.ArgumentParser(parents=[harness.options(threads=2)])
    before = torch.get_num_threads()
    try:
        args = ap.parse_args(["--out", str(tmp_path / "r.json"), "--threads", "1"])
        assert harness.start(ap, args) is False and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        harness.start(ap, ap.parse_args(["--out", str(tmp_path / "s.json"), "--threads", "0"]))
    assert "--threads must be >= 1" in capsys.readouterr().err
