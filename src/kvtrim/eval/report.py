"""``kvtrim report``: tables (markdown) and plots (PNG) from the result lines of ``kvtrim eval``.

:func:`summarize` aggregates lines into cells keyed by (task, length, method, keep, prefill):

- ``score``: the mean over samples (``ppl``: the perplexity pooled over all continuation tokens,
  ``exp(sum nll / sum tokens)``; lower is better). ``labelfree``: mean ROUGE-L F1 against the full
  cache's answer, and ``ref_ppl``, the pooled perplexity of that answer under the method's cache.
- ``rel_full``: the cell's score divided by the full cache's on *the same samples* (for ``ppl``
  the ratio of perplexities, so 1.05 = 5% worse); None where the full cache scores 0 there.
- ``kv_bytes``: mean resident key/value bytes at the end of the sample; ``kv_frac``: that over the
  full cache's mean on the same samples.
- ``prefill_s``: median prefill seconds; ``decode_ms``: median decode milliseconds per token over
  the lines decoded alone (``decode_rows`` 1 or absent); None when all were batch rows.

A line whose cache held fewer than 16 bits per element (``kv_bits``, ``kvtrim eval --kv-bits``) is
its own cell, whose ``method`` is labelled with the bit width (``snapkv@4bit``; ``base_method`` and
``kv_bits`` give the two apart), so every table and plot shows it as a method of its own; the
reference of ``rel_full`` and ``kv_frac`` is the full cache at 16 bits.

:func:`write_report` writes ``report.md`` and PNG plots (matplotlib): score vs budget per task
(one panel per task, one line per method, the full cache dashed), KV bytes vs budget, prefill
and decode time vs length. ``--readme FILE`` replaces the block between
``<!-- kvtrim-report:start -->`` and ``<!-- kvtrim-report:end -->`` in FILE with the main tables,
so the README's results are produced from committed result files, never typed.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvtrim.errors import CorruptResultsError, KVTrimError
from kvtrim.eval.plan import REFERENCE
from kvtrim.eval.store import line_bits
from kvtrim.files import read_text, write_atomic

START = "<!-- kvtrim-report:start -->"
END = "<!-- kvtrim-report:end -->"
LOWER_IS_BETTER = ("ppl",)
MIN_FULL_SCORE = 0.5  # the relative summary counts only tasks where the full cache scores at least this


def _keep(v):
    return None if v is None else round(float(v), 6)


def summarize(lines: Iterable[dict]) -> dict:
    """Aggregate result lines into cells (see the module docstring); returns ``{"cells": [...], "n_lines": N}``."""
    lines = list(lines)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in lines:
        groups[(r["task"], int(r["length"]), bits_label(r["method"], line_bits(r)), _keep(r.get("keep")),
                r.get("prefill", "dense"))].append(r)
    full_by_sample: dict[tuple, dict] = {}
    for r in lines:
        if r["method"] == REFERENCE and line_bits(r) == 16:
            full_by_sample[(r["task"], int(r["length"]), r.get("prefill", "dense"), int(r["sample"]))] = r
    cells = []
    for (task, length, method, keep, prefill), rows in sorted(groups.items(), key=lambda kv: _sort_key(kv[0])):
        cell = {"task": task, "length": length, "method": method, "keep": keep, "prefill": prefill, "n": len(rows)}
        if (bits := line_bits(rows[0])) != 16:
            cell |= {"base_method": rows[0]["method"], "kv_bits": bits}
        cell["score"] = _score(task, rows)
        fulls = [full_by_sample.get((task, length, prefill, int(r["sample"]))) for r in rows]
        paired = [(r, f) for r, f in zip(rows, fulls) if f is not None]
        cell["n_paired"] = len(paired)
        if paired:
            s_m = _score(task, [r for r, _ in paired])
            s_f = _score(task, [f for _, f in paired])
            cell["full_score"] = s_f
            cell["rel_full"] = (s_m / s_f) if s_f else None  # undefined where the full cache scores 0
            kv_f = statistics.fmean(f["kv_bytes"] for _, f in paired)
            cell["kv_frac"] = statistics.fmean(r["kv_bytes"] for r, _ in paired) / kv_f if kv_f else None
        if task == "labelfree":
            refs = [r for r in rows if r.get("ref_nll_sum") is not None and r.get("ref_tokens")]
            if refs:
                cell["ref_ppl"] = _exp(sum(r["ref_nll_sum"] for r in refs) / sum(r["ref_tokens"] for r in refs))
        cell["kv_bytes"] = statistics.fmean(r["kv_bytes"] for r in rows)
        cell["prefill_s"] = statistics.median(r["prefill_seconds"] for r in rows)
        # per-token decode time from lines decoded alone; a batch row's decode_seconds is its share of
        # steps it took with other configurations (kvtrim.integrations.batched), not a lone generation's time
        per_tok = [r["decode_seconds"] / r["decode_steps"] for r in rows
                   if r.get("decode_steps") and (r.get("decode_rows") or 1) == 1]
        cell["decode_ms"] = 1000 * statistics.median(per_tok) if per_tok else None
        # every line's decode time per token, batch rows included (their share of shared steps): what the
        # plot falls back to when no line was decoded alone
        any_tok = [r["decode_seconds"] / r["decode_steps"] for r in rows if r.get("decode_steps")]
        cell["decode_ms_any"] = 1000 * statistics.median(any_tok) if any_tok else None
        cells.append(cell)
    return {"cells": cells, "n_lines": len(lines)}


def bits_label(method: str, bits: int) -> str:
    """A method's name in a report: ``snapkv`` at 16 bits, ``snapkv@4bit`` with a 4-bit cache."""
    return method if bits == 16 else f"{method}@{bits}bit"


