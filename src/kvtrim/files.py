"""kvtrim's files on disk: where its cache lives, one way to write a file atomically, one way to read
a file, and the lock that serialises work on a shared path.

:func:`write_atomic` is the only way kvtrim replaces a file it writes (results, the conversion
cache's records, an assembled reference model, the files of a saved session): the new content goes
into a temporary file in the destination's folder, is flushed and fsynced, and is renamed over the
destination in one ``os.replace``, so a reader sees the old file or the new one, never a part of
either, and a failure at any point leaves the old file as it was. The destination is never followed
through a symbolic link. A full disk, a read-only filesystem or a folder without write permission
is one :class:`~kvtrim.errors.FileWriteError` line naming the path. :func:`append` adds a line to a
log-like file (eval results) in one ``write`` on an ``O_APPEND`` descriptor, under the same rules;
:func:`check_output` refuses an output path before any work starts (a model load above all). A
directory of files (a saved session, a converted model) is filled in :func:`temporary_directory`
and put in place by :func:`publish_directory` (one rename; an old one renamed aside and put back if
that fails), and removed by :func:`remove_directory` (renamed aside first).

:func:`read_bytes` (and :func:`read_text`, :func:`read_json`) is the one way kvtrim reads a file a
user names or a directory holds (session files, calibrations, eval directories, context files,
result files): regular files only (a FIFO, a device, a socket or a directory is one line, found
by ``stat`` before anything is opened, and the open itself never blocks), at most
:data:`READ_LIMITS` bytes for the kind of file, and a decoding error is one line naming the file
and the offset. :func:`check_regular` applies the same checks to a file another library opens by
its path (safetensors, GGUF, images). A failure is a :class:`~kvtrim.errors.KVTrimError` (or the
subclass the caller names), never a traceback.

Standard library only: every layer may use it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from kvtrim.errors import FileWriteError, KVTrimError

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
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

#: the most bytes kvtrim reads from one file, by kind: a JSON document (configs, manifests,
#: calibrations, pattern configs, result files), a text a model reads (a context file, a prompts
#: file, a stream: tokenized whole), an eval directory's result lines, a saved session's tensors,
#: an image, a model's weights (GGUF, safetensors: read in pieces by path, never whole).
#: Anything larger is refused in one line before it is read (``/dev/zero`` is refused as a device).
READ_LIMITS = {"json": 64 << 20, "text": 256 << 20, "results": 256 << 20, "tensors": 64 << 30,
               "image": 256 << 20, "weights": 1 << 40}


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
    """Refuse a symbolic link, a directory or anything but a regular file (a FIFO, a device) at
    ``path``, and an existing file unless ``force``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, "it is a symbolic link; kvtrim does not write through links")
    if stat.S_ISDIR(st.st_mode):
        raise _refusal(path, "it is a directory; give a file name")
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, f"it is {_kind_of(st.st_mode)}, not a regular file")
    if not force:
        raise _refusal(path, "it exists; refusing to replace it")


def _said(path: Path, e: OSError) -> FileWriteError | None:
    """The one-line error for a failure in :data:`CLEAR_ERRNOS`, else None (the ``OSError`` propagates as it is)."""
    if e.errno not in CLEAR_ERRNOS:
        return None
    return FileWriteError(f"cannot write {str(path)!r}: {e.strerror or e}; the previous file, if any, is unchanged",
                          e.errno, e.strerror, str(path))


@contextmanager
def _errors_said(path: Path) -> Iterator[None]:
    """Turn an ``OSError`` in :data:`CLEAR_ERRNOS` inside the block into its one line (:func:`_said`);
    a ``FileWriteError`` (already one line) and any other ``OSError`` propagate as they are."""
    try:
        yield
    except FileWriteError:
        raise
    except OSError as e:
        if (said := _said(path, e)) is not None:
            raise said from None
        raise


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
    with _errors_said(path):
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


# ----------------------------------------------------------------------------- directories


def temporary_directory(target: str | os.PathLike, *, prefix: str | None = None, suffix: str = "") -> Path:
    """A new, empty, private (0700) directory beside ``target``: ``<prefix><random><suffix>`` in
    ``target``'s folder (default prefix ``.<name>.tmp-``), to fill and then publish with
    :func:`publish_directory`."""
    target = Path(target)
    return Path(tempfile.mkdtemp(prefix=prefix or f".{target.name}.tmp-", suffix=suffix, dir=target.parent))


