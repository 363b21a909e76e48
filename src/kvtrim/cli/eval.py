"""``kvtrim eval``, ``kvtrim report``, ``kvtrim calibrate`` and ``kvtrim bench``: the evaluation and benchmark suite's commands."""

from __future__ import annotations

import json
import sys

from kvtrim.cli.common import check_model_options, load_from_args, model_options
from kvtrim.errors import KVTrimError


def _shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        raise KVTrimError(f"--shard takes I/N (e.g. 0/2); got {text!r}") from None
    if not sep or shard[1] < 1 or not 0 <= shard[0] < shard[1]:
        raise KVTrimError(f"--shard takes I/N with 0 <= I < N; got {text!r}")
    return shard


def cmd_eval(args) -> int:
    from kvtrim.eval.plan import make_plan
    from kvtrim.eval.store import check_out_dir
    from kvtrim.eval.sweep import run_eval

    plan = make_plan(args.tasks, args.length, args.methods, args.keep, samples=args.samples, seed=args.seed,
                     prefill=args.prefill, haystack=args.haystack, plain=args.plain_prompt)
    shard = _shard(args.shard)
    if args.haystack is not None:
        from kvtrim.eval.common import haystack_text

        haystack_text(args.haystack)  # an unknown haystack is refused before the model loads
    check_out_dir(args.out)  # fail on an unwritable directory before the model loads
    check_model_options(args)
    lm = load_from_args(args)
    summary = run_eval(lm, plan, args.out, shard=shard, progress=not args.quiet, batch=not args.unbatched)
    cells = summary["cells"]
    print(f"kvtrim eval: {summary['n_lines']} result lines, {len(cells)} cells in {args.out} "
          f"(summary.json; `kvtrim report {args.out}` for tables and plots)", file=sys.stderr)
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
        readme = Path(args.readme)
        if not readme.is_file():
            raise KVTrimError(f"--readme {args.readme!r} does not exist or is not a file")
        try:
            text = readme.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KVTrimError(f"--readme {args.readme!r} cannot be read as UTF-8 text: {e}") from None
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
    summary = write_report(args.dirs, args.out, readme=args.readme, plots=not args.no_plots,
                           image_prefix=args.image_prefix, pool=args.pool)
    print(render(summary, None))
    return 0


def cmd_bench(args) -> int:
    from kvtrim import harness
    from kvtrim.eval.bench import make_bench_plan, run_bench, table

    plan = make_bench_plan(args.methods, args.keep, args.lengths, args.reps, args.new_tokens, args.prefill, args.threads,
                           dtype=args.dtype, device=args.device)
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
    from kvtrim.eval.store import check_out_dir
    from kvtrim.eval.sweep import run_eval
    from kvtrim.files import check_output

    plan = make_plan(args.tasks, args.length, args.methods, args.keep, samples=args.samples, seed=args.seed,
                     plain=args.plain_prompt)
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
    lines = [r for r in read_sweeps([runs, *(args.extra or [])], source) if r["task"] in plan.tasks]
    cal = build_calibration(lines, model, made, methods=plan.methods)
    cal.save(out, force=args.force)
    print(f"kvtrim calibrate: wrote {out} ({len(cal.methods)} methods; lines in {runs})", file=sys.stderr)
    return 0


