"""``kvtrim models``: the reference models, and installing the ones that are not embedded."""

from __future__ import annotations

import json
import sys

from kvtrim.errors import KVTrimError


def cmd_models(args) -> int:
    from kvtrim import reference_models as rm

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
    rows = [{"name": m.key, "model": m.name, "installed": rm.is_installed(m), "about": m.about,
             "install": None if m.embedded else rm.install_command(m)} for m in rm.REFERENCE_MODELS.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "installed" if r["installed"] else f"not installed ({r['install']})"
            print(f"{r['name']:14s} {state:45s} {r['about']}")
    return 0


def add_model_commands(sub) -> None:
    """Add the ``models`` sub-command to kvtrim's parser."""
    p = sub.add_parser("models", help="list kvtrim's reference models (--model NAME), or install one")
    p.add_argument("action", nargs="?", choices=["list", "install", "verify"], default="list")
    p.add_argument("name", nargs="?", help="the reference model to install (e.g. qwen2.5-0.5b)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_models)
