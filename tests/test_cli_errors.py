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
    import kvtrim.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_methods", interrupted)
    assert cli.main(["methods"]) == 130
    assert capsys.readouterr().err == "kvtrim: interrupted\n"
