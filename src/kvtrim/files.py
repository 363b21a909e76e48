"""kvtrim's files on disk: where its cache lives, one way to write a file atomically, and the lock
that serialises work on a shared path.

:func:`write_atomic` is the only way kvtrim replaces a file it writes (results, the conversion
cache's records, an assembled reference model, the files of a saved session): the new content goes
into a temporary file in the destination's folder, is flushed and fsynced, and is renamed over the
destination in one ``os.replace``, so a reader sees the old file or the new one, never a part of
either, and a failure at any point leaves the old file as it was. The destination is never followed
through a symbolic link. A full disk, a read-only filesystem or a folder without write permission
is one :class:`~kvtrim.errors.FileWriteError` line naming the path.

Standard library only: every layer may use it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from kvtrim.errors import FileWriteError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: unique temporary files and the atomic rename still hold
    fcntl = None  # type: ignore[assignment]  # the lock is skipped where fcntl does not exist

logger = logging.getLogger(__name__)

#: the failures of a write that are the machine's state, not a bug: said in one line
#: (:class:`~kvtrim.errors.FileWriteError`) instead of a traceback
CLEAR_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def cache_dir() -> Path:
    """Where kvtrim keeps converted weights, assembled reference models and file digests:
    ``$KVTRIM_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvtrim`` or ``~/.cache/kvtrim``."""
    if env := os.environ.get("KVTRIM_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtrim"


@contextmanager
def exclusive_lock(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed, never deleted: deleting a
    lock file lets two processes lock two different files). ``what`` names the work in the log line
    of a process that has to wait."""
    with open(lock_path, "a") as f:
        if fcntl is None:  # pragma: no cover
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is working on %s", what)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so a rename inside it survives a crash; a platform that cannot open a
    directory skips it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _refusal(path: Path, why: str) -> FileWriteError:
    return FileWriteError(f"cannot write {str(path)!r}: {why}", filename=str(path))


def _check_destination(path: Path, force: bool) -> None:
    """Refuse a symbolic link or a directory at ``path``, and an existing file unless ``force``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, "it is a symbolic link; kvtrim does not write through links")
    if stat.S_ISDIR(st.st_mode):
        raise _refusal(path, "it is a directory; give a file name")
    if not force:
        raise _refusal(path, "it exists; refusing to replace it")


def _said(path: Path, e: OSError) -> FileWriteError | None:
    """The one-line error for a failure in :data:`CLEAR_ERRNOS`, else None (the ``OSError`` propagates as it is)."""
    if e.errno not in CLEAR_ERRNOS:
        return None
    return FileWriteError(f"cannot write {str(path)!r}: {e.strerror or e}; the previous file, if any, is unchanged",
                          e.errno, e.strerror, str(path))


def _create_temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new file beside ``path``, opened for writing: ``.<name>.<random>.tmp`` (never an existing one)."""
    while True:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode), tmp
        except FileExistsError:  # pragma: no cover - a 48-bit collision
            continue


def _publish(tmp: Path, path: Path, force: bool) -> None:
    """Rename ``tmp`` to ``path``; without ``force`` only if ``path`` still does not exist (a hard
    link fails on an existing name, so no file that appeared meanwhile is replaced)."""
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise _refusal(path, "it exists; refusing to replace it") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        _check_destination(path, force=False)  # a filesystem without hard links: check, then rename
        os.replace(tmp, path)
        return
    tmp.unlink()


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[Any], Any], *, by_path: bool = False,
                 force: bool = True, mode: int = 0o666, encoding: str = "utf-8") -> Path:
    """Write a file atomically: a reader of ``path`` sees the old file or the new one, never a part.

    Args:
        path: the file to write. Its folder must exist. A symbolic link or a directory there is
            refused (a link is never followed).
        data: the content: ``bytes``, a ``str`` (encoded with ``encoding``), or a function that
            writes it. The function gets the open binary file (``data(f)``; a JSON or streaming
            writer), or with ``by_path=True`` the temporary file's path (``data(tmp)``; a writer
            that opens its own file, such as ``safetensors.torch.save_file``). Whatever it raises
            propagates, the temporary file removed and ``path`` untouched.
        by_path: hand ``data`` the temporary path instead of the open file.
        force: replace an existing file (the default: a result rewritten as a run goes on).
            ``False`` refuses one, also one that appears while the content is being written.
        mode: permission bits of a new file, less the umask (default ``0o666``, as ``open`` gives);
            ``0o600`` for private files.

    The content goes to ``.<name>.<random>.tmp`` in the same folder, is flushed and fsynced, and is
    renamed over ``path`` (``os.replace``); the folder is then fsynced, so the rename survives a
    crash. Returns ``path`` as a ``Path``.

    Raises:
        FileWriteError: (a ``KVTrimError`` and an ``OSError``) a link, a directory or (without
            ``force``) a file at ``path``, or a full disk, a read-only filesystem or missing write
            permission (``CLEAR_ERRNOS``); one line naming the path. Other ``OSError`` exceptions
            propagate as they are; in every case the previous file is unchanged.
    """
    path = Path(path)
    writer = data if by_path and callable(data) else None
    if by_path and writer is None:
        raise TypeError("by_path=True needs data to be a function of the temporary file's path")
    _check_destination(path, force)
    try:
        fd, tmp = _create_temporary(path, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                if not by_path:
                    _write_content(f, data, encoding)
                    f.flush()
                    os.fsync(f.fileno())
            if writer is not None:
                writer(tmp)
                with open(tmp, "rb+") as f:  # the writer closed its own file: make its bytes durable
                    os.fsync(f.fileno())
            _check_destination(path, force)  # a link or a directory put there meanwhile
            _publish(tmp, path, force)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except FileWriteError:
        raise
    except OSError as e:
        if (said := _said(path, e)) is not None:
            raise said from None
        raise
    fsync_dir(path.parent)
    return path


def _write_content(f: BinaryIO, data: bytes | str | Callable[[Any], Any], encoding: str) -> None:
    if isinstance(data, str):
        f.write(data.encode(encoding))
    elif isinstance(data, (bytes, bytearray, memoryview)):
        f.write(data)
    elif callable(data):
        data(f)
    else:
        raise TypeError(f"data must be bytes, str or a function that writes the file, got {type(data).__name__}")