def _exp(x: float) -> float:
    """``exp(x)``, infinite past the largest float (a perplexity beyond it is reported as inf)."""
    return math.exp(x) if x < 709.0 else math.inf


def _score(task: str, rows: list[dict]) -> float:
    if task == "ppl":
        return _exp(sum(r["nll_sum"] for r in rows) / sum(r["n_target"] for r in rows))
    return statistics.fmean(float(r["score"]) for r in rows)


def _sort_key(key: tuple) -> tuple:
    task, length, method, keep, prefill = key
    return (length, task, prefill, method != REFERENCE, method, -1 if keep is None else keep)


# ----------------------------------------------------------------------------- tables
def _fmt(task: str, v) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" if task == "ppl" else f"{v:.2f}"


def _label(method: str, keep) -> str:
    return method if keep is None else f"{method} @{keep:g}"


def eligible_tasks(cells: list[dict], length: int, prefill: str = "dense") -> list[str]:
    """Tasks whose full-cache score at ``length`` is at least :data:`MIN_FULL_SCORE` (ppl excluded: not a 0-1 score).

    A ratio to a full-cache score near 0 says nothing (0.03 to 0.05 is "167%"), so the relative summary
    is taken over these tasks only."""
    return [c["task"] for c in cells if c["length"] == length and c["prefill"] == prefill and c["method"] == REFERENCE
            and c["task"] not in LOWER_IS_BETTER and c["score"] is not None and c["score"] >= MIN_FULL_SCORE]


def row_summary(cells: list[dict], length: int, method: str, keep, prefill: str = "dense") -> tuple[float | None, float | None]:
    """(mean score, mean score relative to the full cache) of one row over :func:`eligible_tasks`."""
    tasks = eligible_tasks(cells, length, prefill)
    sel = [c for c in cells if c["length"] == length and c["prefill"] == prefill and c["method"] == method
           and c["keep"] == keep and c["task"] in tasks]
    if not sel:
        return None, None
    rels = [c["rel_full"] for c in sel if c.get("rel_full") is not None]
    return statistics.fmean(c["score"] for c in sel), (statistics.fmean(rels) if rels else None)


