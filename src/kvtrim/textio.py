"""Reading the text files users give kvtrim (a context file, a stream): UTF-8 or a clear error.

A binary file or text in another encoding would otherwise become thousands of U+FFFD tokens that
the model is asked about as if they were text; kvtrim refuses them, saying where the problem is.
"""

from __future__ import annotations

from pathlib import Path

from kvtrim.errors import KVTrimError


def read_text_file(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``KVTrimError`` when it is missing, binary, not UTF-8 or empty."""
    p = Path(path)
    if not p.is_file():
        raise KVTrimError(f"{what} {str(path)!r} does not exist or is not a file")
    data = p.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise KVTrimError(f"{what} {str(path)!r} is not text (a NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KVTrimError(
            f"{what} {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    if not text.strip():
        raise KVTrimError(f"{what} {str(path)!r} is empty")
    return text.removeprefix("\ufeff")
