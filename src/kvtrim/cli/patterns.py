"""``kvtrim search-patterns``: the offline per-head MInference pattern search, written as a pattern config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvtrim.cli.common import check_model_options, load_from_args, model_options
from kvtrim.errors import KVTrimError


def cmd_search_patterns(args) -> int:
    from kvtrim.files import check_output
    from kvtrim.tools.search_patterns import save_config, search_patterns

    try:
        levels = sorted(float(x) for x in args.density.split(","))
    except ValueError:
        raise KVTrimError(f"--density takes comma-separated fractions, e.g. 0.1,0.2,0.35,0.5,0.65,0.8; got {args.density!r}") from None
    if not all(0.0 < d < 1.0 for d in levels):
        raise KVTrimError(f"--density must be in (0, 1); got {args.density}")
    if args.max_error is not None and not args.max_error > 0:
        raise KVTrimError(f"--max-error must be > 0; got {args.max_error}")
    if args.length < 256:
        raise KVTrimError(f"--length must be >= 256 tokens; got {args.length}")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise KVTrimError(f"--out {args.out!r} is a directory; give a file name")
    if not out.parent.is_dir():
        raise KVTrimError(f"--out: directory {str(out.parent)!r} does not exist")
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise KVTrimError(f"--out {args.out!r} is not writable")
    check_output(out, "--out", force=args.force)  # a link, an existing file: refused before the model loads
    check_model_options(args)
    lm = load_from_args(args)
    tags = [args.tag] if args.tag else []
    cfg = search_patterns(lm.model, lm.tokenizer, length=args.length, target_density=levels, seed=args.seed, model_tags=tags,
                          max_error=args.max_error)
    save_config(cfg, out, force=args.force)
    counts = cfg.counts()
    errs = [e["error"] for row in cfg.layers for e in row]
    print(
        f"wrote {out}: {sum(counts.values())} heads ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"mean output error {sum(errs) / len(errs):.4f}; {cfg.search['seconds']} s",
        file=sys.stderr,
    )
    return 0


def add_search_patterns_command(sub) -> None:
    """Add the ``search-patterns`` sub-command to kvtrim's parser."""
    s = sub.add_parser("search-patterns", help="offline per-head MInference pattern search; writes a pattern config")
    s.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the embedded model)")
    s.add_argument("--length", type=int, default=8192, help="calibration prompt length in tokens (default 8192; sizes are absolute, so a config is sparser at longer prompts and denser at shorter ones)")
    s.add_argument("--density", default="0.1,0.2,0.35,0.5,0.65,0.8", help="cost levels: executed cost of the candidates as fractions of dense attention at --length, tried cheapest first (default 0.1,0.2,0.35,0.5,0.65,0.8)")
    s.add_argument("--max-error", type=float, default=0.05, help="a head takes the cheapest level whose best pattern's relative output error is <= this, else stays dense (default 0.05)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tag", help="model name substring the shipped config matches (packaging only)")
    s.add_argument("--out", required=True, help="output JSON file")
    s.add_argument("--force", action="store_true", help="replace an existing --out")
    model_options(s)
    s.set_defaults(func=cmd_search_patterns)
