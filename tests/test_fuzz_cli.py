"""Property-based fuzzing of the command line: generated argument lists for every command, with
values drawn from the awkward (numbers at and past every limit, NaN, empty and non-ASCII text) and
from a sandbox of awkward files (a FIFO, a device, a directory, a symbolic link to a file that must
not change, an existing output, binary and non-UTF-8 text, a damaged eval directory).

``kvtrim.cli.main(argv)`` runs in-process with the model load stubbed (the property needs no
model: an input that passes every check up to the load counts as accepted). The property is the
project's promise: exit 0, or exit 2 with one ``kvtrim: error:`` line; never a traceback, never a
changed file outside the outputs the command names, never a hang (a per-example time limit).
Examples per run: ``tests/fuzzing.py`` (``KVTRIM_FUZZ_PROFILE``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from fuzzing import changed_outside, check_cli_outcome, count, fuzz_settings, no_hang, snapshot
from hypothesis import given
from hypothesis import strategies as st

from kvtrim.cli import build_parser, main

COMMANDS = ("methods", "generate", "search-patterns", "demo", "chat", "stream", "eval", "report", "calibrate", "bench",
            "models", "serve")
#: options that name what a command writes (a change under them is the command's output)
OUTPUT_OPTIONS = ("--out", "--save", "--runs", "--readme")


class Reached(BaseException):
    """The command passed every check and asked for the model (or another slow step): accepted."""


def _stop(*a, **kw):
    raise Reached


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """Awkward files the arguments name; ``victim.txt`` must never change."""
    d = tmp_path_factory.mktemp("fuzz-cli")
    (d / "victim.txt").write_text("precious\n")
    (d / "link.json").symlink_to(d / "victim.txt")
    (d / "dangling.json").symlink_to(d / "nowhere.json")
    (d / "text.txt").write_text("The pass key is 4821. Remember it.\n" * 20)
    (d / "latin1.txt").write_bytes("Zürich café".encode("latin-1"))
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (d / "empty.txt").write_bytes(b"")
    (d / "existing.json").write_text('{"format": "something"}\n')
    (d / "prompts.jsonl").write_text('{"question": "What is 2+2?"}\n{"prompt": 5}\nnot json\n')
    (d / "adir").mkdir()
    os.mkfifo(d / "fifo")
    ev = d / "evaldir"
    (ev / "runs").mkdir(parents=True)
    (ev / "config.json").write_text(json.dumps({"model": "m", "format": 1}))
    line = {"task": "passkey", "length": 512, "sample": 0, "method": "full", "keep": None, "score": 1.0,
            "kv_bytes": 10, "prefill_seconds": 0.1}
    (ev / "runs" / "passkey-512.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(line | {"sample": 1}) + "\n{cut")
    (d / "readme.md").write_text("# r\n<!-- kvtrim-report:start -->\nold\n<!-- kvtrim-report:end -->\n")
    return d


def _paths(d: Path) -> list[str]:
    names = ["victim.txt", "link.json", "dangling.json", "text.txt", "latin1.txt", "binary.bin", "empty.txt",
             "existing.json", "prompts.jsonl", "adir", "fifo", "evaldir", "readme.md", "new-out.json", "new-dir",
             "adir/new.json", "nodir/x.json"]
    return [str(d / n) for n in names] + ["/dev/zero", "/dev/null", "/nonexistent/x", "", "."]


WORDS = ["full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic", "fastv", "hae", "nosuch", "passkey",
         "niah_single", "ppl", "labelfree", "minference", "dense", "a_shape", "reassigned", "true", "compressed",
         "prose", "pydoc", "filler", "essays", "qwen2.5-0.5b", "smollm2", "0/2", "3/2", "1/0", "cuda", "cpu", "cuda:7"]
NUMBERS = ["0", "1", "-1", "2", "32", "128", "512", "4096", "100000", str(2**31), str(2**63), str(2**64), str(10**30),
           "0.0", "0.5", "1.0", "1.5", "-0.5", "1e-9", "nan", "inf", "-inf", "1e308", "0x10", "1_000", " 7 "]


def _value(d: Path):
    paths = _paths(d)
    text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
    lists = st.lists(st.sampled_from(WORDS + NUMBERS), min_size=1, max_size=3).map(",".join)
    return st.one_of(st.sampled_from(NUMBERS), st.sampled_from(WORDS), st.sampled_from(paths), lists, text,
                     st.integers(-10**20, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr))


def _commands() -> dict[str, list[argparse.Action]]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [a for a in sub.choices[name]._actions if a.dest != "help"] for name in COMMANDS}


ACTIONS = _commands()


@st.composite
def argv(draw, d: Path):
    command = draw(st.sampled_from(COMMANDS))
    out = [command]
    value = _value(d)
    actions = ACTIONS[command]
    for a in [a for a in actions if not a.option_strings]:  # positionals
        if a.nargs == "?" and draw(st.booleans()):
            continue
        n = draw(st.integers(1, 3)) if a.nargs == "+" else 1
        for _ in range(n):
            out.append(draw(st.sampled_from(a.choices) if a.choices and draw(st.booleans()) else value))
    options = [a for a in actions if a.option_strings]
    for a in draw(st.lists(st.sampled_from(options), max_size=7)):
        out.append(a.option_strings[0])
        if a.nargs != 0:
            out.append(draw(st.sampled_from(a.choices) if a.choices and draw(st.booleans()) else value))
    return out


def _outputs(args: list[str], cwd: Path) -> list[str]:
    """What the command may write: the values of its output options, a report's default output (its
    first directory), calibrate's default runs directory."""
    named = [(a, args[i + 1]) for i, a in enumerate(args[:-1]) if a in OUTPUT_OPTIONS]
    outs = [v for _, v in named]
    if args[0] == "report" and "--out" not in args and len(args) > 1:
        outs.append(args[1])
    if args[0] == "calibrate":  # its sweep's default directory: OUT without the suffix, + "-runs"
        outs += [str(Path(v).with_suffix("")) + "-runs" for a, v in named if a == "--out" and Path(v).name]
    if args[0] == "eval" and "--force" in args:  # a sweep that differs goes to OUT-2, OUT-3, ... beside OUT
        outs += [f"{v.rstrip('/')}-{n}" for a, v in named if a == "--out" for n in range(2, 10)]
    return [os.path.join(cwd, o) for o in outs if o]


@fuzz_settings(0.35)
@given(data=st.data())
def test_any_argument_list_is_success_or_one_error_line(sandbox, monkeypatch, data):
    for target in ("kvtrim.models.load_model", "kvtrim.models.resolve_model", "kvtrim.eval.bench.run_bench",
                   "kvtrim.reference_models.install", "kvtrim.tools.verify_models.check",
                   "kvtrim.cli.serve.probe_vllm"):  # serve: its checks run, vLLM's Python is never started
        monkeypatch.setattr(target, _stop)
    args = data.draw(argv(sandbox))
    before = snapshot(sandbox)
    err, outp = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(sandbox)
    try:
        with no_hang(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(outp):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse: --help, a bad option
                rc = e.code if isinstance(e.code, int) else 2
            except Reached:
                rc = 0
    finally:
        os.chdir(cwd)
        torch.set_num_threads(1)
    outcome = check_cli_outcome(rc, err.getvalue())
    count("cli", outcome)
    changed = changed_outside(before, snapshot(sandbox), _outputs(args, sandbox))
    assert not changed, f"{args} changed {changed}"
    assert (sandbox / "victim.txt").read_text() == "precious\n"
