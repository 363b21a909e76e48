"""Reading the text files users give kvtrim (a context file, a prompts file, a stream): UTF-8 or a clear error.

A binary file or text in another encoding would otherwise become thousands of U+FFFD tokens that
the model is asked about as if they were text; kvtrim refuses them, saying where the problem is.
The file is read through :func:`kvtrim.files.read_bytes`: a regular file of at most
``READ_LIMITS["text"]`` bytes (a FIFO or a device is refused without blocking).
"""

from __future__ import annotations

from pathlib import Path

from kvtrim.errors import KVTrimError
from kvtrim.files import decode_text, read_bytes


def read_text_file(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``KVTrimError`` when it is missing, not a regular file, too large,
    binary, not UTF-8 or empty."""
    data = read_bytes(path, what, kind="text")
    nul = data.find(b"\0")
    if nul >= 0:
        raise KVTrimError(f"{what} {str(path)!r} is not text (a NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        text = decode_text(data, what, path)
    except KVTrimError as e:
        raise KVTrimError(f"{e}; convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise KVTrimError(f"{what} {str(path)!r} is empty")
    return text