def publish_directory(tmp: str | os.PathLike, target: str | os.PathLike, *, replace: bool = False) -> None:
    """Put the finished directory ``tmp`` (beside ``target``: :func:`temporary_directory`) in place as
    ``target`` in one rename, then fsync the folder, so a reader sees no directory or the whole one.

    Without ``replace``, ``target`` must not exist (an empty directory there would otherwise be
    replaced silently). With ``replace`` an existing ``target`` is first renamed aside
    (``.<name>.old-<random>``), put back if the second rename fails, and removed once the new one is
    in place; a process killed between the two renames leaves it under that name. Raises the
    ``OSError`` of a rename; ``tmp`` is left for the caller to remove."""
    tmp, target = Path(tmp), Path(target)
    old: Path | None = None
    if os.path.lexists(target):
        if not replace:
            raise FileExistsError(errno.EEXIST, "it exists; refusing to replace it", str(target))
        old = temporary_directory(target, prefix=f".{target.name}.old-")
        try:
            os.rename(target, old / target.name)
        except BaseException:
            shutil.rmtree(old, ignore_errors=True)
            raise
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            if not os.path.lexists(target):
                os.rename(old / target.name, target)  # put the previous directory back
            shutil.rmtree(old, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_directory(path: str | os.PathLike) -> None:
    """Remove the directory ``path`` so that no reader sees a part of it: renamed aside in one rename
    (into ``.<name>.<random>.tmp``, which a crash may leave behind), then deleted."""
    path = Path(path)
    trash = temporary_directory(path, prefix=f".{path.name}.", suffix=".tmp")
    os.replace(path, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- appending and outputs


def append(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o644) -> None:
    """Append ``data`` to ``path`` (created if missing) in one ``write`` on an ``O_APPEND`` descriptor,
    so processes appending to one file never interleave their lines. A symbolic link or anything but
    a regular file at ``path`` is refused (never followed); a full disk or a read-only filesystem is
    one :class:`~kvtrim.errors.FileWriteError` line."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    _check_appendable(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as e:
        if os.path.lexists(path):  # put there since the check
            _check_appendable(path)
        if (said := _said(path, e)) is not None:
            raise said from None
        raise
    try:
        with _errors_said(path):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _refusal(path, f"it is {_kind_of(os.fstat(fd).st_mode)}, not a regular file")
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _check_appendable(path: Path) -> None:
    """Refuse a symbolic link or anything but a regular file at ``path`` (missing is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, "it is a symbolic link; kvtrim does not write through links")
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, f"it is {_kind_of(st.st_mode)}, not a regular file")


def check_output(path: str | os.PathLike, what: str = "--out", *, force: bool = False) -> Path:
    """Refuse an output file now, before the work that produces it: a symbolic link or a directory
    at ``path``, an existing file unless ``force``, a folder that does not exist or cannot be
    written into. Returns ``path`` as a ``Path``; raises :class:`~kvtrim.errors.FileWriteError`
    (one line naming ``what`` and the path). :func:`write_atomic` checks the destination again when
    it writes."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise FileWriteError(f"{what} {str(p)!r}: {e.strerror or e}", e.errno, e.strerror, str(p)) from None
    except ValueError:  # a NUL byte: no file can have this name
        raise FileWriteError(f"{what} {str(p)!r} is not a file name (it holds a NUL byte)") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise FileWriteError(f"{what} {str(p)!r} is a symbolic link; kvtrim does not write through links, "
                                 "name the file itself", filename=str(p))
        if stat.S_ISDIR(st.st_mode):
            raise FileWriteError(f"{what} {str(p)!r} is a directory; name a file", filename=str(p))
        if not stat.S_ISREG(st.st_mode):
            raise FileWriteError(f"{what} {str(p)!r} exists and is not a regular file; name a new file", filename=str(p))
        if not force:
            raise FileWriteError(f"{what} {str(p)!r} exists; name a new file, or pass --force to replace it",
                                 filename=str(p))
    parent = p.parent
    if not parent.is_dir():
        raise FileWriteError(f"{what} {str(p)!r}: the folder {str(parent)!r} does not exist", filename=str(p))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FileWriteError(f"{what} {str(p)!r}: cannot write into the folder {str(parent)!r}", filename=str(p))
    return p


def probe_directory(path: str | os.PathLike, what: str) -> None:
    """Create and remove a file in the directory ``path`` (which must exist): the one sure test that
    files can be written there (permissions, a read-only filesystem, a full disk's inode table).
    Raises :class:`~kvtrim.errors.FileWriteError` naming ``what``."""
    path = Path(path)
    try:
        fd, tmp = _create_temporary(path / ".write-test", 0o600)
        os.close(fd)
        tmp.unlink()
    except OSError as e:
        raise FileWriteError(f"cannot write to {what} {str(path)!r}: {e.strerror or e}", e.errno, e.strerror,
                             str(path)) from None


# ----------------------------------------------------------------------------- reading


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _size_text(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def _limit(kind: str, limit: int | None) -> int:
    if limit is not None:
        return limit
    if kind not in READ_LIMITS:
        raise ValueError(f"unknown kind of file {kind!r}; known: {', '.join(READ_LIMITS)}")
    return READ_LIMITS[kind]


def check_regular(path: str | os.PathLike, what: str, *, kind: str = "json", limit: int | None = None,
                  error: type[KVTrimError] = KVTrimError, follow_symlinks: bool = True) -> os.stat_result:
    """``stat`` of ``path`` when it is a regular file of at most the size limit of ``kind``
    (:data:`READ_LIMITS`, or ``limit``); else ``error`` with one line naming ``what`` and the path.

    Nothing is opened: a FIFO, a device, a socket or a directory is refused by its ``stat``.
    ``follow_symlinks=False`` refuses a symbolic link instead of following it."""
    p = os.fspath(path)
    cap = _limit(kind, limit)
    try:
        st = os.stat(p) if follow_symlinks else os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{what} {p!r} does not exist or is not a file") from None
    except OSError as e:
        raise error(f"cannot read {what} {p!r}: {e.strerror or e}") from None
    except ValueError:  # a NUL byte: no file can have this name
        raise error(f"{what} {p!r} is not a file name (it holds a NUL byte)") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} {p!r} does not exist or is not a file (it is a directory)")
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{what} {p!r} is a symbolic link; kvtrim does not follow links here")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {p!r} is {_kind_of(st.st_mode)}, not a regular file; kvtrim reads regular files only")
    if st.st_size > cap:
        raise error(f"{what} {p!r} has {st.st_size} bytes, more than the {_size_text(cap)} kvtrim reads from a "
                    f"{kind} file")
    return st


def read_bytes(path: str | os.PathLike, what: str, *, kind: str = "json", limit: int | None = None,
               error: type[KVTrimError] = KVTrimError, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most the limit of ``kind`` (see :func:`check_regular`).

    The file is checked by ``stat`` before it is opened, opened with ``O_NONBLOCK`` (a FIFO put
    there in between does not block the open) and checked again on the open descriptor, which
    must be the same regular file; a file that grows past the limit while it is read is refused.
    ``what`` names the file in messages (``"calibration"``, ``"session file"``); ``error`` is the
    exception raised (a :class:`~kvtrim.errors.KVTrimError` subclass such as ``SessionError``)."""
    p = os.fspath(path)
    cap = _limit(kind, limit)
    st = check_regular(p, what, kind=kind, limit=cap, error=error, follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow_symlinks else _NOFOLLOW)
    try:
        fd = os.open(p, flags)
    except OSError as e:
        if not follow_symlinks and os.path.islink(p):
            raise error(f"{what} {p!r} is a symbolic link; kvtrim does not follow links here") from None
        raise error(f"cannot read {what} {p!r}: {e.strerror or e}") from None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise error(f"{what} {p!r} was replaced while it was opened; read it again")
        chunks: list[bytes] = []
        got = 0
        while chunk := os.read(fd, min(1 << 24, cap + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
            if got > cap:
                raise error(f"{what} {p!r} grew past the {_size_text(cap)} kvtrim reads from a {kind} file")
    except OSError as e:
        raise error(f"cannot read {what} {p!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def decode_text(data: bytes, what: str, path: str | os.PathLike, error: type[KVTrimError] = KVTrimError) -> str:
    """``data`` as UTF-8 (a leading byte-order mark dropped); anything else is one line naming the
    first bad byte and its offset."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise error(f"{what} {os.fspath(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_text(path: str | os.PathLike, what: str, *, kind: str = "text", limit: int | None = None,
              error: type[KVTrimError] = KVTrimError, follow_symlinks: bool = True) -> str:
    """The UTF-8 text of the regular file ``path`` (:func:`read_bytes`, then :func:`decode_text`)."""
    data = read_bytes(path, what, kind=kind, limit=limit, error=error, follow_symlinks=follow_symlinks)
    return decode_text(data, what, path, error)


def parse_json(data: bytes, what: str, path: str | os.PathLike, error: type[KVTrimError] = KVTrimError) -> Any:
    """``data`` parsed as JSON (UTF-8); anything else is one line ``<what> '<path>' is not valid JSON (...)``."""
    try:
        return json.loads(data.decode("utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as e:
        raise error(f"{what} {os.fspath(path)!r} is not valid JSON (not UTF-8: byte 0x{data[e.start]:02x} at offset "
                    f"{e.start})") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{what} {os.fspath(path)!r} is not valid JSON ({' '.join(str(e).split())[:200]})") from None


def read_json(path: str | os.PathLike, what: str, *, kind: str = "json", limit: int | None = None,
              error: type[KVTrimError] = KVTrimError, follow_symlinks: bool = True) -> Any:
    """The JSON document in the regular file ``path`` (:func:`read_bytes`, then :func:`parse_json`)."""
    data = read_bytes(path, what, kind=kind, limit=limit, error=error, follow_symlinks=follow_symlinks)
    return parse_json(data, what, path, error)
