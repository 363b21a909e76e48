"""``kvtrim eval``, ``kvtrim report``, ``kvtrim calibrate`` and ``kvtrim bench``: the evaluation and benchmark suite's commands."""

from __future__ import annotations

import json
import sys

from kvtrim.cli.common import (
    MAX_THREADS,
    check_model_options,
    fraction_arg,
    int_arg,
    kv_bits_option,
    list_arg,
    load_from_args,
    model_options,
    seed_arg,
    shard_arg,
)
from kvtrim.errors import KVTrimError


def cmd_eval(args) -> int:
    from kvtrim.eval.plan import make_plan
    from kvtrim.eval.store import SweepMismatch, check_out_dir
    from kvtrim.eval.sweep import run_eval

    plan = make_plan(args.tasks, args.length, args.methods, args.keep, samples=args.samples, seed=args.seed,
                     prefill=args.prefill, haystack=args.haystack, plain=args.plain_prompt, kv_bits=args.kv_bits)
    shard = args.shard or (0, 1)  # I/N, checked as the command line is parsed
    if args.haystack is not None:
        from kvtrim.eval.common import haystack_text

        haystack_text(args.haystack)  # an unknown haystack is refused before the model loads
    try:
        check_out_dir(args.out)  # fail on an unwritable directory or a damaged config.json before the model loads
    except SweepMismatch as e:
        if not args.force:  # with --force, run_eval picks a new directory once the model's weight digest is known
            raise KVTrimError(f"{e}; or pass --force to write to a new directory beside it") from None
    check_model_options(args)
    lm = load_from_args(args)
    try:
        summary = run_eval(lm, plan, args.out, shard=shard, progress=not args.quiet, batch=not args.unbatched,
                           force=args.force)
    except SweepMismatch as e:  # only without --force
        raise KVTrimError(f"{e}; or pass --force to write to a new directory beside it") from None
    cells, out = summary["cells"], summary["out"]
    print(f"kvtrim eval: {summary['n_lines']} result lines, {len(cells)} cells in {out} "
          f"(summary.json; `kvtrim report {out}` for tables and plots)", file=sys.stderr)
    return 0


def _check_report_paths(args) -> None:
    """--out and --readme are checked before anything is read or written (see ``kvtrim.eval.report``)."""
    import os
    from pathlib import Path

    from kvtrim.eval.report import END, START

    if args.out is not None:
        out = Path(args.out)
        existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor or "."))
        if existing == out and not out.is_dir():
            raise KVTrimError(f"--out {args.out!r} is a file; give a directory for report.md and the plots")
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise KVTrimError(f"--out {args.out!r}: cannot create a directory under {str(existing)!r}")
    if args.readme is not None:
        from kvtrim.files import read_text

        readme = Path(args.readme)
        text = read_text(readme, "--readme")  # a regular UTF-8 file within the text size limit; one line if not
        if START not in text or END not in text:
            raise KVTrimError(f"--readme {args.readme!r} has no {START} ... {END} block to fill")
        if not os.access(readme, os.W_OK):
            raise KVTrimError(f"--readme {args.readme!r} is not writable")


