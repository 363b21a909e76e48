"""``kvtrim calibrate``: the auto-budget calibration of a model, from ``kvtrim eval`` result lines.

A calibration (``kvtrim.budget.Calibration``) holds, per (method, prompt length, keep), the mean
**agreement with the full cache** (``kvtrim.budget`` defines it): per sample, ``min(1, s / s_full)``
on a labelled task (samples the full cache gets wrong left out), the ROUGE-L F1 against the full
cache's answer on ``labelfree`` (its ``score``); a mean per task, then the mean over tasks.

It is built from the lines of an ordinary sweep (``DIR/runs/*.jsonl``), so ``kvtrim calibrate``
runs :func:`kvtrim.eval.sweep.run_eval` (resumable, one shared prefill per sample for all methods
and budgets) and then :func:`build_calibration` on its lines and on those of any other sweep of the
same model (``--extra DIR``). ``ppl`` has no answer to agree with and is left out.

A sweep with bit widths (``kvtrim eval --kv-bits 16,8,4``) gives one point per (method, length,
keep, bits) (calibration format 2), every one scored against the full cache at 16 bits;
``kv_frac`` is the configuration's measured resident bytes over that full cache's, scales and
residual included, which is what ``--quality`` compares pairs by (``kvtrim.budget``). The full
cache's low-bit lines give points of method ``full`` at keep 1 (nothing evicted, every token
quantized), a candidate for every method.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from kvtrim.budget import AGREEMENT, Calibration, Point
from kvtrim.errors import KVTrimError
from kvtrim.eval.plan import REFERENCE
from kvtrim.eval.store import line_bits, result_files
from kvtrim.files import read_json

#: tasks without an answer to compare with the full cache's
NO_AGREEMENT = ("ppl",)

#: the defaults of ``kvtrim calibrate``
DEFAULT_TASKS = ("passkey", "niah_single", "labelfree")
DEFAULT_KEEPS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
DEFAULT_METHODS = ("snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic")


def sample_agreement(line: dict, full: dict) -> float | None:
    """Agreement of one result line with the full cache's line for the same sample (None: not defined,
    the full cache scored 0 on a labelled task)."""
    if line["task"] == "labelfree":
        return float(line["score"])
    f = float(full["score"])
    if f <= 0:
        return None
    return min(1.0, float(line["score"]) / f)


def agreement_points(lines: Iterable[dict], prefill: str = "dense") -> dict[str, list[Point]]:
    """Method -> calibration points (one per length and keep) from result lines (see the module docstring)."""
    lines = [r for r in lines if r.get("prefill", "dense") == prefill and r["task"] not in NO_AGREEMENT]
    fulls = {(r["task"], int(r["length"]), int(r["sample"])): r for r in lines
             if r["method"] == REFERENCE and line_bits(r) == 16}
    per: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    kv: dict[tuple, list[float]] = defaultdict(list)
    for r in lines:
        bits = line_bits(r)
        if r["method"] == REFERENCE and bits != 16:
            keep = 1.0  # the full cache at a low bit width: nothing evicted, every token quantized
        elif r["method"] == REFERENCE or r.get("keep") is None:
            continue
        else:
            keep = round(float(r["keep"]), 6)
        full = fulls.get((r["task"], int(r["length"]), int(r["sample"])))
        if full is None:
            continue
        key = (r["method"], int(r["length"]), keep, bits)
        a = sample_agreement(r, full)
        if a is not None:
            per[key][r["task"]].append(a)
        if r.get("kv_bytes_full"):
            kv[key].append(float(r["kv_bytes"]) / float(r["kv_bytes_full"]))
    out: dict[str, list[Point]] = defaultdict(list)
    for (method, length, keep, bits), tasks in sorted(per.items()):
        means = {t: round(statistics.fmean(v), 6) for t, v in sorted(tasks.items())}
        share = kv[(method, length, keep, bits)]
        out[method].append(Point(length, keep, statistics.fmean(means.values()), sum(len(v) for v in tasks.values()),
                                 {t: {"agreement": means[t], "n": len(tasks[t])} for t in means},
                                 round(statistics.fmean(share), 6) if share else None, bits))
    return {m: sorted(pts, key=lambda p: (p.length, -p.bits, p.keep)) for m, pts in out.items()}  # as a file reads back


def read_sweeps(dirs: Iterable[str | Path], model_source: str | None = None) -> list[dict]:
    """Result lines of ``kvtrim eval`` directories, all of one model (``config.json``); corrupted lines
    refused, and so is pooling directories that fill the same cell with other weights, another task
    configuration or the same samples (:func:`kvtrim.eval.store.check_pool`)."""
    from kvtrim.eval.store import check_pool, describe_bad, scan_lines

    paths = [Path(d) for d in dirs]
    per_dir: list[list[dict]] = []
    for d in paths:
        cfg = d / "config.json"
        if not cfg.is_file():
            raise KVTrimError(f"{str(d)!r} is not a kvtrim eval directory (no config.json)")
        d_cfg = read_json(cfg, "eval config")
        if not isinstance(d_cfg, dict):
            raise KVTrimError(f"eval config {str(cfg)!r} is not a JSON object; the directory is damaged")
        held = d_cfg.get("model")
        if model_source is not None and held != model_source:
            raise KVTrimError(f"{str(d)!r} holds a sweep of {held!r}, not {model_source!r}")
        model_source = held
        rows, bad = scan_lines(result_files(d))
        if bad:
            raise KVTrimError(f"{str(d)!r} has corrupted result lines: {describe_bad(bad)}; rerun its kvtrim eval")
        per_dir.append(rows)
    if len(paths) > 1:
        check_pool(paths, per_dir)
    return [r for rows in per_dir for r in rows]


def build_calibration(lines: list[dict], model: dict, made: dict | None = None, methods: Iterable[str] | None = None) -> Calibration:
    """A :class:`kvtrim.budget.Calibration` from result lines; ``model`` = {"key", "source", "fingerprint"}."""
    points = agreement_points(lines)
    if methods is not None:
        points = {m: p for m, p in points.items() if m in set(methods)}
    if not points:
        raise KVTrimError("no result line pairs a compressing method with the full cache on a task with an answer "
                          "(ppl has none); nothing to calibrate from")
    used = sorted({r["task"] for r in lines if r["task"] not in NO_AGREEMENT})
    made = {"agreement": AGREEMENT, "tasks": used, "lengths": sorted({int(r["length"]) for r in lines}),
            "keeps": sorted({p.keep for pts in points.values() for p in pts}),
            "kv_bits": sorted({p.bits for pts in points.values() for p in pts}, reverse=True),
            "samples": len({(r["task"], r["length"], r["sample"]) for r in lines if r["method"] == REFERENCE}),
            "date": time.strftime("%Y-%m-%d"), **(made or {})}
    return Calibration(model=model, methods=points, made=made)
