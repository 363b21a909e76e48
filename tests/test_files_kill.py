"""A failure at any step of kvtrim.files.write_atomic leaves the old file or the new one, never a
mixture or nothing: an exception raised at each step (creating the temporary file, writing,
flushing, fsyncing, checking the destination, renaming or linking, removing the temporary name,
fsyncing the folder), and a process killed at each step (``os._exit`` in a forked child, which
runs no cleanup at all, as SIGKILL would)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from kvtrim import files

OLD = b"old content\n" * 100
NEW = b"the new content, longer than the old one\n" * 300


class Killed(Exception):
    """The failure injected at one step."""


class _File:
    """The temporary file's object, with a failure at ``write`` or ``flush``."""

    def __init__(self, f, step):
        self._f, self._step = f, step

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def write(self, data):
        self._step("write")
        half = len(data) // 2  # a part is on disk when the failure comes
        self._f.write(data[:half])
        self._f.flush()
        self._step("write-rest")
        return self._f.write(data[half:]) + half

    def flush(self):
        self._step("flush")
        return self._f.flush()

    def fileno(self):
        return self._f.fileno()


def _failing_os(fail_at: str, how: str):
    """A stand-in for the ``os`` module inside kvtrim.files that fails at the step ``fail_at``."""
    seen: list[str] = []

    def step(name: str) -> None:
        seen.append(name)
        if name == fail_at:
            if how == "kill":
                os._exit(17)
            raise Killed(name)

    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})

    def wrap(name, fn):
        def inner(*a, **kw):
            step(name)
            return fn(*a, **kw)
        return inner

    real_open = os.open
    proxy.open = lambda path, flags, *a, **kw: (step("dir-open") if flags & getattr(os, "O_DIRECTORY", 0)
                                                else step("create")) or real_open(path, flags, *a, **kw)
    proxy.fdopen = lambda fd, *a, **kw: _File(os.fdopen(fd, *a, **kw), step)
    proxy.fsync = wrap("fsync", os.fsync)
    proxy.replace = wrap("replace", os.replace)
    proxy.link = wrap("link", os.link)
    proxy.lstat = wrap("lstat", os.lstat)
    proxy.path = os.path
    return proxy, seen


STEPS = ["lstat", "create", "write", "write-rest", "flush", "fsync", "replace", "link", "dir-open"]


def _write(dest: Path, force: bool, by_path: bool) -> None:
    if by_path:
        files.write_atomic(dest, lambda tmp: Path(tmp).write_bytes(NEW), by_path=True, force=force)
    else:
        files.write_atomic(dest, NEW, force=force)


@pytest.mark.parametrize("by_path", [False, True], ids=["bytes", "by-path"])
@pytest.mark.parametrize("force", [True, False], ids=["replace", "new-file"])
@pytest.mark.parametrize("fail_at", STEPS)
def test_an_exception_at_any_step_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch, fail_at, force, by_path):
    dest = tmp_path / "result.json"
    if force:
        dest.write_bytes(OLD)
    proxy, seen = _failing_os(fail_at, "raise")
    monkeypatch.setattr(files, "os", proxy)
    try:
        _write(dest, force, by_path)
    except Killed:
        pass
    monkeypatch.undo()
    content = dest.read_bytes() if dest.exists() else None
    assert content in ((OLD if force else None), NEW), f"after a failure at {fail_at} (steps {seen})"
    if fail_at not in seen:  # this path never takes the step: it wrote the new file
        assert content == NEW
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], f"temporary files left after a failure at {fail_at}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to kill a writer at a chosen step")
@pytest.mark.parametrize("force", [True, False], ids=["replace", "new-file"])
@pytest.mark.parametrize("fail_at", STEPS)
def test_a_kill_at_any_step_leaves_the_old_file_or_the_new_one(tmp_path, fail_at, force):
    """The writer's process dies at the step (no ``finally``, no cleanup, as under SIGKILL): the
    destination holds the old content or the new one; a temporary file may be left, never the
    destination."""
    dest = tmp_path / "result.json"
    if force:
        dest.write_bytes(OLD)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            files.os = _failing_os(fail_at, "kill")[0]  # type: ignore[attr-defined]
            _write(dest, force, by_path=False)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 17)
    content = dest.read_bytes() if dest.exists() else None
    assert content in ((OLD if force else None), NEW), f"after a kill at {fail_at}"
    for p in tmp_path.iterdir():  # a temporary file may be left by a kill; it never took the destination's name
        assert p == dest or (p.name.startswith(f".{dest.name}.") and p.name.endswith(".tmp"))
