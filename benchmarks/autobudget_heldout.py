"""Automatic budget on held-out samples: what ``--quality Q`` achieves against fixed budgets.

For each model (a calibration file and a ``kvtrim eval`` directory of samples the calibration did
not see: other tasks and another seed, run at the calibration's budgets), each method and each
target ``Q``:

* **auto**: per held-out sample, the budget ``kvtrim.budget`` picks for the sample's prompt length
  (the full cache where it picks none); the agreement with the full cache those picks achieve on
  the held-out samples (``kvtrim.budget``'s definition: per task, then the mean over tasks) and the
  KV memory they save (1 - mean resident KV / the full cache's, measured);
* **fixed (hindsight)**: the smallest fixed keep of the sweep whose held-out agreement reaches ``Q``
  for this method -- the best a user could have done knowing the held-out results;
* **one keep for all**: the smallest fixed keep that reaches ``Q`` for every method.

    .venv/bin/python benchmarks/autobudget_heldout.py --model smollm2 src/kvtrim/calibration/smollm2.json \\
        benchmarks/results/autobudget/smollm2-heldout --out benchmarks/results/autobudget/heldout.json
    .venv/bin/python benchmarks/autobudget_heldout.py --table benchmarks/results/autobudget/heldout.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from kvtrim import harness
from kvtrim.budget import Calibration
from kvtrim.eval.calibrate import agreement_points, read_sweeps, sample_agreement
from kvtrim.eval.plan import REFERENCE
from kvtrim.eval.store import line_bits

QUALITIES = (0.5, 0.7, 0.8, 0.9)
#: a sample's seed is ``seed * SEED_STRIDE + index`` (``kvtrim.eval.tasks.sample_seed``)
SEED_STRIDE = 100003


def evaluate(cal: Calibration, lines: list[dict], qualities=QUALITIES) -> dict:
    """The rows of one model (see the module docstring)."""
    # 16-bit lines only (a sweep with bit widths: benchmarks/autobudget_bits_heldout.py)
    lines = [r for r in lines if r.get("prefill", "dense") == "dense" and r["task"] != "ppl" and line_bits(r) == 16]
    fulls = {(r["task"], int(r["length"]), int(r["sample"])): r for r in lines if r["method"] == REFERENCE}
    by = {(r["task"], int(r["length"]), int(r["sample"]), r["method"], round(float(r["keep"]), 6)): r
          for r in lines if r["method"] != REFERENCE and r.get("keep") is not None}
    methods = set(cal.methods)
    grid = {(m, k) for (_, _, _, m, k) in by if m in methods}
    # a sample unit counts only when every configuration of the sweep was written (an interrupted sweep
    # leaves its last unit part-written)
    complete = {u for u in fulls if all((*u, m, k) in by for m, k in grid)}
    fulls = {u: r for u, r in fulls.items() if u in complete}
    lines = [r for r in lines if (r["task"], int(r["length"]), int(r["sample"])) in complete]
    held = agreement_points(lines)
    keeps = sorted({p.keep for pts in held.values() for p in pts})
    tasks = sorted({t for t, *_ in fulls})
    rows = []
    for method in sorted(set(cal.methods) & set(held)):
        points = {p.keep: p for p in held[method]}
        for q in qualities:
            per_task: dict[str, list[float]] = defaultdict(list)
            kv, picks = [], []
            for (task, length, sample), full in sorted(fulls.items()):
                choice = cal.choose(method, q, int(full["prompt_tokens"]))
                picks.append(choice.keep)
                if choice.full:
                    a: float | None = None if task != "labelfree" and float(full["score"]) <= 0 else 1.0
                    kv.append(1.0)
                else:
                    r = by.get((task, length, sample, method, round(choice.keep, 6)))
                    if r is None:
                        raise SystemExit(f"the held-out sweep has no {method} @ {choice.keep} line for {task} #{sample}; "
                                         "run it at the calibration's budgets")
                    a = sample_agreement(r, full)
                    kv.append(float(r["kv_bytes"]) / float(r["kv_bytes_full"]))
                if a is not None:
                    per_task[task].append(a)
            agreement = statistics.fmean(statistics.fmean(v) for v in per_task.values())
            fixed = next((k for k in keeps if k in points and points[k].agreement >= q - 1e-12), None)
            rows.append({
                "method": method, "quality": q, "auto_keeps": sorted(set(picks)),
                "auto_agreement": round(agreement, 4), "met": agreement >= q - 1e-12,
                "auto_agreement_by_task": {t: round(statistics.fmean(v), 4) for t, v in sorted(per_task.items())},
                "auto_kv_saved": round(1 - statistics.fmean(kv), 4),
                "fixed_keep": fixed, "fixed_agreement": round(points[fixed].agreement, 4) if fixed else None,
                "fixed_kv_saved": round(1 - points[fixed].kv_frac, 4) if fixed and points[fixed].kv_frac is not None else 0.0,
                "n": sum(len(v) for v in per_task.values()),
            })
    uniform = {}
    for q in qualities:
        ok = [k for k in keeps if all(any(p.keep == k and p.agreement >= q - 1e-12 for p in held[m])
                                      for m in set(cal.methods) & set(held))]
        uniform[str(q)] = ok[0] if ok else None
    return {"model": cal.model["key"], "calibration": {"tasks": cal.made.get("tasks"), "seed": cal.made.get("seed"),
                                                       "lengths": cal.made.get("lengths"), "samples": cal.made.get("samples")},
            "heldout": {"tasks": tasks, "seeds": sorted({int(r["seed"]) // SEED_STRIDE for r in fulls.values()}),
                        "lengths": sorted({int(r["length"]) for r in fulls.values()}), "samples": len(fulls),
                        "keeps": keeps},
            "rows": rows, "one_keep_for_all": uniform}


def table(d: dict) -> str:
    out = []
    for m in d["models"]:
        h = m["heldout"]
        out.append(f"**{m['model']}**: calibrated on {', '.join(m['calibration']['tasks'] or [])} (seed "
                   f"{m['calibration']['seed']}, {m['calibration']['lengths']} tokens); held out: "
                   f"{', '.join(h['tasks'])} (seed {', '.join(map(str, h['seeds']))}, {h['lengths']} tokens, "
                   f"{h['samples']} samples)\n")
        out.append("| method | Q | auto keep | agreement (auto) | KV saved (auto) | smallest fixed keep reaching Q "
                   "| its KV saved | one keep for all methods |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in m["rows"]:
            keeps = "/".join("full" if k >= 1 else f"{k:g}" for k in r["auto_keeps"])
            fixed = "none" if r["fixed_keep"] is None else f"{r['fixed_keep']:g}"
            uni = m["one_keep_for_all"][str(r["quality"])]
            out.append(f"| {r['method']} | {r['quality']:g} | {keeps} | {r['auto_agreement']:.2f}{'' if r['met'] else ' (below Q)'} "
                       f"| {r['auto_kv_saved']:.0%} | {fixed} | {r['fixed_kv_saved']:.0%} | {'none' if uni is None else f'{uni:g}'} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--model", action="append", nargs=3, metavar=("KEY", "CALIBRATION", "DIRS"), default=[],
                    help="a model's key, its calibration JSON and comma-separated kvtrim eval directories to evaluate on "
                         "(samples the calibration was made from are dropped) (repeatable)")
    ap.add_argument("--quality", default=",".join(map(str, QUALITIES)), help="comma-separated targets")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    if not args.model:
        ap.error("give at least one --model KEY CALIBRATION HELDOUT_DIR")
    qualities = [float(x) for x in args.quality.split(",")]
    models = []
    for key, cal_path, held in args.model:
        cal = Calibration.load(cal_path).at_bits(16)
        if cal.model["key"] != key:
            ap.error(f"{cal_path} is the calibration of {cal.model['key']!r}, not {key!r}")
        # every sample the calibration was made from is dropped: held out means not seen by the calibration
        seen = {(r["task"], int(r["length"]), int(r["seed"])) for r in read_sweeps(cal.made.get("runs", []))
                if r["task"] in (cal.made.get("tasks") or [])}
        lines = [r for r in read_sweeps(held.split(","), cal.model.get("source"))
                 if (r["task"], int(r["length"]), int(r["seed"])) not in seen]
        models.append(evaluate(cal, lines, qualities) | {"calibration_file": cal_path, "heldout_dirs": held.split(",")})
    result = harness.finish_record(harness.machine_record() | {"command": "python benchmarks/autobudget_heldout.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                    "models": models})
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
