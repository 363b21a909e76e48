"""kvtrim's error types: a ``ValueError`` whose message says what was wrong and what is allowed."""

from __future__ import annotations


class KVTrimError(ValueError):
    """Bad input to kvtrim (unknown method, budget out of range, unsupported model, ...)."""


class ModelLoadError(KVTrimError):
    """A model that cannot be loaded: a missing path, a model id that is not in the local Hugging
    Face cache, a damaged or fake GGUF, an invalid ``config.json``, missing tokenizer files,
    truncated weights. The message is one line naming the path and what is wrong."""


class FileWriteError(KVTrimError, OSError):
    """A file that cannot be written (:func:`kvtrim.files.write_atomic`): the disk is full, the
    filesystem read-only, the folder not writable, a symbolic link or a directory in the way, an
    existing file that must not be replaced. The message is one line naming the path; the previous
    file there, if any, is unchanged.

    It is also an ``OSError`` with the failure's ``errno`` and ``strerror`` (``None`` for a refusal),
    so code that handles a failed write as an ``OSError`` keeps doing so."""

    def __init__(self, message: str, errno: int | None = None, strerror: str | None = None,
                 filename: str | None = None):
        OSError.__init__(self, errno, strerror, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SessionError(KVTrimError):
    """A saved session that cannot be written or loaded: a damaged, truncated, edited or mismatched
    file, a session of another model, dtype or method, a symbolic link in the way, a target that is
    not a session directory. The message is one line naming the directory and what differs."""


class CorruptResultsError(KVTrimError):
    """Result lines that cannot be used (cut short, overwritten, missing or mistyped fields):
    ``kvtrim report`` refuses to report from them. ``bad`` lists ``(file, line number, problem)``."""

    def __init__(self, message: str, bad: list[tuple[str, int, str]]):
        super().__init__(message)
        self.bad = bad