def add_eval_commands(sub) -> None:
    """Add the ``eval``, ``report``, ``calibrate`` and ``bench`` sub-commands to kvtrim's parser."""
    from kvtrim.eval.plan import DEFAULT_KEEPS, DEFAULT_METHODS

    e = sub.add_parser("eval", help="resumable quality sweep: tasks x lengths x methods x budgets, JSONL per sample")
    e.add_argument("tasks", help="comma-separated tasks: passkey, niah_single, niah_multikey, niah_multivalue, "
                                 "niah_multiquery, niah_phrase, vt, cwe, fwe, multiturn, ppl, labelfree")
    e.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the embedded model)")
    e.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods; full is always included")
    e.add_argument("--keep", default=",".join(map(str, DEFAULT_KEEPS)), help="comma-separated budgets in (0, 1) (default 0.1,0.25,0.5)")
    e.add_argument("--length", default="2048", help="comma-separated prompt lengths in tokens (default 2048)")
    e.add_argument("--samples", type=int, default=20, help="samples per cell, depths spread evenly (default 20)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--prefill", default="dense", help="prefill attention: dense or minference/a_shape/vertical_slash/block_sparse")
    e.add_argument("--haystack", help="haystack for the needle tasks: prose (default), essays, pydoc, filler")
    e.add_argument("--shard", help="I/N: run every N-th sample unit starting at I (N processes can share --out)")
    e.add_argument("--unbatched", action="store_true",
                   help="decode the configurations of a sample one at a time at batch 1 (slower; by default they "
                        "decode together, one batch row each, see docs/eval.md)")
    e.add_argument("--plain-prompt", action="store_true",
                   help="kvtrim's plain prompt format (User: ... / Assistant:) even if the model has a chat template "
                        "(used anyway for a model without one)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--out", required=True, help="output directory (created; a rerun resumes)")
    model_options(e)
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("report", help="markdown tables and PNG plots from kvtrim eval result directories")
    r.add_argument("dirs", nargs="+", help="result directories of kvtrim eval (and anchors in the same line format)")
    r.add_argument("--out", help="where report.md and the PNGs go (default: the first directory)")
    r.add_argument("--readme", help="also replace the kvtrim-report block of this markdown file")
    r.add_argument("--image-prefix", help="path of the PNGs as written in --readme links (default: relative '.')")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--json", action="store_true", help="print the aggregated cells as JSON and write nothing")
    r.add_argument("--pool", action="store_true", help="pool directories that fill the same cells with other models, "
                   "task configurations or the same samples (refused by default)")
    r.set_defaults(func=cmd_report)

    from kvtrim.eval.calibrate import DEFAULT_KEEPS as CAL_KEEPS
    from kvtrim.eval.calibrate import DEFAULT_METHODS as CAL_METHODS
    from kvtrim.eval.calibrate import DEFAULT_TASKS as CAL_TASKS

    c = sub.add_parser("calibrate", help="measure agreement with the full cache per method and budget: the calibration "
                                         "--quality picks budgets from (see docs/autobudget.md)")
    c.add_argument("tasks", nargs="?", default=",".join(CAL_TASKS),
                   help=f"comma-separated tasks with answers (default {','.join(CAL_TASKS)})")
    c.add_argument("--model", help="Hugging Face model directory, .gguf file or reference model (default: the embedded model)")
    c.add_argument("--methods", default=",".join(CAL_METHODS), help=f"comma-separated methods (default {','.join(CAL_METHODS)})")
    c.add_argument("--keep", default=",".join(map(str, CAL_KEEPS)), help=f"budgets to measure (default {','.join(map(str, CAL_KEEPS))})")
    c.add_argument("--length", default="2048", help="comma-separated prompt lengths in tokens (default 2048)")
    c.add_argument("--samples", type=int, default=6, help="samples per task and length (default 6)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--plain-prompt", action="store_true", help="kvtrim's plain prompt format (as in kvtrim eval)")
    c.add_argument("--runs", help="the kvtrim eval directory the sweep writes (resumable; default: OUT without .json + '-runs')")
    c.add_argument("--extra", action="append", metavar="DIR", help="lines of another kvtrim eval sweep of the same model to include (repeatable)")
    c.add_argument("--build-only", action="store_true", help="run no sweep: build from the lines already in --runs and "
                                                            "--extra (a partial sweep gives a calibration from fewer samples)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--out", required=True, help="the calibration JSON to write (pass it to --calibration)")
    c.add_argument("--force", action="store_true", help="replace an existing --out")
    model_options(c)
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="speed and memory: prefill vs length, decode per token, resident KV bytes, peak RSS")
    b.add_argument("--model")
    b.add_argument("--methods", default="full,snapkv,streaming_llm", help="comma-separated methods (default full,snapkv,streaming_llm)")
    b.add_argument("--keep", type=float, default=0.25, help="budget of the compressing methods (default 0.25)")
    b.add_argument("--lengths", default="1024,2048,4096", help="comma-separated prompt lengths (default 1024,2048,4096)")
    b.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    b.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per run (default 32)")
    b.add_argument("--prefill", default="dense", help="prefill attention mode (dense, minference, ...)")
    b.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    b.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs (one subprocess per configuration)")
    b.add_argument("--quiet", action="store_true")
    b.add_argument("--out", help="write the JSON result here (checked before the run; an existing file is refused)")
    b.add_argument("--force", action="store_true", help="replace an existing --out")
    model_options(b)
    b.set_defaults(func=cmd_bench)
