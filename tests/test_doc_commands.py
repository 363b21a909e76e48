"""Every shell command in README.md and docs/*.md runs as written.

The commands are taken from the fenced code blocks (all but ``python`` ones) and from inline code
spans that start with a command (``python``, ``kvtrim``, ``bash``, optionally behind ``.venv/bin/``,
``nice -n N`` or ``OMP_NUM_THREADS=N``). Each is checked:

- a runnable command (not a synopsis with ``[...]``/``...``/``{a,b}``/placeholders, not the bare name of a
  subcommand in prose) calls the project's environment (``.venv/bin/python``, ``.venv/bin/kvtrim``) or
  ``bash scripts/...``, since ``python``/``kvtrim`` are not on the PATH of a fresh clone;
- the script or ``kvtrim`` subcommand exists and accepts every ``--flag`` used (kvtrim: its argparse
  parser; a benchmark script: its ``--help`` output, run in this process);
- nothing writes into tracked results or docs unless that is the documented purpose (``--out`` under
  ``benchmarks/results/`` or ``docs/``);
- the quick ones run: ``--help``, ``--table <committed file>``, ``kvtrim methods``, ``kvtrim --version``, and
  ``kvtrim report`` on the committed results into a temporary directory.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvtrim.tools.docs_tables import run_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = r"(?:[A-Z_]+=\S+ )*(?:nice -n \d+ )?"
START = re.compile(rf"^{PREFIX}(?:\.venv/bin/)?(python3?|kvtrim|bash)(?= )")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for every shell command in ``path``."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            continue
        first = text[: m.start()].count("\n") + 2
        buf = ""
        for i, line in enumerate(m.group(2).split("\n")):
            s = line.strip()
            if not buf and not START.match(s):
                continue
            buf += (" " if buf else "") + s.rstrip("\\").strip()
            if not s.endswith("\\"):
                out.append((first + i, buf))
                buf = ""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in re.finditer(r"`([^`]+)`", prose):
        c = " ".join(m.group(1).split())
        if START.match(c):
            out.append((prose[: m.start()].count("\n") + 1, c))
    return out


def split(cmd: str) -> list[str]:
    """The words of the first command of a line, without the comment, env assignments and ``nice``."""
    cmd = cmd.split(" #", 1)[0].split(" && ")[-1] if "&&" in cmd else cmd.split(" #", 1)[0]
    words = shlex.split(cmd.rstrip("&").strip())
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "nice"):
        words = words[3:] if words[0] == "nice" else words[1:]
    return words


def is_synopsis(words: list[str]) -> bool:
    text = " ".join(words)
    return bool(re.search(r"\[|\.\.\.|\{|\b(FILE|DIR|PATH|TASKS|NAME)\b", text))


ALL = [(p.relative_to(ROOT).as_posix(), ln, c) for p in DOCS for ln, c in commands(p)]


def test_the_docs_hold_commands():
    files = {f for f, _, _ in ALL}
    assert {"README.md", "docs/minference.md", "docs/anchors.md", "docs/eval.md"} <= files
    assert len(ALL) > 40


def _kvtrim_parser():
    from kvtrim.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return p, sub.choices  # type: ignore[attr-defined]


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


_HELP: dict[str, str] = {}


def _script_help(script: str) -> str:
    if script not in _HELP:
        _HELP[script] = run_script(ROOT, [script, "--help"])
    return _HELP[script]


@pytest.mark.parametrize("where,line,cmd", ALL, ids=[f"{f}:{ln}" for f, ln, _ in ALL])
def test_command_exists_and_accepts_its_flags(where, line, cmd):
    words = split(cmd)
    prog = words[0]
    bare = len(words) <= 2 and not any(w.startswith("-") for w in words[1:])  # `kvtrim chat` named in prose
    if not is_synopsis(words) and not bare and prog not in ("bash",):
        assert prog.startswith(".venv/bin/"), f"{where}:{line}: {cmd!r} needs the project's environment: .venv/bin/{prog}"
    if prog.endswith("kvtrim"):
        _, subs = _kvtrim_parser()
        if words[1:2] == ["--version"]:
            return
        assert words[1] in subs, f"{where}:{line}: no kvtrim subcommand {words[1]!r}"
        known = {o for a in subs[words[1]]._actions for o in a.option_strings}
        unknown = [f for f in _flags(words) if f not in known]
        assert not unknown, f"{where}:{line}: kvtrim {words[1]} does not accept {unknown}"
    elif prog.endswith(("python", "python3")):
        if words[1] == "-m":
            assert words[2] in ("pytest", "kvtrim", "kvtrim.tools.docs_tables"), f"{where}:{line}: unknown module {words[2]}"
            return
        script = words[1]
        assert (ROOT / script).is_file(), f"{where}:{line}: {script} does not exist"
        help_text = _script_help(script)
        unknown = [f for f in _flags(words) if not re.search(rf"{re.escape(f)}\b", help_text)]
        assert not unknown, f"{where}:{line}: {script} --help does not list {unknown}"
    elif prog == "bash":
        assert (ROOT / words[1]).is_file(), f"{where}:{line}: {words[1]} does not exist"
    if "--out" in words and not is_synopsis(words):
        out = words[words.index("--out") + 1]
        assert not out.startswith(("benchmarks/results", "docs")), (
            f"{where}:{line}: {cmd!r} writes into tracked results ({out}); name a directory of the user's (results/...)")


def _quick(words: list[str]) -> bool:
    """``--help``, ``--table`` of a committed file, ``kvtrim methods`` / ``--version``: seconds, no model."""
    if is_synopsis(words):
        return False
    if "--table" in words:
        return (ROOT / words[words.index("--table") + 1]).exists()
    return "--help" in words or words[1:] in (["methods"], ["--version"], ["methods", "--json"])


QUICK = [(f, ln, c) for f, ln, c in ALL if _quick(split(c))]


def test_there_are_quick_commands_to_run():
    assert len(QUICK) >= 6


@pytest.mark.parametrize("where,line,cmd", QUICK, ids=[f"{f}:{ln}" for f, ln, _ in QUICK])
def test_quick_command_runs(where, line, cmd, capsys):
    words = split(cmd)
    if words[0].endswith("kvtrim"):
        from kvtrim.cli import main

        try:
            rc = main(words[1:])
        except SystemExit as e:  # argparse's --version / --help
            rc = e.code
        assert rc in (0, None)
        assert capsys.readouterr().out.strip()
    else:
        out = run_script(ROOT, words[1:])
        assert out.strip(), f"{where}:{line}: {cmd!r} printed nothing"


def test_kvtrim_report_on_the_committed_results(tmp_path):
    from kvtrim.cli import main

    assert main(["report", str(ROOT / "benchmarks/results/eval_baseline"), "--out", str(tmp_path)]) == 0
    assert "mean score" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "kv_and_time.png").stat().st_size > 1000
