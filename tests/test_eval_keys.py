"""Eval results keyed by everything that made them: a line and its directory's config.json record the
weight digest, task, length, seed, haystack, samples, sample index and method parameters; a resume
with any difference is refused naming it; ``kvtrim report`` refuses to pool other models, other task
configurations or the same samples twice unless asked (``--pool``), and says what it pooled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtrim.errors import KVTrimError
from kvtrim.eval.store import CONFIG_FORMAT, check_out_dir, config_params, line_key

ROOT = Path(__file__).resolve().parents[1]
SWEEP = {"weights": "a" * 64, "sweep_seed": 0, "haystack": "pydoc", "samples": 4}


def _line(task="passkey", length=512, sample=0, method="full", keep=None, score=1.0, **extra):
    return {"task": task, "length": length, "sample": sample, "method": method, "keep": keep, "score": score,
            "kv_bytes": 10, "prefill_seconds": 0.1, **extra}


def _eval_dir(path: Path, config: dict | None, lines: list[dict]) -> Path:
    (path / "runs").mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    by_file: dict[str, list[dict]] = {}
    for r in lines:
        by_file.setdefault(f"{r['task']}-{r['length']}.jsonl", []).append(r)
    for name, rows in by_file.items():
        (path / "runs" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- config.json and resuming
def test_a_new_directory_records_everything_and_a_matching_resume_goes_on(tmp_path):
    out = check_out_dir(tmp_path / "e", "m", sweep=SWEEP)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {"model": "m", "format": CONFIG_FORMAT, **SWEEP}
    check_out_dir(tmp_path / "e", "m", sweep=SWEEP)  # the same sweep resumes
    check_out_dir(tmp_path / "e")  # the check before the model loads
    assert json.loads((out / "config.json").read_text()) == cfg


@pytest.mark.parametrize("key, value, message", [
    ("sweep_seed", 1, "holds a sweep with --seed 0; this run has --seed 1"),
    ("haystack", "essays", "holds a sweep with --haystack 'pydoc'; this run has --haystack 'essays'"),
    ("samples", 8, "holds a sweep with --samples 4; this run has --samples 8"),
    ("weights", "b" * 64, "holds a sweep of other weights of 'm'"),
])
def test_a_resume_that_differs_in_anything_is_refused_naming_it(tmp_path, key, value, message):
    check_out_dir(tmp_path / "e", "m", sweep=SWEEP)
    before = (tmp_path / "e" / "config.json").read_bytes()
    with pytest.raises(KVTrimError, match=message) as e:
        check_out_dir(tmp_path / "e", "m", sweep=SWEEP | {key: value})
    assert "use another --out directory" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "e" / "config.json").read_bytes() == before


def test_a_damaged_config_is_refused_not_rewritten(tmp_path):
    d = tmp_path / "e"
    (d / "runs").mkdir(parents=True)
    for bad in (b'{"model": "other", "form', b"[1, 2]", b"{}"):
        (d / "config.json").write_bytes(bad)
        with pytest.raises(KVTrimError, match=r"eval config .*config.json.*restore it, or use another directory"):
            check_out_dir(d, "m", sweep=SWEEP)
        with pytest.raises(KVTrimError, match="restore it"):
            check_out_dir(d)  # before the model loads too
        assert (d / "config.json").read_bytes() == bad


def test_a_legacy_directory_is_read_as_before_and_resuming_into_it_is_refused(tmp_path):
    from kvtrim.eval.report import load_dirs

    legacy = _eval_dir(tmp_path / "old", {"model": "m", "format": 1}, [_line(), _line(method="snapkv", keep=0.5)])
    assert len(load_dirs([str(legacy)])) == 2
    with pytest.raises(KVTrimError, match=r"written by an earlier kvtrim .config.json format 1.*use another --out"):
        check_out_dir(legacy, "m", sweep=SWEEP)
    empty = _eval_dir(tmp_path / "empty", {"model": "m", "format": 1}, [])
    check_out_dir(empty, "m", sweep=SWEEP)  # nothing to mix with: it becomes a format 2 directory
    assert json.loads((empty / "config.json").read_text())["format"] == CONFIG_FORMAT


def test_the_committed_results_load_as_before():
    from kvtrim.eval.report import load_dirs

    base = load_dirs([str(ROOT / "benchmarks/results/eval_baseline")])
    assert base and all(line_key(r)[3:7] == (r["seed"], None, None, None) for r in base)
    # the reference model's two sweeps (float32 at 4k, bfloat16 at 16k) fill no cell in common: pooled as before
    qwen = [str(ROOT / "benchmarks/results/eval_qwen"), str(ROOT / "benchmarks/results/eval_qwen16k")]
    assert len(load_dirs(qwen)) == len(load_dirs(qwen[:1])) + len(load_dirs(qwen[1:]))


def test_the_line_key_names_every_parameter():
    a = _line(method="snapkv", keep=0.5, params=config_params("snapkv", 0.5), **SWEEP)
    b = a | {"params": config_params("snapkv", 0.5) | {"window": 8}}
    assert line_key(a) != line_key(b)
    assert line_key(a) != line_key(a | {"haystack": "essays"}) != line_key(a | {"samples": 8})
    assert line_key(a) != line_key(a | {"weights": "b" * 64}) != line_key(a | {"seed": 7})
    assert config_params("snapkv", 0.5)["keep"] == 0.5 and "window" in config_params("snapkv", 0.5)


# ----------------------------------------------------------------------------- report pooling
def test_report_refuses_the_same_directory_twice(tmp_path):
    from kvtrim.eval.report import load_dirs

    d = _eval_dir(tmp_path / "a", {"model": "m", "format": CONFIG_FORMAT, **SWEEP}, [_line(**SWEEP)])
    with pytest.raises(KVTrimError, match=r"are the same directory: its lines would count twice.*--pool"):
        load_dirs([str(d), str(tmp_path / "." / "a")])
    assert len(load_dirs([str(d), str(d)], pool=True)) == 2


@pytest.mark.parametrize("change, message", [
    ({"model": "other"}, "different models .model 'm' vs 'other'"),
    ({"weights": "b" * 64}, "different models .weights"),
    ({"sweep_seed": 3}, "different task configurations .sweep_seed 0 vs 3"),
    ({"haystack": "essays"}, "different task configurations .haystack"),
])
def test_report_refuses_to_pool_other_models_or_task_configurations_into_one_cell(tmp_path, change, message, caplog):
    from kvtrim.eval.report import load_dirs

    a = _eval_dir(tmp_path / "a", {"model": "m", "format": CONFIG_FORMAT, **SWEEP}, [_line(**SWEEP)])
    other = {"model": "m", "format": CONFIG_FORMAT, **SWEEP} | change
    b = _eval_dir(tmp_path / "b", other, [_line(sample=1, **SWEEP)])
    with pytest.raises(KVTrimError, match=message):
        load_dirs([str(a), str(b)])
    with caplog.at_level("WARNING"):
        assert len(load_dirs([str(a), str(b)], pool=True)) == 2
    assert "pooled as asked (--pool)" in caplog.text


def test_report_refuses_the_same_samples_twice_and_pools_disjoint_ones(tmp_path):
    from kvtrim.eval.report import load_dirs, pooled_label

    cfg = {"model": "m", "format": CONFIG_FORMAT, **SWEEP}
    a = _eval_dir(tmp_path / "a", cfg, [_line(sample=0, **SWEEP), _line(sample=1, **SWEEP)])
    b = _eval_dir(tmp_path / "b", cfg, [_line(sample=1, **SWEEP), _line(sample=2, **SWEEP)])
    with pytest.raises(KVTrimError, match=r"hold the same samples \(1 lines, e.g. passkey at 512 tokens, sample 1"):
        load_dirs([str(a), str(b)])
    c = _eval_dir(tmp_path / "c", cfg, [_line(sample=2, **SWEEP), _line(sample=3, **SWEEP)])
    assert len(load_dirs([str(a), str(c)])) == 4  # the same sweep's other samples (e.g. copied shards)
    label = pooled_label([str(a), str(c)])
    assert f"{a} (model m, float32, weights aaaaaaaaaaaa, seed 0, haystack pydoc, 4 samples per cell)" in label


def test_report_cli_pool_flag_and_what_it_pooled(tmp_path, capsys):
    from kvtrim.cli import main

    a = _eval_dir(tmp_path / "a", {"model": "m", "format": 1}, [_line()])
    b = _eval_dir(tmp_path / "b", {"model": "other", "format": 1}, [_line(sample=1)])
    assert main(["report", str(a), str(b), "--no-plots", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and "different models" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
    assert main(["report", str(a), str(b), "--no-plots", "--pool", "--out", str(tmp_path / "r")]) == 0
    head = (tmp_path / "r" / "report.md").read_text().split("\n\n")[1]
    assert head == f"From 2 result lines in {a} (model m, float32); {b} (model other, float32)."


# ----------------------------------------------------------------------------- a sweep on a tiny model
def test_a_sweep_records_its_keys_and_refuses_a_resume_with_another_seed(tmp_path, embedded_tokenizer):
    from conftest import tiny_llama

    from kvtrim.eval.plan import make_plan
    from kvtrim.eval.store import read_lines, result_files
    from kvtrim.eval.sweep import run_eval
    from kvtrim.models import LoadedModel

    lm = LoadedModel(tiny_llama(vocab_size=len(embedded_tokenizer), max_position_embeddings=1024),
                     embedded_tokenizer, "tiny-test-model")
    plan = make_plan("passkey", "256", "snapkv", "0.5", samples=1, haystack="pydoc")
    out = tmp_path / "e"
    run_eval(lm, plan, out, progress=False)
    lines = read_lines(result_files(out))
    assert len(lines) == 2
    cfg = json.loads((out / "config.json").read_text())
    for r in lines:
        assert {k: r[k] for k in ("weights", "sweep_seed", "haystack", "samples")} == {
            k: cfg[k] for k in ("weights", "sweep_seed", "haystack", "samples")}
        assert r["params"] == config_params(r["method"], r["keep"])
    assert cfg["haystack"] == "pydoc" and cfg["samples"] == 1 and len(cfg["weights"]) == 64
    run_eval(lm, plan, out, progress=False)  # a finished sweep: nothing new
    assert read_lines(result_files(out)) == lines
    with pytest.raises(KVTrimError, match="--seed 0; this run has --seed 5"):
        run_eval(lm, make_plan("passkey", "256", "snapkv", "0.5", samples=1, seed=5, haystack="pydoc"), out,
                 progress=False)
    assert read_lines(result_files(out)) == lines


def test_force_on_a_resume_that_differs_starts_a_new_directory_and_says_so(tmp_path, caplog):
    from kvtrim.eval.store import SweepMismatch

    out = check_out_dir(tmp_path / "e", "m", sweep=SWEEP)
    before = (out / "config.json").read_bytes()
    with pytest.raises(SweepMismatch, match="--seed 0; this run has --seed 1"):
        check_out_dir(tmp_path / "e", "m", sweep=SWEEP | {"sweep_seed": 1})
    with caplog.at_level("WARNING"):
        new = check_out_dir(tmp_path / "e", "m", sweep=SWEEP | {"sweep_seed": 1}, force=True)
    assert new == tmp_path / "e-2" and (out / "config.json").read_bytes() == before  # the old sweep untouched
    assert json.loads((new / "config.json").read_text())["sweep_seed"] == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "holds a sweep with --seed 0; this run has --seed 1; --force: writing to the new directory" in said[0]
    assert repr(str(new)) in said[0] and "is left as it is" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING"):  # again with --force: the new directory holds this sweep, so it resumes there
        assert check_out_dir(tmp_path / "e", "m", sweep=SWEEP | {"sweep_seed": 1}, force=True) == new
    assert "resuming in the new directory" in caplog.text
    # a third setting: neither e nor e-2 holds it, and a file named e-3 is passed over
    (tmp_path / "e-3").write_text("not a directory")
    third = check_out_dir(tmp_path / "e", "m", sweep=SWEEP | {"samples": 9}, force=True)
    assert third == tmp_path / "e-4" and (tmp_path / "e-3").read_text() == "not a directory"
    # the same settings as the directory: --force changes nothing
    assert check_out_dir(tmp_path / "e", "m", sweep=SWEEP, force=True) == out


def test_force_on_a_damaged_config_leaves_it_and_starts_a_new_directory(tmp_path):
    d = tmp_path / "e"
    (d / "runs").mkdir(parents=True)
    (d / "config.json").write_bytes(b"[1, 2]")
    assert check_out_dir(d, "m", sweep=SWEEP, force=True) == tmp_path / "e-2"
    assert (d / "config.json").read_bytes() == b"[1, 2]"


def test_cli_eval_force_writes_a_new_directory_in_one_line(tiny_dir, tmp_path, capsys, caplog):
    from conftest import cli_status

    from kvtrim.eval.store import read_lines, result_files

    out = tmp_path / "e"
    argv = ["eval", "passkey", "--model", tiny_dir, "--length", "256", "--samples", "1", "--methods", "snapkv",
            "--keep", "0.5", "--haystack", "pydoc", "--quiet", "--out", str(out)]
    assert cli_status(argv) == 0
    first = read_lines(result_files(out))
    capsys.readouterr()
    assert cli_status(argv + ["--seed", "5"]) == 2  # a resume with another seed: refused, naming it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtrim: error: ") and "--seed 0; this run has --seed 5" in err[0]
    assert "pass --force to write to a new directory beside it" in err[0]
    with caplog.at_level("WARNING"):  # the notice is a warning of kvtrim's log (stderr, one line, under the CLI)
        assert cli_status(argv + ["--seed", "5", "--force"]) == 0
    err = capsys.readouterr().err
    new = tmp_path / "e-2"
    notice = [r.getMessage() for r in caplog.records if "--force" in r.getMessage()]
    assert len(notice) == 1 and f"writing to the new directory {str(new)!r}" in notice[0], caplog.text
    assert f"cells in {new} " in err
    assert read_lines(result_files(out)) == first  # the old sweep is as it was
    assert {r["seed"] for r in read_lines(result_files(new))} != {r["seed"] for r in first}
    assert json.loads((new / "config.json").read_text())["sweep_seed"] == 5


@pytest.mark.parametrize("extra, problem", [
    ({"decode_steps": 3}, "decode_steps is 3 without decode_seconds"),
    ({"decode_steps": 3, "decode_seconds": None}, "decode_steps is 3 without decode_seconds"),
    ({"task": "ppl", "nll_sum": 5.0, "n_target": 0}, "n_target is 0"),
    ({"score": float("nan")}, "score is nan"),
    ({"kv_bytes": -1}, "kv_bytes is -1"),
    ({"ref_nll_sum": "x"}, "ref_nll_sum is 'x'"),
])
def test_lines_the_report_cannot_use_are_corrupted_not_a_traceback(tmp_path, extra, problem):
    """Found by tests/test_fuzz_eval_dirs.py: each used to end the report in a traceback."""
    from kvtrim.errors import CorruptResultsError
    from kvtrim.eval.report import load_dirs, summarize

    d = _eval_dir(tmp_path / "a", {"model": "m", "format": 1}, [_line(), _line(sample=1) | extra])
    with pytest.raises(CorruptResultsError, match=re.escape(problem)):
        load_dirs([str(d)])
    ppl = _eval_dir(tmp_path / "b", {"model": "m", "format": 1}, [_line(task="ppl", nll_sum=1e6, n_target=1)])
    assert summarize(load_dirs([str(ppl)]))["cells"][0]["score"] == float("inf")  # past the largest float: inf
