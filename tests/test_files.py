"""kvtrim.files.write_atomic: the one way kvtrim replaces a file. Readers see the old file or the new
one; a failure at any point (the writer raising, a full disk) leaves the old file as it was and no
temporary file behind; a symbolic link at the destination is refused, never followed."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from kvtrim import files
from kvtrim.errors import FileWriteError, KVTrimError
from kvtrim.files import write_atomic


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def test_bytes_and_text(tmp_path):
    p = tmp_path / "a.bin"
    assert write_atomic(p, b"\x00\x01binary") == p
    assert p.read_bytes() == b"\x00\x01binary"
    write_atomic(p, "Zürich\n")  # replaces, UTF-8 by default
    assert p.read_bytes() == "Zürich\n".encode()
    write_atomic(p, "Zürich", encoding="latin-1")
    assert p.read_bytes() == "Zürich".encode("latin-1")
    assert _leftovers(tmp_path) == []


def test_a_new_file_gets_the_usual_mode_or_the_one_asked(tmp_path):
    write_atomic(tmp_path / "shared.json", "{}")
    write_atomic(tmp_path / "private", b"x", mode=0o600)
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o666 & ~_umask()
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_the_content_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """The new bytes are durable before the rename publishes them, and the folder after it."""
    p = tmp_path / "r.json"
    p.write_text("old")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name if os.path.exists("/proc/self/fd") else fd))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        assert Path(src).parent == Path(dst).parent and Path(src).read_text() == '{"a": 1}'
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomic(p, json.dumps({"a": 1}))
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    tmp_name = events[1][1]
    assert tmp_name.startswith(".r.json.") and tmp_name.endswith(".tmp") and events[1][2] == "r.json"
    if os.path.exists("/proc/self/fd"):
        assert events[0][1] == tmp_name and events[2][1] == tmp_path.name  # the file, then its folder
    assert p.read_text() == '{"a": 1}' and _leftovers(tmp_path) == []


def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path):
    p = tmp_path / "result.json"
    p.write_text("the old result")

    def half(f):
        f.write(b'{"partial": ')
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_atomic(p, half)
    assert p.read_text() == "the old result" and _leftovers(tmp_path) == []


def test_a_writer_gets_the_open_file_or_the_path(tmp_path):
    from safetensors.torch import load_file, save_file

    def stream(f):
        for i in range(3):
            f.write(f"line {i}\n".encode())

    write_atomic(tmp_path / "lines.txt", stream)
    assert (tmp_path / "lines.txt").read_text() == "line 0\nline 1\nline 2\n"
    t = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    write_atomic(tmp_path / "t.safetensors", lambda path: save_file(t, str(path)), by_path=True)
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["x"], t["x"])
    assert _leftovers(tmp_path) == []
    with pytest.raises(TypeError, match="by_path=True needs"):
        write_atomic(tmp_path / "y", b"bytes", by_path=True)
    with pytest.raises(TypeError, match="data must be bytes, str or a function"):
        write_atomic(tmp_path / "y", 42)
    assert not (tmp_path / "y").exists() and _leftovers(tmp_path) == []


def test_a_symbolic_link_at_the_destination_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    with pytest.raises(FileWriteError, match=r"out.json': it is a symbolic link; kvtrim does not write through links") as e:
        write_atomic(link, "{}")
    assert isinstance(e.value, KVTrimError) and "\n" not in str(e.value)
    assert link.is_symlink() and victim.read_text() == "not yours" and _leftovers(tmp_path) == []
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileWriteError, match="symbolic link"):
        write_atomic(dangling, "{}")
    assert not (tmp_path / "nowhere").exists()


def test_a_directory_at_the_destination_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(FileWriteError, match="is a directory"):
        write_atomic(tmp_path / "d", b"x")
    assert (tmp_path / "d").is_dir() and _leftovers(tmp_path) == []


def test_without_force_an_existing_file_is_refused_also_one_that_appears_meanwhile(tmp_path):
    p = tmp_path / "out.json"
    write_atomic(p, "first", force=False)
    with pytest.raises(FileWriteError, match="exists; refusing to replace it"):
        write_atomic(p, "second", force=False)
    assert p.read_text() == "first"
    q = tmp_path / "race.json"

    def writer(f):
        q.write_text("another process")  # the destination appears while the content is written
        f.write(b"mine")

    with pytest.raises(FileWriteError, match="exists; refusing to replace it"):
        write_atomic(q, writer, force=False)
    assert q.read_text() == "another process" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_full_disk_or_read_only_filesystem_is_one_line_and_the_old_file_stays(tmp_path, monkeypatch, code):
    p = tmp_path / "summary.json"
    p.write_text("old")

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(FileWriteError) as e:
        write_atomic(p, "new")
    monkeypatch.undo()
    err = e.value
    assert isinstance(err, KVTrimError) and isinstance(err, OSError) and err.errno == code
    assert err.strerror == os.strerror(code)  # `e.strerror or e` in callers reads as before
    assert str(err) == f"cannot write {str(p)!r}: {os.strerror(code)}; the previous file, if any, is unchanged"
    assert p.read_text() == "old" and _leftovers(tmp_path) == []


def test_other_os_errors_propagate_as_they_are(tmp_path, monkeypatch):
    p = tmp_path / "x"

    def fail(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error") as e:
        write_atomic(p, "new")
    assert not isinstance(e.value, FileWriteError)
    monkeypatch.undo()
    assert not p.exists() and _leftovers(tmp_path) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_folder_without_write_permission_is_one_line(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    (d / "f").write_text("old")
    d.chmod(0o500)
    try:
        with pytest.raises(FileWriteError, match=r"cannot write .*f': Permission denied"):
            write_atomic(d / "f", "new")
    finally:
        d.chmod(0o700)
    assert (d / "f").read_text() == "old" and _leftovers(d) == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTRIM_CACHE_DIR", str(tmp_path / "c"))
    assert files.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVTRIM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert files.cache_dir() == tmp_path / "xdg" / "kvtrim"