def score_table(cells: list[dict], length: int, prefill: str = "dense") -> str:
    """Markdown: rows = method @ keep, columns = tasks (score), then the mean score and its ratio to full over
    the tasks where the full cache scores at least MIN_FULL_SCORE, at one length."""
    sel = [c for c in cells if c["length"] == length and c["prefill"] == prefill]
    tasks = list(dict.fromkeys(c["task"] for c in sel))
    rows = list(dict.fromkeys((c["method"], c["keep"]) for c in sel))
    by = {(c["task"], c["method"], c["keep"]): c for c in sel}
    n = sorted({c["n"] for c in sel})
    ref_col = "labelfree" in tasks  # the label-free protocol's second number: PPL of the full cache's answer
    head = ("| method @ keep | " + " | ".join(tasks) + (" | labelfree ref. ppl" if ref_col else "")
            + f" | mean score (full ≥ {MIN_FULL_SCORE:g}) | rel. to full |")
    out = [head, "|---|" + "---:|" * (len(tasks) + 2 + ref_col)]
    for m, k in rows:
        vals = []
        for t in tasks:
            c = by.get((t, m, k))
            vals.append("—" if c is None else _fmt(t, c["score"]))
        if ref_col:
            c = by.get(("labelfree", m, k))
            vals.append(_fmt("ppl", c.get("ref_ppl")) if c is not None and c.get("ref_ppl") is not None else "—")
        mean, rel = row_summary(cells, length, m, k, prefill)
        vals += [_fmt("score", mean), "—" if rel is None else f"{rel:.0%}"]
        out.append(f"| {_label(m, k)} | " + " | ".join(vals) + " |")
    elig = eligible_tasks(cells, length, prefill)
    note = (f"\n\n{length} tokens, prefill {prefill}; samples per cell: {', '.join(map(str, n))}. Scores: mean "
            "(passkey/niah/multiturn: fraction correct; multi-answer tasks: recall; labelfree: ROUGE-L F1 against the "
            "full cache's answer; ppl: pooled perplexity, lower is better). Last two columns: over the tasks where the "
            f"full cache scores at least {MIN_FULL_SCORE:g} ({', '.join(elig) or 'none'}), the mean score and the mean of "
            "each task's score relative to the full cache's on the same samples; the other tasks, where even the full "
            "cache mostly fails, are left out of both.")
    return "\n".join(out) + note


def cost_table(cells: list[dict], prefill: str = "dense") -> str:
    """Markdown: rows = method @ keep, columns per length: KV MiB (fraction of full), prefill s, decode ms/token."""
    sel = [c for c in cells if c["prefill"] == prefill]
    lengths = sorted({c["length"] for c in sel})
    rows = list(dict.fromkeys((c["method"], c["keep"]) for c in sel))
    head = "| method @ keep | " + " | ".join(f"KV MiB @{n} | prefill s @{n} | decode ms/tok @{n}" for n in lengths) + " |"
    out = [head, "|---|" + "---:|" * (3 * len(lengths))]
    for m, k in rows:
        parts = []
        for n in lengths:
            cs = [c for c in sel if c["method"] == m and c["keep"] == k and c["length"] == n]
            if not cs:
                parts += ["—"] * 3
                continue
            kv = statistics.fmean(c["kv_bytes"] for c in cs) / 2**20
            frac = [c["kv_frac"] for c in cs if c.get("kv_frac") is not None]
            pre = statistics.median(c["prefill_s"] for c in cs)
            dec = [c["decode_ms"] for c in cs if c.get("decode_ms") is not None]
            parts += [f"{kv:.1f} ({statistics.fmean(frac):.0%})" if frac else f"{kv:.1f}", f"{pre:.2f}",
                      f"{statistics.median(dec):.1f}" if dec else "—"]
        out.append(f"| {_label(m, k)} | " + " | ".join(parts) + " |")
    return "\n".join(out) + ("\n\nKV MiB: mean resident key/value bytes at the end of a sample (1 MiB = 2^20 bytes), in brackets the "
                             "fraction of the full cache's; times: medians over the cells' samples (all tasks); decode ms/tok only "
                             "from samples decoded alone (— where every sample was decoded as a batch row, see docs/eval.md; "
                             "`kvtrim bench` measures decode speed).")


# ----------------------------------------------------------------------------- plots
#: a marker shape per method, in the order the methods are drawn
MARKERS = ("s", "^", "D", "v", "P", "X", "<", ">", "h", "p")  # "o" is the full cache's


def line_styles(methods: list[str]) -> dict[str, dict]:
    """Matplotlib line properties per method, so that no method's line can hide another's: each has
    its colour and marker shape, markers are hollow, and each method drawn later is thinner and has
    smaller markers than the one before (and lies above it). Where two methods score the same, the
    later one's line runs inside the earlier one's and its marker sits inside the earlier ring:
    both stay visible. The reference (``full``) is a thin dashed black line on top of them all."""
    k = len(methods)
    return {m: {"color": f"C{i % 10}", "marker": MARKERS[i % len(MARKERS)], "markerfacecolor": "none",
                "markeredgewidth": 1.3, "markersize": 4.5 + 1.7 * (k - 1 - i), "linewidth": 1.5 + 0.6 * (k - 1 - i),
                "zorder": 2 + i, "label": m}
            for i, m in enumerate(methods)}


