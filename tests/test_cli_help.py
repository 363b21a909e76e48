"""Help a user can skim, and the command line's small contracts: every option's help shows its allowed
values and default, options are grouped, every numeric option is range-checked as the command line
is parsed, sampling and thread options where tokens are generated, ``kvtrim models`` lists converted
paths in aligned columns, and a closed stdout ends a command quietly."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_status

from kvtrim.cli import build_parser, main
from kvtrim.cli.common import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return HelpFormatter(parser.prog)._expand_help(action)


COMMANDS = _commands()
LOADS_A_MODEL = ["generate", "chat", "stream", "demo", "eval", "calibrate", "bench", "search-patterns", "serve"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_with_its_default_and_allowed_values(name):
    parser = COMMANDS[name]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        text = _help_of(parser, a)
        assert a.help, f"kvtrim {name} {a.dest}: no help"
        has_default = not any(a.default is x for x in (None, False, argparse.SUPPRESS))
        if has_default and a.nargs != 0:
            assert "default" in text, f"kvtrim {name} {a.dest}: the help does not say the default {a.default!r}: {text}"
        assert a.type not in (int, float), f"kvtrim {name} {a.dest}: a number without a range check (use kvtrim.cli.common)"
        if a.type is not None and hasattr(a.type, "allowed"):
            assert text.count("[") >= 1 and a.type.allowed.split(" ")[-1] in text, text


def test_the_numeric_options_show_their_range_and_default():
    p = COMMANDS["generate"]
    texts = {a.dest: _help_of(p, a) for a in _options(p)}
    assert "[0 < R <= 1]" in texts["keep"]
    assert texts["max_new_tokens"].endswith("[0 <= N < 2^31] [default: 64]")
    assert texts["top_k"].endswith("[0 <= K < 2^31] [default: 0]") and texts["seed"].endswith("[0 <= S < 2^64] [default: 0]")
    assert "[1 <= N <= 4096]" in texts["threads"]
    assert "[default: full, no compression]" in texts["method"] and "snapkv" in texts["method"]


def test_generate_groups_its_options():
    groups = {g.title: [a.dest for a in g._group_actions] for g in COMMANDS["generate"]._action_groups}
    assert groups["model"] == ["model", "dtype", "device", "rope_scaling", "threads"]
    assert {"method", "keep", "max_tokens", "quality"} <= set(groups["method and budget"])
    assert {"prefill", "prefill_min_length", "prefill_chunk"} <= set(groups["prefill"])
    assert {"max_new_tokens", "sample", "temperature", "top_p", "top_k", "seed"} <= set(groups["generation"])
    assert {"json", "no_progress"} <= set(groups["output"])
    assert [a.dest for a in groups_options("generate")] == []  # nothing left in the ungrouped list but --help


def groups_options(name: str) -> list[argparse.Action]:
    """The options of kvtrim NAME that are in no group of their own."""
    p = COMMANDS[name]
    return [a for a in p._optionals._group_actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", LOADS_A_MODEL)
def test_model_help_names_every_accepted_form(name):
    p = COMMANDS[name]
    text = _help_of(p, next(a for a in p._actions if a.dest == "model")).lower()
    for form in ("short name", "hugging face model directory", ".gguf file", "local hugging face cache"):
        assert form in text, (name, text)
    assert "model" in {g.title for g in p._action_groups}
    assert not groups_options(name), f"kvtrim {name}: options outside the groups"


@pytest.mark.parametrize("name", ["generate", "chat"])
def test_sampling_options_where_tokens_are_sampled(name):
    dests = {a.dest for a in _options(COMMANDS[name])}
    assert {"sample", "temperature", "top_p", "top_k", "seed", "threads"} <= dests


@pytest.mark.parametrize("name", LOADS_A_MODEL[:-1])  # serve's model runs in vLLM's processes
def test_threads_on_every_command_that_runs_a_model(name):
    assert "threads" in {a.dest for a in _options(COMMANDS[name])}


def test_threads_sets_torchs_threads():
    import torch

    from kvtrim.cli.common import check_model_options

    before = torch.get_num_threads()
    try:
        check_model_options(argparse.Namespace(threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_torch_cannot_take_is_one_line_as_the_command_line_is_parsed(capsys):
    """Found by the CLI fuzzer: --threads past a C int was a ValueError traceback from torch; now
    more threads than any machine has cores is refused before anything runs."""
    assert cli_status(["generate", "--question", "q", "--threads", str(2**31)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: --threads must be an integer in [1, 4096], got 2147483648")
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["generate", "--question", "q", "--top-p", "0"], "--top-p must be a fraction in (0, 1], got 0.0"),
    (["generate", "--question", "q", "--top-k", "-1"], "--top-k must be a non-negative integer, got -1"),
    (["generate", "--question", "q", "--threads", "0"], "--threads must be an integer in [1, 4096], got 0"),
    (["generate", "--question", "q", "--seed", "-2"], "--seed must be a non-negative integer, got -2"),
    (["generate", "--question", "q", "--prefill-chunk", "1"], "--prefill-chunk must be an integer >= 2, got 1"),
    (["generate", "--question", "q", "--max-rows", "0"], "--max-rows must be a positive integer, got 0"),
    (["generate", "--question", "q", "--quality", "2"], "--quality must be a fraction in (0, 1], got 2.0"),
    (["generate", "--question", "q", "--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["chat", "--top-k", "x"], "--top-k must be an integer, got 'x'"),
    (["chat", "--keep", "0"], "--keep must be a fraction in (0, 1], got 0.0"),
    (["stream", "--file", "f.txt", "--threads", "-1"], "--threads must be an integer in [1, 4096], got -1"),
    (["eval", "passkey", "--out", "o", "--keep", "0.1,nan"], "--keep must be comma-separated numbers in (0, 1)"),
    (["calibrate", "--out", "c.json", "--length", "2048,64"], "--length must be comma-separated integers >= 128"),
    (["bench", "--reps", "0"], "--reps must be a positive integer, got 0"),
    (["bench", "--new-tokens", "1"], "--new-tokens must be an integer >= 2, got 1"),
    (["search-patterns", "--out", "p.json", "--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    (["demo", "--keep", "1.5"], "--keep must be a fraction in (0, 1], got 1.5"),
    (["generate", "--question", "q", "--seed", str(2**64)],
     f"--seed must be below 2^64 (an unsigned 64-bit integer), got {2**64}"),
    (["eval", "passkey", "--out", "o", "--seed", str(2**64)], "--seed must be below 2^64"),
    (["demo", "--seed", str(2**70)], "--seed must be below 2^64"),
    (["generate", "--question", "q", "--max-new-tokens", str(2**31)],
     "--max-new-tokens must be below 2^31 (a signed 32-bit integer), got 2147483648"),
    (["eval", "passkey", "--out", "o", "--length", f"2048,{2**31}"], "--length must be comma-separated integers >= 128 and < 2^31"),
    (["eval", "passkey", "--out", "o", "--shard", f"0/{2**31}"], "--shard must be I/N with 0 <= I < N < 2^31"),
    (["eval", "passkey", "--out", "o", "--shard", "2/2"], "--shard must be I/N with 0 <= I < N < 2^31, got '2/2'"),
    (["serve", "--port", "65536"], "--port must be an integer in [1, 65535], got 65536"),
])
def test_numbers_are_range_checked_as_the_command_line_is_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)  # parsing alone refuses it: nothing of the command runs
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: ") and err.count("\n") == 1 and message in err, err


HUGE = ("9" * 30, str(2**64), "1e999", "-" + "9" * 30)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_numeric_option_has_an_upper_and_lower_bound(name):
    """Every option that takes a number refuses one past the range it can hold as it is parsed: an
    integer beyond its bound (2^31 for counts, 2^64 for seeds), an infinite or hugely negative one."""
    for a in _options(COMMANDS[name]):
        if a.type is None or a.choices is not None or not hasattr(a.type, "allowed"):
            continue
        for text in HUGE:
            try:
                value = a.type(text)
            except argparse.ArgumentTypeError:
                continue
            # only a finite, positive float may be accepted beyond 2^64 (a temperature, an error bound)
            assert isinstance(value, float) and 0 < value < float("inf") and "." not in a.type.allowed.split()[-1], (
                f"kvtrim {name} {a.option_strings[0]} accepts {text[:12]}...: {value!r}")
        assert any(ch.isdigit() for ch in a.type.allowed), (name, a.dest, a.type.allowed)


def test_models_json_gives_each_models_converted_path(capsys):
    from kvtrim import reference_models as rm
    from kvtrim.errors import ModelLoadError
    from kvtrim.gguf import DEFAULT_NAME, converted_path, embedded_gguf_path, is_converted

    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(rm.REFERENCE_MODELS)
    try:
        gguf = embedded_gguf_path()
    except ModelLoadError:
        pytest.skip("the embedded model is not installed")
    smol = rows["smollm2"]
    assert smol["gguf"] == str(gguf) and smol["path"] == str(converted_path(gguf, DEFAULT_NAME))
    assert smol["converted"] == is_converted(Path(smol["path"]))
    for r in rows.values():
        assert set(r) >= {"name", "model", "installed", "about", "install", "gguf", "path", "converted"}
        assert (r["path"] is None) == (not r["installed"])


def test_models_table_columns_line_up(capsys):
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "state", "about"]
    for col in ("state", "about"):
        start = lines[0].index(col)
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in lines), lines


@pytest.mark.parametrize("argv", [["methods"], ["generate", "--help"]])
def test_a_closed_stdout_ends_quietly_with_status_0(argv):
    """`kvtrim ... | head -1`: the reader is gone before kvtrim writes; no traceback, status 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first write
    try:
        p = subprocess.run([sys.executable, "-m", "kvtrim", *argv], stdout=w, stderr=subprocess.PIPE, env=env,
                           timeout=300, check=False)
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode()[-2000:]