def cmd_report(args) -> int:
    from kvtrim.eval.report import load_dirs, render, summarize, write_report

    if not args.json:
        _check_report_paths(args)
    if args.json:
        print(json.dumps(summarize(load_dirs(args.dirs, pool=args.pool)), indent=1))
        return 0
    import time
    from pathlib import Path

    started = time.time()
    summary = write_report(args.dirs, args.out, readme=args.readme, plots=not args.no_plots,
                           image_prefix=args.image_prefix, pool=args.pool)
    print(render(summary, None))
    target = Path(args.out or args.dirs[0])
    plots = sorted(p.name for p in target.glob("*.png") if p.stat().st_mtime >= started - 1)
    print(f"kvtrim report: wrote {target / 'report.md'}" + (f" and {len(plots)} plots beside it ({', '.join(plots)})" if plots else "")
          + (f"; replaced the report block of {args.readme}" if args.readme else ""), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from kvtrim import harness
    from kvtrim.eval.bench import make_bench_plan, run_bench, table

    plan = make_bench_plan(args.methods, args.keep, args.lengths, args.reps, args.new_tokens, args.prefill, args.threads,
                           dtype=args.dtype, device=args.device, kv_bits=args.kv_bits)
    out = harness.check_out(args.out, force=args.force) if args.out else None  # before any work: nothing measured is lost
    result = run_bench(args.model, plan, rss=not args.no_rss, progress=not args.quiet)
    if out is not None:
        try:
            harness.write_json(out, result)
        except OSError as e:
            raise KVTrimError(f"cannot write --out {args.out!r}: {e.strerror or e}; the table follows") from None
        finally:
            print(table(result))
        return 0
    print(table(result))
    return 0


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from kvtrim import reference_models
    from kvtrim.budget import model_fingerprint
    from kvtrim.eval.calibrate import build_calibration, read_sweeps
    from kvtrim.eval.plan import make_plan
    from kvtrim.eval.store import check_out_dir, line_bits
    from kvtrim.eval.sweep import run_eval
    from kvtrim.files import check_output

    plan = make_plan(args.tasks, args.length, args.methods, args.keep, samples=args.samples, seed=args.seed,
                     plain=args.plain_prompt, kv_bits=args.kv_bits)
    check_model_options(args)
    if "ppl" in plan.tasks:
        raise KVTrimError("ppl has no answer to compare with the full cache's; calibrate on tasks with answers "
                          "(passkey, niah_*, vt, cwe, fwe, multiturn, labelfree)")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise KVTrimError(f"--out {args.out!r} must be a file in an existing directory")
    check_output(out, "--out", force=args.force)  # a link, an existing file: refused before the sweep
    runs = args.runs or str(out.with_suffix("")) + "-runs"
    check_out_dir(runs)
    if args.build_only and getattr(args, "rope_scaling", None):
        raise KVTrimError("--rope-scaling changes the model a sweep runs; --build-only runs none")
    if args.build_only:  # the model's label and config are enough: no weights are loaded
        from transformers import AutoConfig

        from kvtrim.models import resolve_model

        path, source = resolve_model(args.model)
        net = AutoConfig.from_pretrained(str(path))
    else:
        lm = load_from_args(args)
        source, net = lm.source, lm.model
    for d in args.extra or []:
        read_sweeps([d], source)  # refused before the sweep runs: another model, corrupted lines
    if not args.build_only:
        run_eval(lm, plan, runs, progress=not args.quiet)
    ref = reference_models.lookup(args.model) if args.model else reference_models.SMOLLM2
    model = {"key": ref.key if ref else source, "source": source, "fingerprint": model_fingerprint(net)}
    command = "kvtrim " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("kvtrim", "__main__.py")) else None
    made = {"runs": [runs, *(args.extra or [])], "seed": plan.seed, "plain_prompt": plan.plain} | ({"command": command} if command else {})
    lines = [r for r in read_sweeps([runs, *(args.extra or [])], source)
             if r["task"] in plan.tasks and line_bits(r) in plan.kv_bits]
    cal = build_calibration(lines, model, made, methods=plan.methods)
    cal.save(out, force=args.force)
    print(f"kvtrim calibrate: wrote {out} ({len(cal.methods)} methods; lines in {runs})", file=sys.stderr)
    return 0