REFERENCE_STYLE: dict[str, Any] = {"color": "black", "linestyle": "--", "linewidth": 1.0, "markersize": 3.5, "zorder": 50}


def score_figure(cells: list[dict], length: int, tasks: list[str], methods: list[str]):
    """The score-vs-keep figure of one prompt length: one panel per task, one line per method (see
    :func:`line_styles`), the full cache's score as a dashed line, one legend below."""
    import matplotlib.pyplot as plt

    styles = line_styles(methods)
    cols = min(4, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.7 * rows + 0.8), squeeze=False, layout="constrained")
    for ax, t in zip(axes.flat, tasks):
        cs = [c for c in cells if c["length"] == length and c["task"] == t]
        for m in methods:
            pts = sorted((c["keep"], c["score"]) for c in cs if c["method"] == m and c["keep"] is not None)
            if pts:
                ax.plot(*zip(*pts), **styles[m])
        full = [c["score"] for c in cs if c["method"] == REFERENCE]
        if full:
            ax.axhline(full[0], label=REFERENCE, **REFERENCE_STYLE)
        ax.set_xlim(0, 1.05)
        if t not in LOWER_IS_BETTER:
            ax.set_ylim(-0.05, 1.08)  # room for the widest marker at 0 and 1
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("keep", fontsize=8)
        ax.set_ylabel("perplexity (lower is better)" if t == "ppl" else "score", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    # one legend for every panel: every method, whichever panels it has points in
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], **styles[m]) for m in methods]
    if any(c["method"] == REFERENCE and c["length"] == length for c in cells):
        handles.append(Line2D([], [], label=REFERENCE, **REFERENCE_STYLE))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"score vs KV budget, {length} tokens", fontsize=10)
    return fig


def _merged(series: dict[str, list[tuple[float, float]]], rel: float = 0.01) -> dict[str, list[tuple[float, float]]]:
    """Series whose points lie within ``rel`` of each other (same budgets, values within 1%) drawn
    once, labelled with every name that has them ("h2o, snapkv"): methods that hold the same bytes
    at each budget would otherwise be one line hidden under another. The first series of a group is
    the one drawn."""
    groups: list[tuple[list[tuple[float, float]], list[str]]] = []
    for name, pts in series.items():
        for first, names in groups:
            if [x for x, _ in first] == [x for x, _ in pts] and all(
                    abs(a - b) <= rel * max(abs(a), abs(b)) for (_, a), (_, b) in zip(first, pts)):
                names.append(name)
                break
        else:
            groups.append((pts, [name]))
    return {", ".join(names): pts for pts, names in groups}


