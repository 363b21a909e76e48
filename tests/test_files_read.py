"""kvtrim.files' read side and its output checks: regular files only (a FIFO, a device, a directory or
a socket is one line, and nothing blocks), a size limit per kind of file, decoding errors as one line;
appends never go through a link; an output is refused before the work that makes it."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from kvtrim import files
from kvtrim.errors import FileWriteError, KVTrimError, SessionError


def _returns_within(fn, seconds: float = 10.0):
    """Run ``fn`` in a thread; fail the test if it has not returned (a blocked open) in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the read blocked"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_bytes_text_and_json(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b'\xef\xbb\xbf{"a": "Z\xc3\xbcrich"}')
    assert files.read_bytes(p, "thing").startswith(b"\xef\xbb\xbf")
    assert files.read_text(p, "thing") == '{"a": "Zürich"}'  # the byte-order mark dropped
    assert files.read_json(p, "thing") == {"a": "Zürich"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("reader", [files.read_bytes, files.read_text, files.read_json, files.check_regular])
def test_a_fifo_is_refused_without_blocking(tmp_path, reader):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(KVTrimError, match=r"pipe.json' is a FIFO \(named pipe\), not a regular file") as e:
        _returns_within(lambda: reader(fifo, "calibration"))
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_put_in_place_after_the_stat_does_not_block_the_open(tmp_path, monkeypatch):
    p = tmp_path / "swap.json"
    p.write_text("{}")
    real_stat = files.check_regular

    def stat_then_swap(*a, **kw):
        st = real_stat(*a, **kw)
        p.unlink()
        os.mkfifo(p)
        return st

    monkeypatch.setattr(files, "check_regular", stat_then_swap)
    with pytest.raises(KVTrimError, match="was replaced while it was opened"):
        _returns_within(lambda: files.read_bytes(p, "calibration"))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused():
    with pytest.raises(KVTrimError, match="'/dev/zero' is a character device, not a regular file"):
        _returns_within(lambda: files.read_bytes("/dev/zero", "calibration"))


def test_a_directory_a_socket_and_a_missing_file(tmp_path):
    with pytest.raises(KVTrimError, match=r"does not exist or is not a file .it is a directory."):
        files.read_bytes(tmp_path, "context file")
    with pytest.raises(KVTrimError, match=r"'.*nope' does not exist or is not a file$"):
        files.read_bytes(tmp_path / "nope", "context file")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(KVTrimError, match="is a socket, not a regular file"):
            files.read_bytes(tmp_path / "sock", "context file")
    finally:
        s.close()


def test_a_name_with_a_nul_byte_is_one_line(tmp_path, capsys):
    """Found by the CLI fuzzer (``stream --file '\\x00'`` was a ValueError traceback)."""
    with pytest.raises(KVTrimError, match=r"is not a file name \(it holds a NUL byte\)"):
        files.read_bytes("a\x00b", "context file")
    with pytest.raises(FileWriteError, match=r"is not a file name \(it holds a NUL byte\)"):
        files.check_output(tmp_path / "a\x00b")
    from kvtrim.cli import main

    assert main(["stream", "--file", "\x00"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error:") and "NUL byte" in err and err.count("\n") == 1


def test_the_size_limit_per_kind(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b" " * 1000)
    assert files.read_bytes(p, "x", limit=1000)
    with pytest.raises(KVTrimError, match=r"has 1000 bytes, more than the 999 bytes kvtrim reads from a json file"):
        files.read_bytes(p, "x", limit=999)
    assert set(files.READ_LIMITS) >= {"json", "text", "results", "tensors"}
    with pytest.raises(ValueError, match="unknown kind"):
        files.read_bytes(p, "x", kind="nosuch")


def test_a_file_that_grows_past_the_limit_while_read_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "grows.txt"
    p.write_bytes(b"x" * 10)
    real_check = files.check_regular

    def then_grow(*a, **kw):
        st = real_check(*a, **kw)
        p.write_bytes(b"x" * 100)
        return st

    monkeypatch.setattr(files, "check_regular", then_grow)
    with pytest.raises(KVTrimError, match="grew past the 50 bytes"):
        files.read_bytes(p, "x", limit=50)


def test_a_link_is_followed_only_where_asked(tmp_path):
    target = tmp_path / "t.json"
    target.write_text("[1]")
    link = tmp_path / "l.json"
    link.symlink_to(target)
    assert files.read_json(link, "x") == [1]
    with pytest.raises(SessionError, match="is a symbolic link"):
        files.read_json(link, "session file", error=SessionError, follow_symlinks=False)


@pytest.mark.parametrize("data, message", [
    (b"\xff\xfe{}", r"is not valid JSON \(not UTF-8: byte 0xff at offset 0\)"),
    (b"{not json", r"is not valid JSON \(Expecting property name"),
    (b"[" * 100000 + b"]" * 100000, "is not valid JSON"),
])
def test_bad_json_is_one_line(tmp_path, data, message):
    p = tmp_path / "c.json"
    p.write_bytes(data)
    with pytest.raises(KVTrimError, match=message) as e:
        files.read_json(p, "calibration")
    assert "\n" not in str(e.value)


def test_bad_text_names_the_byte_and_offset(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("Zürich".encode("latin-1"))
    with pytest.raises(KVTrimError, match=r"is not UTF-8 text \(byte 0xfc at offset 1\)"):
        files.read_text(p, "context file")


def test_append_adds_in_one_write_and_refuses_links(tmp_path):
    p = tmp_path / "r.jsonl"
    files.append(p, '{"a": 1}\n')
    files.append(p, b'{"a": 2}\n')
    assert p.read_text() == '{"a": 1}\n{"a": 2}\n'
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    with pytest.raises(FileWriteError, match="is a symbolic link"):
        files.append(link, "x\n")
    assert victim.read_text() == "precious\n"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_append_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(FileWriteError):
        _returns_within(lambda: files.append(fifo, "x\n"))


def test_check_output(tmp_path):
    out = tmp_path / "out.json"
    assert files.check_output(out) == out
    out.write_text("{}")
    with pytest.raises(FileWriteError, match="exists; name a new file, or pass --force"):
        files.check_output(out)
    assert files.check_output(out, force=True) == out
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(FileWriteError, match="is a symbolic link"):
        files.check_output(link, force=True)
    with pytest.raises(FileWriteError, match="is a directory"):
        files.check_output(tmp_path)
    with pytest.raises(FileWriteError, match="does not exist"):
        files.check_output(tmp_path / "no" / "out.json")
    assert not (tmp_path / "elsewhere.json").exists()


def test_probe_directory(tmp_path):
    files.probe_directory(tmp_path, "the output directory")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileWriteError, match="cannot write to the output directory"):
        files.probe_directory(tmp_path / "missing", "the output directory")


def test_files_imports_only_the_leaves_and_the_standard_library():
    import ast
    import sys

    tree = ast.parse(Path(files.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n for n in names if n not in sys.stdlib_module_names} <= {"kvtrim"}


# --- the readers and writers moved to kvtrim.files, through the command line and the API -------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_calibration_naming_a_fifo_is_one_line_before_the_model_loads(tmp_path, capsys):
    from kvtrim.cli import main

    fifo = tmp_path / "cal.json"
    os.mkfifo(fifo)
    argv = ["generate", "--method", "snapkv", "--quality", "0.9", "--calibration", str(fifo), "--question", "q"]
    assert _returns_within(lambda: main(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrim: error: calibration") and "FIFO" in err and err.count("\n") == 1


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_calibration_dev_zero_is_refused():
    from kvtrim.budget import Calibration

    with pytest.raises(KVTrimError, match="character device"):
        _returns_within(lambda: Calibration.load("/dev/zero"))


@pytest.mark.parametrize("command", [["search-patterns", "--length", "256"], ["calibrate", "passkey"]])
def test_an_output_link_or_existing_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, command):
    from kvtrim.cli import main

    def no_model(*a, **kw):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("kvtrim.models.load_model", no_model)
    victim = tmp_path / "victim.json"
    victim.write_text("precious\n")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    assert main([*command, "--out", str(link)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert main([*command, "--out", str(victim)]) == 2
    assert "exists; name a new file, or pass --force" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_eval_directory_with_a_fifo_is_one_line(tmp_path):
    from kvtrim.eval.report import load_dirs
    from kvtrim.eval.store import check_out_dir

    (tmp_path / "runs").mkdir()
    os.mkfifo(tmp_path / "runs" / "passkey-1024.jsonl")
    with pytest.raises(KVTrimError, match="is a FIFO"):
        _returns_within(lambda: load_dirs([str(tmp_path)]))
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(KVTrimError, match="is a FIFO"):
        _returns_within(lambda: check_out_dir(tmp_path, "model"))


def test_a_session_target_that_cannot_be_made_is_refused_before_anything_runs(tmp_path):
    from kvtrim.session_file import check_save_target

    f = tmp_path / "model.txt"
    f.write_text("x")
    with pytest.raises(SessionError, match=r"[Nn]ot a directory"):
        check_save_target(f / "sess")  # the probe's /save model.txt/sess: was a NotADirectoryError at the end
    check_save_target(tmp_path / "new" / "deeper" / "sess")  # folders are made as needed
    assert not (tmp_path / "new").exists()


def test_a_pattern_config_is_read_and_written_through_the_helpers(tmp_path):
    """PatternConfig.load: a FIFO is one line without blocking, a file past the JSON limit is refused
    before it is read; PatternConfig.save never writes through a link and refuses an existing file
    when asked (search-patterns without --force)."""
    from kvtrim.integrations.prefill import FORMAT, PatternConfig

    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    with pytest.raises(KVTrimError, match=r"pattern config .*cfg.fifo' is a FIFO"):
        _returns_within(lambda: PatternConfig.load(fifo))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(files.READ_LIMITS["json"] + 1)  # sparse: nothing is written, nothing may be read
    with pytest.raises(KVTrimError, match=r"pattern config .*big.json' has \d+ bytes, more than the 64 MiB"):
        PatternConfig.load(big)
    (tmp_path / "bad.json").write_bytes(b'{"format": "x\xff"}')
    with pytest.raises(KVTrimError, match=r"pattern config .*bad.json' is not valid JSON \(not UTF-8: byte 0xff"):
        PatternConfig.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "other"}')
    with pytest.raises(KVTrimError, match=f"is not a {FORMAT} file"):
        PatternConfig.load(tmp_path / "other.json")

    cfg = PatternConfig(model={"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                               "head_dim": 4}, layers=[[{"pattern": "block_sparse", "k_b": 2}]])
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    (tmp_path / "link.json").symlink_to(victim)
    with pytest.raises(FileWriteError, match="symbolic link"):
        cfg.save(tmp_path / "link.json")
    assert victim.read_text() == "not yours"
    out = cfg.save(tmp_path / "sub" / "p.json")
    assert PatternConfig.load(out).layers == cfg.layers
    with pytest.raises(FileWriteError, match="it exists; refusing to replace it"):
        cfg.save(out, force=False)


def test_a_directory_is_published_whole_and_an_old_one_put_back_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "d"
    tmp = files.temporary_directory(target)
    assert tmp.parent == tmp_path and tmp.name.startswith(".d.tmp-") and (tmp.stat().st_mode & 0o777) == 0o700
    (tmp / "a").write_text("1")
    files.publish_directory(tmp, target)
    assert (target / "a").read_text() == "1" and not tmp.exists()
    again = files.temporary_directory(target)
    with pytest.raises(FileExistsError):  # without replace an existing directory (even an empty one) stays
        files.publish_directory(again, target)
    (again / "a").write_text("2")
    real_rename = os.rename

    def failing(src, dst):
        if Path(src) == again:
            raise OSError(5, "Input/output error")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="Input/output"):
        files.publish_directory(again, target, replace=True)
    monkeypatch.undo()
    assert (target / "a").read_text() == "1"  # the old directory is back
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".d.tmp-" + again.name[7:], "d"])
    files.publish_directory(again, target, replace=True)
    assert (target / "a").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    files.remove_directory(target)
    assert list(tmp_path.iterdir()) == []