def add_eval_commands(sub) -> None:
    """Add the ``eval``, ``report``, ``calibrate`` and ``bench`` sub-commands to kvtrim's parser."""
    from kvtrim.eval.common import MIN_LENGTH
    from kvtrim.eval.plan import ALL_TASKS, DEFAULT_KEEPS, DEFAULT_METHODS
    from kvtrim.integrations.prefill import PREFILL_MODES

    lengths = list_arg(int, MIN_LENGTH)
    keeps = list_arg(float, 0, 1, open_ends=True, hint="1 is the full cache, run as method 'full'")
    e = sub.add_parser("eval", help="resumable quality sweep: tasks x lengths x methods x budgets, JSONL per sample",
                       description="Generate every sample offline and score each method and budget against it; one "
                                   "JSON line per sample and configuration; rerun to resume (docs/eval.md).")
    e.add_argument("tasks", help=f"comma-separated tasks: {', '.join(ALL_TASKS)}")
    model_options(e)
    m = e.add_argument_group("methods and budgets")
    m.add_argument("--methods", default=",".join(DEFAULT_METHODS), metavar="A,B",
                   help="comma-separated methods, each with parameters if wanted (snapkv:layers=adaptive); "
                        "full is always included")
    m.add_argument("--keep", type=keeps, default=",".join(map(str, DEFAULT_KEEPS)), metavar="R1,R2", help="budgets")
    m.add_argument("--kv-bits", default="16", metavar="B1,B2",
                   help="bits per stored key and value element, comma-separated from 16, 8, 4, 2: every configuration "
                        "runs at each (16 always runs: the full cache at 16 bits is the reference) [default: 16]")
    m.add_argument("--prefill", default="dense", metavar="MODE", help=f"prefill attention: {', '.join(PREFILL_MODES)}")
    t = e.add_argument_group("samples")
    t.add_argument("--length", type=lengths, default="2048", metavar="N1,N2", help="prompt lengths in tokens")
    t.add_argument("--samples", type=int_arg(1), default=20, metavar="N", help="samples per cell, depths spread evenly")
    t.add_argument("--seed", type=seed_arg(), default=0, metavar="S", help="seed of the samples")
    t.add_argument("--haystack", metavar="NAME",
                   help="haystack for the needle tasks: prose, essays, pydoc or filler [default: prose]")
    t.add_argument("--plain-prompt", action="store_true",
                   help="kvtrim's plain prompt format (User: ... / Assistant:) even if the model has a chat template "
                        "(used anyway for a model without one)")
    r = e.add_argument_group("run and output")
    r.add_argument("--shard", type=shard_arg, metavar="I/N", help="run every N-th sample unit starting at I (N processes can share --out)")
    r.add_argument("--unbatched", action="store_true",
                   help="decode the configurations of a sample one at a time at batch 1 (slower; by default they "
                        "decode together, one batch row each, see docs/eval.md)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--out", required=True, metavar="DIR", help="output directory (created; a rerun resumes)")
    r.add_argument("--force", action="store_true",
                   help="if --out holds a sweep made otherwise (model, weights, dtype, prompt format, --seed, "
                        "--haystack, --samples), write to a new directory beside it (DIR-2, ...; a line says which) "
                        "instead of refusing; DIR is left as it is")
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("report", help="markdown tables and PNG plots from kvtrim eval result directories")
    r.add_argument("dirs", nargs="+", metavar="DIR", help="result directories of kvtrim eval (and anchors in the same line format)")
    i = r.add_argument_group("input")
    i.add_argument("--pool", action="store_true", help="pool directories that fill the same cells with other models, "
                   "task configurations or the same samples (refused by default; a warning each)")
    o = r.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="where report.md and the PNGs go [default: the first DIR]")
    o.add_argument("--readme", metavar="FILE", help="also replace the kvtrim-report block of this markdown file")
    o.add_argument("--image-prefix", metavar="PATH", help="path of the PNGs as written in --readme links [default: relative '.']")
    o.add_argument("--no-plots", action="store_true", help="write report.md only")
    o.add_argument("--json", action="store_true", help="print the aggregated cells as JSON and write nothing")
    r.set_defaults(func=cmd_report)

    from kvtrim.eval.calibrate import DEFAULT_KEEPS as CAL_KEEPS
    from kvtrim.eval.calibrate import DEFAULT_METHODS as CAL_METHODS
    from kvtrim.eval.calibrate import DEFAULT_TASKS as CAL_TASKS

    c = sub.add_parser("calibrate", help="measure agreement with the full cache per method and budget: the calibration "
                                         "--quality picks budgets from (see docs/autobudget.md)")
    c.add_argument("tasks", nargs="?", default=",".join(CAL_TASKS),
                   help=f"comma-separated tasks with answers [default: {','.join(CAL_TASKS)}]")
    model_options(c)
    m = c.add_argument_group("methods and budgets")
    m.add_argument("--methods", default=",".join(CAL_METHODS), metavar="A,B", help="comma-separated methods")
    m.add_argument("--keep", type=keeps, default=",".join(map(str, CAL_KEEPS)), metavar="R1,R2", help="budgets to measure")
    m.add_argument("--kv-bits", default="16", metavar="B1,B2",
                   help="bit widths of the KV cache to calibrate too, comma-separated from 16, 8, 4, 2 (16 always); "
                        "--quality then picks the (keep, bits) pair with the least memory [default: 16]")
    t = c.add_argument_group("samples")
    t.add_argument("--length", type=lengths, default="2048", metavar="N1,N2", help="prompt lengths in tokens")
    t.add_argument("--samples", type=int_arg(1), default=6, metavar="N", help="samples per task and length")
    t.add_argument("--seed", type=seed_arg(), default=0, metavar="S", help="seed of the samples")
    t.add_argument("--plain-prompt", action="store_true", help="kvtrim's plain prompt format (as in kvtrim eval)")
    o = c.add_argument_group("runs and output")
    o.add_argument("--runs", metavar="DIR", help="the kvtrim eval directory the sweep writes (resumable) "
                                                 "[default: OUT without .json + '-runs']")
    o.add_argument("--extra", action="append", metavar="DIR", help="lines of another kvtrim eval sweep of the same model to include (repeatable)")
    o.add_argument("--build-only", action="store_true", help="run no sweep: build from the lines already in --runs and "
                                                            "--extra (a partial sweep gives a calibration from fewer samples)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--out", required=True, metavar="FILE", help="the calibration JSON to write (pass it to --calibration)")
    o.add_argument("--force", action="store_true", help="replace an existing --out")
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="speed and memory: prefill vs length, decode per token, resident KV bytes, peak RSS")
    g = model_options(b, threads=False, rope=False)  # its runs load the model in kvtrim.eval.bench
    g.add_argument("--threads", type=int_arg(1, MAX_THREADS), metavar="N", help="torch threads, recorded with the result [default: torch's, one per core]")
    m = b.add_argument_group("methods and budget")
    m.add_argument("--methods", default="full,snapkv,streaming_llm", metavar="A,B", help="comma-separated methods")
    m.add_argument("--keep", type=fraction_arg(), default=0.25, metavar="R", help="budget of the compressing methods")
    m.add_argument("--prefill", default="dense", metavar="MODE", help=f"prefill attention: {', '.join(PREFILL_MODES)}")
    kv_bits_option(m)
    t = b.add_argument_group("measurement")
    t.add_argument("--lengths", type=list_arg(int, 128), default="1024,2048,4096", metavar="N1,N2", help="prompt lengths in tokens")
    t.add_argument("--reps", type=int_arg(1), default=3, metavar="N", help="timed repetitions after one warm-up")
    t.add_argument("--new-tokens", type=int_arg(2), default=32, metavar="N", help="decode steps timed per run")
    t.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs (one subprocess per configuration)")
    o = b.add_argument_group("output")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--out", metavar="FILE", help="write the JSON result here (checked before the run; an existing file is refused)")
    o.add_argument("--force", action="store_true", help="replace an existing --out")
    b.set_defaults(func=cmd_bench)