def kv_time_figure(cells: list[dict], lengths: list[int], methods: list[str]):
    """Resident KV vs budget, prefill time and decode time vs length (see :func:`plot`)."""
    import matplotlib.pyplot as plt

    styles = line_styles(methods)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    keeps = sorted({c["keep"] for c in cells if c["keep"] is not None})
    pick = keeps[len(keeps) // 2] if keeps else None
    alone = any(c.get("decode_ms") is not None for c in cells)
    dkey = "decode_ms" if alone else "decode_ms_any"
    for n in lengths:  # resident KV: series within 1% (the same bytes at each budget) merged into one line
        series: dict[str, list[tuple[float, float]]] = {}
        for m in [REFERENCE, *methods]:
            by_keep = defaultdict(list)
            for c in cells:  # a method with its own fixed budget (keep null) has no place on the keep axis
                if c["method"] == m and c["length"] == n and (m == REFERENCE or c["keep"] is not None):
                    by_keep[c["keep"] if c["keep"] is not None else 1.0].append(c["kv_bytes"] / 2**20)
            if by_keep:
                series[m] = sorted((k, statistics.fmean(v)) for k, v in by_keep.items())
        for label, pts in _merged(series).items():
            names = label.split(", ")
            # a group takes its first method's style: groups close to each other still nest (line_styles)
            style = (dict(REFERENCE_STYLE, linestyle="none", marker="o", markersize=6) if names == [REFERENCE]
                     else styles[names[0]])
            style = {**style, "label": f"{label} {n}",
                     "linestyle": style.get("linestyle", "-") if n == lengths[-1] else ":"}
            axes[0].plot(*zip(*pts), **style)
    for ax, key in ((axes[1], "prefill_s"), (axes[2], dkey)):
        for m in [REFERENCE, *methods]:
            # the middle keep, or a method's own fixed budget (keep null: snapkv:max_tokens=512), named as written
            own = all(c["keep"] is None for c in cells if c["method"] == m)
            pts = []
            for n in lengths:
                ys = [c[key] for c in cells if c["method"] == m and c["length"] == n and c.get(key) is not None
                      and (own or c["keep"] == pick)]
                if ys:
                    pts.append((n, statistics.median(ys)))
            if pts:  # measured times are never merged: close ones show as nested lines and rings
                style = dict(REFERENCE_STYLE, marker="o") if m == REFERENCE else styles[m]
                ax.plot(*zip(*pts), **{**style, "label": m if own else f"{m} @{pick:g}"})
    axes[0].set_xlim(0, 1.05)
    axes[0].set_ylim(bottom=0)
    axes[0].set(xlabel="keep (full cache at 1)", ylabel="KV MiB", title="resident KV vs budget")
    axes[1].set(xlabel="prompt tokens", ylabel="s", title="prefill time (median)")
    missing = [n for n in lengths if not any(c.get(dkey) is not None for c in cells if c["length"] == n)]
    axes[2].set(xlabel="prompt tokens", ylabel="ms / token",
                title=("decode ms/token (median, decoded alone)" if alone else "decode ms/token (batch rows' share)")
                + (f"\nnone decoded alone at {', '.join(map(str, missing))}" if missing else ""))
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.title.set_fontsize(9)
    if lengths:  # the two time panels share the length axis, wide enough for one length or many
        lo, hi = min(lengths), max(lengths)
        for ax in axes[1:]:
            ax.set_xlim(lo - 0.25 * max(hi - lo, lo), hi + 0.25 * max(hi - lo, lo))
            ax.set_ylim(bottom=0)
    # legends where they cover no line: matplotlib's "best" place, inside the axes
    axes[0].legend(fontsize=6, loc="best")
    axes[1].legend(fontsize=7, loc="best")
    axes[2].legend(fontsize=7, loc="best")
    return fig


def plot(cells: list[dict], out_dir: Path, prefill: str = "dense") -> list[Path]:
    """score_vs_keep_<length>.png per length and kv_and_time.png; the keep axis always spans 0-1 and 0-1 scores
    keep their 0-1 axis, so one budget or many read the same (a single budget is not zoomed into a sliver).
    No method's line can hide another's (:func:`line_styles`; identical KV series are one line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [c for c in cells if c["prefill"] == prefill]
    paths = []
    lengths = sorted({c["length"] for c in sel})
    tasks = list(dict.fromkeys(c["task"] for c in sel))
    methods = [m for m in dict.fromkeys(c["method"] for c in sel) if m != REFERENCE]
    for n in lengths:
        fig = score_figure(sel, n, tasks, methods)
        p = out_dir / f"score_vs_keep_{n}.png"
        write_atomic(p, functools.partial(fig.savefig, format="png", dpi=110))
        plt.close(fig)
        paths.append(p)
    fig = kv_time_figure(sel, lengths, methods)
    p = out_dir / "kv_and_time.png"
    write_atomic(p, functools.partial(fig.savefig, format="png", dpi=110))
    plt.close(fig)
    paths.append(p)
    return paths


# ----------------------------------------------------------------------------- report
def load_dirs(dirs: list[str], strict: bool = True, *, pool: bool = False) -> list[dict]:
    """The result lines of the eval directories ``dirs`` (``DIR/runs/*.jsonl``, else ``DIR/*.jsonl``).

    A corrupted line (see :func:`kvtrim.eval.store.scan_lines`) is never used silently: with
    ``strict`` (what ``kvtrim report`` does) the lines are refused with a
    :class:`kvtrim.errors.CorruptResultsError` naming each ``file:line`` (its ``bad`` lists them all) (a report from partial data would look complete); without, each one is logged as
    a warning with its ``file:line`` and left out.

    Several directories are pooled only where that is right (:func:`kvtrim.eval.store.check_pool`):
    one directory named twice, two directories that fill the same cell with another model or task
    configuration, or with the same samples, are refused unless ``pool`` (``--pool``), which pools
    them anyway with a warning each."""
    from kvtrim.eval.store import check_pool, describe_bad, read_lines, result_files, scan_lines

    per_dir: list[list[dict]] = []
    bad: list = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise KVTrimError(f"{d!r} is not a directory of kvtrim eval results")
        files = result_files(p) or sorted(p.glob("*.jsonl"))
        if not files:
            raise KVTrimError(f"{d!r} holds no result lines (runs/*.jsonl); run `kvtrim eval ... --out {d}` first")
        if strict:
            rows, problems = scan_lines(files)
            per_dir.append(rows)
            bad += problems
        else:
            per_dir.append(read_lines(files))
    if bad:
        raise CorruptResultsError(
            f"{len(bad)} corrupted result line{'s' if len(bad) > 1 else ''}: {describe_bad(bad)}; nothing reported. "
            f"Rerun the `kvtrim eval` that wrote {'them' if len(bad) > 1 else 'it'} (it moves corrupted lines into "
            f"FILE.corrupt and recomputes them) or remove {'them' if len(bad) > 1 else 'it'} by hand",
            [(str(p), no, problem) for p, no, problem, _ in bad],
        )
    lines = [r for rows in per_dir for r in rows]
    if not lines:
        raise KVTrimError(f"no result lines in {', '.join(dirs)}")
    if len(dirs) > 1:
        check_pool(dirs, per_dir, allow=pool)
    return lines


def pooled_label(dirs: list[str]) -> str:
    """What a report pools, for its header: each directory with its model and task configuration."""
    from kvtrim.eval.store import describe_identity, dir_identity

    return "; ".join(f"{d} ({describe_identity(dir_identity(d))})" for d in dirs)


def render(summary: dict, image_dir: str | None = None) -> str:
    cells = summary["cells"]
    parts = []
    for prefill in dict.fromkeys(c["prefill"] for c in cells):
        for n in sorted({c["length"] for c in cells if c["prefill"] == prefill}):
            parts.append(f"#### Score by task, {n} tokens" + ("" if prefill == "dense" else f", prefill {prefill}"))
            parts.append(score_table(cells, n, prefill))
        parts.append("#### Memory and time" + ("" if prefill == "dense" else f", prefill {prefill}"))
        parts.append(cost_table(cells, prefill))
    if image_dir is not None:
        lengths = sorted({c["length"] for c in cells if c["prefill"] == "dense"})
        parts.append("\n".join(f"![score vs budget, {n} tokens]({image_dir}/score_vs_keep_{n}.png)" for n in lengths)
                     + f"\n![KV bytes and time]({image_dir}/kv_and_time.png)")
    return "\n\n".join(parts) + "\n"


def write_report(dirs: list[str], out_dir: str | None = None, readme: str | None = None, plots: bool = True,
                 image_prefix: str | None = None, source_label: str | None = None, pool: bool = False) -> dict:
    """Summarize ``dirs``, write ``report.md`` (+ PNGs) into ``out_dir`` (default: the first dir); optionally
    replace the report block of ``readme`` (its image links start with ``image_prefix``; report.md's point
    at the PNGs beside it). ``source_label`` names the sources in report.md (default: each directory
    with its model and task configuration, :func:`pooled_label`); ``pool`` as in :func:`load_dirs`.
    Returns the summary."""
    lines = load_dirs(dirs, pool=pool)
    summary = summarize(lines)
    target = Path(out_dir or dirs[0])
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTrimError(f"cannot write the report to {str(target)!r}: {e.strerror or e}") from None
    if plots:
        plot(summary["cells"], target)
    md = render(summary, "." if plots else None)
    write_atomic(target / "report.md", f"# kvtrim eval report\n\nFrom {summary['n_lines']} result lines in "
                                       f"{source_label or pooled_label(dirs)}.\n\n" + md)
    if readme is not None:
        replace_block(Path(readme), render(summary, image_prefix if plots else None))
    return summary


def replace_block(path: Path, body: str) -> None:
    """Replace the report block of the markdown file ``path`` with ``body`` (read and written through
    :mod:`kvtrim.files`: a regular file, replaced atomically, never through a symbolic link)."""
    text = read_text(path, "--readme")
    if START not in text or END not in text:
        raise KVTrimError(f"{path} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    write_atomic(path, head + START + "\n" + body + END + tail)


def summary_json(dirs: list[str], pool: bool = False) -> str:
    return json.dumps(summarize(load_dirs(dirs, pool=pool)), indent=1)
