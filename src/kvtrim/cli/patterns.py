"""``kvtrim search-patterns``: the offline per-head MInference pattern search, written as a pattern config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvtrim.cli.common import check_model_options, float_arg, int_arg, list_arg, load_from_args, model_options, seed_arg
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
                          max_error=args.max_error, query_blocks=args.query_blocks or None)
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
    model_options(s)
    g = s.add_argument_group("search")
    g.add_argument("--length", type=int_arg(256, unit="tokens"), default=8192, metavar="N",
                   help="calibration prompt length in tokens (sizes are absolute, so a config is sparser at longer "
                        "prompts and denser at shorter ones)")
    g.add_argument("--density", type=list_arg(float, 0, 1, open_ends=True), default="0.1,0.2,0.35,0.5,0.65,0.8",
                   metavar="D1,D2", help="cost levels: executed cost of the candidates as fractions of dense attention "
                                         "at --length, tried cheapest first")
    g.add_argument("--max-error", type=float_arg(0, min_open=True), default=0.05, metavar="E",
                   help="a head takes the cheapest level whose best pattern's relative output error is at most E, "
                        "else stays dense")
    g.add_argument("--query-blocks", type=int_arg(0), default=32, metavar="N",
                   help="measure each candidate's output error on N 64-row query blocks spread over the prompt "
                        "(0: every row; slower, exhaustive). 32 is 1/16 of the rows at 32k")
    g.add_argument("--seed", type=seed_arg(), default=0, metavar="S", help="seed of the calibration prompt")
    o = s.add_argument_group("output")
    o.add_argument("--tag", help="model name substring the shipped config matches (packaging only)")
    o.add_argument("--out", required=True, metavar="FILE", help="output JSON file")
    o.add_argument("--force", action="store_true", help="replace an existing --out")
    s.set_defaults(func=cmd_search_patterns)
