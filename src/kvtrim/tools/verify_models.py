"""``kvtrim models verify``: hash kvtrim's installed models and conversions whole, against the digests
recorded when they were made.

For each reference model (or the one named): the assembled GGUF against its known SHA-256
(:func:`kvtrim.reference_models.check_installed` with ``full=True``; the embedded model ships
inside its package and has none of its own), then the converted directory kvtrim loads from, each
file against the SHA-256 its conversion recorded (:func:`kvtrim.gguf.check_converted`). A model
whose file is damaged is assembled again on its next load, a damaged conversion converted again;
this command says so first. One line per file checked on standard output; any damage ends in one
``kvtrim: error:`` line (exit 2).
"""

from __future__ import annotations

import sys

from kvtrim import reference_models as rm
from kvtrim.errors import KVTrimError, ModelLoadError
from kvtrim.gguf import DEFAULT_NAME, check_converted, converted_path, embedded_gguf_path, is_converted


def check(m: rm.ReferenceModel, *, progress: bool = True) -> list[tuple[str, str | None]]:
    """``(what, problem or None)`` for the reference model ``m``: its assembled GGUF, then its
    conversion; ``"not installed"`` / ``"not converted yet"`` where there is nothing to check."""
    rows: list[tuple[str, str | None]] = []
    if m.embedded:
        try:
            gguf = embedded_gguf_path()
        except ModelLoadError:
            return [(f"{m.key}: the embedded GGUF", "not installed")]
        name = DEFAULT_NAME
    else:
        problem = rm.check_installed(m, full=True, progress=progress)
        rows.append((f"{m.key}: {m.gguf_path}", problem))
        if problem is not None:
            return rows
        gguf, name = m.gguf_path, m.name
    out = converted_path(gguf, name)
    if not is_converted(out):
        return [*rows, (f"{m.key}: its conversion {out}", "not converted yet (converted on first use)")]
    return [*rows, (f"{m.key}: its conversion {out}", check_converted(out, full=True))]


def verify(name: str | None = None, *, progress: bool = True) -> int:
    """Check every reference model, or the one ``name`` names; print one line per check; raise
    ``KVTrimError`` (one line) when anything is damaged, else return 0."""
    if name is None:
        models = list(rm.REFERENCE_MODELS.values())
    elif (m := rm.lookup(name)) is not None:
        models = [m]
    else:
        raise KVTrimError(f"unknown reference model {name!r}; known: {', '.join(rm.REFERENCE_MODELS)}")
    damaged = []
    for m in models:
        for what, problem in check(m, progress=progress):
            fine = problem is None or problem.startswith(("not installed", "not converted yet"))
            print(f"{what}: {'ok' if problem is None else problem}", flush=True)
            if not fine:
                damaged.append(f"{what}: {problem}")
    if damaged:
        raise KVTrimError(f"damaged: {damaged[0]}" + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else "")
                          + "; the next load assembles or converts it again")
    print("kvtrim models verify: every installed model matches its recorded SHA-256", file=sys.stderr)
    return 0
