"""``kvtrim models``: the reference models, installing the ones that are not embedded, and verifying
what is installed (``kvtrim models verify``, :mod:`kvtrim.tools.verify_models`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtrim.errors import KVTrimError


def cmd_models(args) -> int:
    from kvtrim import reference_models as rm
    from kvtrim.gguf import is_converted

    if args.action == "verify":
        from kvtrim.tools.verify_models import verify

        return verify(args.name, progress=not args.quiet)
    if args.action == "install":
        if not args.name:
            raise KVTrimError("kvtrim models install needs a model name; known: " + ", ".join(rm.REFERENCE_MODELS))
        m = rm.lookup(args.name)
        if m is None:
            raise KVTrimError(f"unknown reference model {args.name!r}; known: {', '.join(rm.REFERENCE_MODELS)}")
        if m.embedded:
            print(f"{m.key} is embedded; nothing to install", file=sys.stderr)
            return 0
        path = rm.install(m, progress=not args.quiet)
        print(f"{m.key}: {path} ({m.size} bytes; its SHA-256 {m.sha256} was verified when the parts were assembled)")
        return 0
    rows: list[dict] = []
    for m in rm.REFERENCE_MODELS.values():
        gguf, converted = _paths(m)
        rows.append({"name": m.key, "model": m.name, "installed": rm.is_installed(m), "about": m.about,
                     "install": None if m.embedded else rm.install_command(m),
                     "gguf": None if gguf is None else str(gguf),
                     "path": None if converted is None else str(converted),
                     "converted": converted is not None and is_converted(converted)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table: list[tuple[str, str, str]] = [("name", "state", "about")]
    for r in rows:
        if not r["installed"]:
            state = f"not installed: {r['install']}"
        elif r["converted"]:
            state = f"ready: {r['path']}"
        else:
            state = "installed; converted on first load"
        table.append((r["name"], state, r["about"]))
    widths = [max(len(row[i]) for row in table) for i in range(2)]
    for name, state, about in table:
        print(f"{name:<{widths[0]}}  {state:<{widths[1]}}  {about}")
    return 0


def _paths(m) -> tuple[Path | None, Path | None]:
    """The GGUF of reference model ``m`` and the transformers directory kvtrim converts it into (for
    another engine such as vLLM, or ``kvtrim serve``); Nones while it is not installed."""
    from kvtrim import reference_models as rm
    from kvtrim.errors import ModelLoadError
    from kvtrim.gguf import DEFAULT_NAME, converted_path, embedded_gguf_path

    try:
        gguf = embedded_gguf_path() if m.embedded else m.gguf_path if rm.is_installed(m) else None
    except ModelLoadError:  # the embedded model's package is not in this environment
        return None, None
    if gguf is None:
        return None, None
    return gguf, converted_path(gguf, DEFAULT_NAME if m.embedded else m.name)


def add_model_commands(sub) -> None:
    """Add the ``models`` sub-command to kvtrim's parser."""
    p = sub.add_parser("models", help="list kvtrim's reference models (--model NAME), install or verify one",
                       description="List kvtrim's reference models (usable as --model NAME) with the transformers "
                                   "directory each is converted into, install one, or verify what is installed "
                                   "(hash each assembled GGUF and conversion whole against its recorded SHA-256).")
    p.add_argument("action", nargs="?", choices=["list", "install", "verify"], default="list",
                   help="what to do [default: list]")
    p.add_argument("name", nargs="?", help="the reference model to install or verify (e.g. qwen2.5-0.5b; verify: all "
                                          "when omitted)")
    p.add_argument("--json", action="store_true", help="print the list as JSON: name, model, installed, about, install, "
                                                       "gguf, path (the converted transformers directory), converted")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_models)
