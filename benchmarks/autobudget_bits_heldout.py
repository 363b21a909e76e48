"""One budget for both axes on held-out samples: the (keep, bits) pair ``--quality Q`` picks against the
smallest 16-bit keep.

For a calibration made with bit widths (``kvtrim calibrate --kv-bits 16,8,4``) and a ``kvtrim eval``
directory of samples it did not see (another seed, other tasks, run at the calibration's budgets and
bit widths), per method and target ``Q``:

* **pick**: per held-out sample, the (keep, bits) pair ``kvtrim.budget`` picks for the sample's
  prompt length (the full cache where it picks none; keep 1 at a low bit width: the full cache
  quantized, nothing evicted); the agreement with the full cache (at 16 bits)
  those picks achieve on the held-out samples (``kvtrim.budget``'s definition: the mean per task,
  then the mean over tasks; also the worst task's) and their resident KV bytes over the 16-bit full
  cache's, measured on the held-out lines;
* **16-bit pick**: the same calibration's 16-bit points alone (what ``--quality`` picked before bit
  widths): the smallest 16-bit keep the calibration expects to meet ``Q``, its held-out agreement
  and KV share;
* **16-bit hindsight**: the smallest 16-bit keep of the sweep whose held-out agreement (mean over
  tasks) reaches ``Q``, and its KV share -- the best 16-bit budget knowing the held-out results.

    .venv/bin/python benchmarks/autobudget_bits_heldout.py --calibration FILE.json --heldout DIR --out RESULT.json
    .venv/bin/python benchmarks/autobudget_bits_heldout.py --table RESULT.json
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

QUALITIES = (0.5, 0.7, 0.8, 0.9, 0.95)
#: a sample's seed is ``seed * SEED_STRIDE + index`` (``kvtrim.eval.tasks.sample_seed``)
SEED_STRIDE = 100003


def evaluate(cal: Calibration, lines: list[dict], qualities=QUALITIES) -> dict:
    """The rows of one calibration on its held-out lines (see the module docstring)."""
    lines = [r for r in lines if r.get("prefill", "dense") == "dense" and r["task"] != "ppl"]
    fulls = {(r["task"], int(r["length"]), int(r["sample"])): r for r in lines
             if r["method"] == REFERENCE and line_bits(r) == 16}
    # the full cache at a low bit width is keep 1 (nothing evicted), as in the calibration
    by = {(r["task"], int(r["length"]), int(r["sample"]), r["method"],
           1.0 if r["method"] == REFERENCE else round(float(r["keep"]), 6), line_bits(r)): r
          for r in lines if (r["method"] != REFERENCE and r.get("keep") is not None)
          or (r["method"] == REFERENCE and line_bits(r) != 16)}
    grid = {key[3:] for key in by if key[3] in cal.methods}
    # a sample unit counts only when every configuration was written (an interrupted sweep leaves its last unit part-written)
    complete = {u for u in fulls if all((*u, *g) in by for g in grid)}
    fulls = {u: r for u, r in fulls.items() if u in complete}
    lines = [r for r in lines if (r["task"], int(r["length"]), int(r["sample"])) in complete]
    held = agreement_points(lines)
    only16 = cal.at_bits(16)

    def run(c: Calibration, method: str, q: float) -> dict:
        per_task: dict[str, list[float]] = defaultdict(list)
        kv, picks = [], []
        for (task, length, sample), full in sorted(fulls.items()):
            choice = c.choose(method, q, int(full["prompt_tokens"]))
            picks.append("full" if choice.full else f"{choice.keep:g}@{choice.kv_bits}")
            if choice.full:
                a: float | None = None if task != "labelfree" and float(full["score"]) <= 0 else 1.0
                kv.append(1.0)
            else:
                r = by.get((task, length, sample, REFERENCE if choice.whole else method, round(choice.keep, 6),
                            choice.kv_bits))
                if r is None:
                    raise SystemExit(f"the held-out sweep has no {method} @ {choice.keep} at {choice.kv_bits} bits for "
                                     f"{task} #{sample}; run it at the calibration's budgets and bit widths")
                a = sample_agreement(r, full)
                kv.append(float(r["kv_bytes"]) / float(r["kv_bytes_full"]))
            if a is not None:
                per_task[task].append(a)
        means = {t: statistics.fmean(v) for t, v in sorted(per_task.items())}
        return {"picks": sorted(set(picks)), "agreement": round(statistics.fmean(means.values()), 4),
                "worst_task": round(min(means.values()), 4), "by_task": {t: round(v, 4) for t, v in means.items()},
                "kv_share": round(statistics.fmean(kv), 4), "n": sum(len(v) for v in per_task.values())}

    rows = []
    methods = sorted(set(cal.methods) & set(held) - {REFERENCE})
    for method in methods:
        points16 = sorted((p for p in held[method] if p.bits == 16), key=lambda p: p.keep)
        for q in qualities:
            auto, base = run(cal, method, q), run(only16, method, q)
            hind = next((p for p in points16 if p.agreement >= q - 1e-12), None)
            rows.append({"method": method, "quality": q, "pick": auto, "pick_16bit": base,
                         "met": auto["agreement"] >= q - 1e-12, "met_16bit": base["agreement"] >= q - 1e-12,
                         "hindsight_16bit_keep": None if hind is None else hind.keep,
                         "hindsight_16bit_agreement": None if hind is None else round(hind.agreement, 4),
                         "hindsight_16bit_kv_share": None if hind is None or hind.kv_frac is None else round(hind.kv_frac, 4)})
    grid_rows = []
    for method in [*methods, *([REFERENCE] if REFERENCE in cal.methods and REFERENCE in held else [])]:
        hp = {(p.keep, p.bits): p for p in held[method]}
        for p in sorted(cal.methods[method], key=lambda p: (-p.bits, p.keep, p.length)):
            h = hp.get((p.keep, p.bits))
            grid_rows.append({"method": method, "length": p.length, "keep": p.keep, "bits": p.bits,
                              "calibrated_agreement": round(p.agreement, 4), "calibrated_worst_task": round(p.credit, 4),
                              "calibrated_kv_share": p.kv_frac,
                              "heldout_agreement": None if h is None else round(h.agreement, 4),
                              "heldout_worst_task": None if h is None else round(h.credit, 4),
                              "heldout_kv_share": None if h is None else h.kv_frac})
    return {"model": cal.model["key"],
            "calibration": {"tasks": cal.made.get("tasks"), "seed": cal.made.get("seed"), "lengths": cal.made.get("lengths"),
                            "samples": cal.made.get("samples"), "keeps": cal.made.get("keeps"),
                            "kv_bits": cal.made.get("kv_bits")},
            "heldout": {"tasks": sorted({t for t, *_ in fulls}),
                        "seeds": sorted({int(r["seed"]) // SEED_STRIDE for r in fulls.values()}),
                        "lengths": sorted({int(r["length"]) for r in fulls.values()}), "samples": len(fulls),
                        "configs": sorted(f"{m} {k:g}@{b}" for m, k, b in grid)},
            "rows": rows, "grid": grid_rows}


def table(d: dict) -> str:
    m = d["result"]
    c, h = m["calibration"], m["heldout"]
    out = [f"**{m['model']}**: calibrated on {', '.join(c['tasks'] or [])} (seed {c['seed']}, {c['lengths']} tokens, "
           f"keeps {c['keeps']}, bits {c['kv_bits']}); held out: {', '.join(h['tasks'])} (seed "
           f"{', '.join(map(str, h['seeds']))}, {h['lengths']} tokens, {h['samples']} samples)\n",
           "| method | Q | pick (keep@bits) | agreement (worst task) | KV of full | 16-bit pick | agreement (worst task) "
           "| KV of full | smallest 16-bit keep reaching Q held out | its KV |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def agr(r: dict, met: bool) -> str:
        return f"{r['agreement']:.2f} ({r['worst_task']:.2f}){'' if met else ' below Q'}"

    for r in m["rows"]:
        a, b = r["pick"], r["pick_16bit"]
        hk = "none" if r["hindsight_16bit_keep"] is None else f"{r['hindsight_16bit_keep']:g}"
        hs = "-" if r["hindsight_16bit_kv_share"] is None else f"{r['hindsight_16bit_kv_share']:.3f}"
        out.append(f"| {r['method']} | {r['quality']:g} | {'/'.join(a['picks'])} | {agr(a, r['met'])} | {a['kv_share']:.3f} "
                   f"| {'/'.join(b['picks'])} | {agr(b, r['met_16bit'])} | {b['kv_share']:.3f} | {hk} | {hs} |")
    out += ["", "Per calibrated (keep, bits): agreement with the 16-bit full cache (mean over tasks, worst task in "
            "brackets) and KV share (resident bytes over the 16-bit full cache's), calibration and held out:", "",
            "| method | tokens | keep | bits | calibrated agreement | calibrated KV | held-out agreement | held-out KV |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def share(v) -> str:
        return "-" if v is None else f"{v:.3f}"

    for g in m.get("grid", []):
        held = "-" if g["heldout_agreement"] is None else f"{g['heldout_agreement']:.2f} ({g['heldout_worst_task']:.2f})"
        out.append(f"| {g['method']} | {g['length']} | {g['keep']:g} | {g['bits']} | {g['calibrated_agreement']:.2f} "
                   f"({g['calibrated_worst_task']:.2f}) | {share(g['calibrated_kv_share'])} | {held} | {share(g['heldout_kv_share'])} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--calibration", help="a calibration JSON made with bit widths")
    ap.add_argument("--heldout", help="comma-separated kvtrim eval directories of samples the calibration did not see")
    ap.add_argument("--quality", default=",".join(map(str, QUALITIES)), help="comma-separated targets")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    if not args.calibration or not args.heldout:
        ap.error("give --calibration FILE and --heldout DIR")
    cal = Calibration.load(args.calibration)
    # every sample the calibration was made from is dropped: held out means not seen by the calibration
    seen = {(r["task"], int(r["length"]), int(r["seed"])) for r in read_sweeps(cal.made.get("runs", []))
            if r["task"] in (cal.made.get("tasks") or [])}
    lines = [r for r in read_sweeps(args.heldout.split(","), cal.model.get("source"))
             if (r["task"], int(r["length"]), int(r["seed"])) not in seen]
    qualities = [float(x) for x in args.quality.split(",")]
    result = harness.finish_record(harness.machine_record() | {
        "command": "python benchmarks/autobudget_bits_heldout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "calibration_file": args.calibration, "heldout_dirs": args.heldout.split(","),
        "result": evaluate(cal, lines, qualities)})
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
