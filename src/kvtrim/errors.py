"""kvtrim's error types: a ``ValueError`` whose message says what was wrong and what is allowed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as ``Type: message`` on one line (transformers' messages span several), cut to
    ``limit`` characters."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextmanager
def model_load_errors(what: str, where: str) -> Iterator[None]:
    """Turn a failure inside transformers while loading a user's model into one ``ModelLoadError`` line:
    ``could not <what> from '<where>': <Type>: <message>``."""
    try:
        yield
    except KVTrimError:
        raise
    except Exception as e:
        if "trust_remote_code" in str(e):
            raise ModelLoadError(
                f"{where!r} needs its own Python code to load (auto_map in config.json); kvtrim never runs code "
                "from a model directory (trust_remote_code=False): use a model that transformers supports natively"
            ) from e
        raise ModelLoadError(f"could not {what} from {where!r}: {one_line(e)}") from e
