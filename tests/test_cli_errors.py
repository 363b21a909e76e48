"""The command line's error contract: one line ``kvtrim: error: ...``, exit status 2; Ctrl-C exits 130."""

from __future__ import annotations

import pytest

from kvtrim.cli import main


@pytest.mark.parametrize("argv", [
    ["generate", "--keep", "abc", "--question", "hi"],
    ["generate", "--max-new-tokens", "1.5", "--question", "hi"],
    ["generate"],
    ["nosuchcommand"],
    ["stream", "--file", "x.txt", "--chunk", "many"],
    ["eval", "--samples", "ten"],
])
def test_argument_errors_print_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: ") and err.count("\n") == 1, err


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    import kvtrim.cli.methods

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvtrim.cli.methods, "cmd_methods", interrupted)
    assert main(["methods"]) == 130
    assert capsys.readouterr().err == "kvtrim: interrupted\n"


@pytest.mark.parametrize("content, message", [
    (bytes(range(256)) * 4, "is not text (a NUL byte at offset 0)"),
    ("Zürich café".encode("latin-1"), "is not UTF-8 text (byte 0xfc at offset 1)"),
    (b"  \n\t", "is empty"),
])
def test_context_and_stream_files_must_be_utf8_text(content, message, tmp_path, capsys):
    f = tmp_path / "ctx.txt"
    f.write_bytes(content)
    for argv in (["generate", "--context-file", str(f), "--question", "hi"], ["stream", "--file", str(f)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtrim: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_stream_limit_must_be_positive(limit, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("some words " * 20)
    with pytest.raises(SystemExit) as e:  # refused as the command line is parsed
        main(["stream", "--file", str(f), f"--limit={limit}"])
    assert e.value.code == 2
    assert f"--limit must be a positive number of tokens, got {limit}" in capsys.readouterr().err


@pytest.mark.model
def test_stream_of_one_token_prints_strict_json(real, tmp_path, capsys):
    import json

    f = tmp_path / "one.txt"
    f.write_text("Hello")
    assert main(["stream", "--file", str(f), "--json", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for x in lines]
    assert rows[-1]["summary"] and rows[-1]["tokens"] == 1 and rows[-1]["ppl"] is None
