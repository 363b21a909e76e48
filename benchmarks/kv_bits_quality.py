"""Quality of the low-bit KV cache on the reference model, against issue 46's targets, as tables.

The measurements are ``kvtrim eval`` sweeps (each sample scored at every bit width against the full
cache at 16 bits, docs/eval.md); this script renders their ``summary.json`` and checks the targets:

- the full cache's perplexity on held-out prose at 8 and 4 bits, against 16 bits (targets: within
  +0.5% at 8 bits, +3% at 4 bits)::

    .venv/bin/kvtrim eval ppl --model qwen2.5-0.5b --methods full --kv-bits 16,8,4,2 \\
        --length 4096 --samples 10 --threads 1 --out benchmarks/results/kv_bits_quality/qwen_ppl4k

- equal resident bytes: keep 0.5 at 4 bits against keep 0.125 at 16 bits for ``snapkv`` and
  ``inf_mllm`` on the needle tasks and the multi-turn chat of the reference model's sweep (target:
  at least as good on every task)::

    for shard in 0/2 1/2; do .venv/bin/kvtrim eval passkey,niah_single,niah_multikey,multiturn \\
        --model qwen2.5-0.5b --methods snapkv,inf_mllm --keep 0.125,0.5 --kv-bits 16,4 --length 4096 \\
        --samples 10 --shard $shard --threads 1 --out benchmarks/results/kv_bits_quality/qwen_equal_bytes4k; done

  (the two shards can run side by side; together they are the 10 samples per task of the
  reference model's sweep in docs/results.md, the same samples.)

    .venv/bin/python benchmarks/kv_bits_quality.py --table benchmarks/results/kv_bits_quality/qwen_ppl4k/summary.json
"""

from __future__ import annotations

import argparse
import sys

from kvtrim import harness

PPL_TARGETS = {8: 0.005, 4: 0.03}  # relative perplexity increase allowed over 16 bits
EQUAL_BYTES = ((0.5, 4), (0.125, 16))  # (keep, bits): the low-bit side first


def _bits(cell: dict) -> int:
    return int(cell.get("kv_bits") or 16)


def _method(cell: dict) -> str:
    return cell.get("base_method") or cell["method"]


def _load_line(summary: dict) -> str:
    m = summary.get("machine", {})
    load = m.get("loadavg")
    at = f", load average {load[0]:.1f} at the end" if load else ""
    return f"{m.get('date', '?')}, {m.get('threads', '?')} thread(s), torch {m.get('torch', '?')}{at}"


def ppl_table(summary: dict) -> tuple[str, list[str]]:
    cells = sorted((c for c in summary["cells"] if c["task"] == "ppl" and _method(c) == "full"),
                   key=lambda c: (c["length"], -_bits(c)))
    out = ["| length | kv_bits | resident KV (of 16-bit) | perplexity | vs 16-bit | target | met |",
           "|---:|---:|---:|---:|---:|---|---|"]
    verdicts = []
    for c in cells:
        b = _bits(c)
        rel = c["score"] / c["full_score"] - 1
        target = PPL_TARGETS.get(b)
        met = "-" if target is None else ("yes" if rel <= target else "no")
        out.append(f"| {c['length']} | {b} | {c['kv_frac']:.3f} | {c['score']:.3f} | {rel:+.2%} | "
                   f"{'-' if target is None else f'<= +{target:.1%}'} | {met} |")
        if target is not None:
            verdicts.append(f"{b} bits {rel:+.2%} ({'meets' if rel <= target else 'misses'} +{target:.1%})")
    return "\n".join(out), verdicts


def equal_bytes_table(summary: dict) -> tuple[str, list[str]]:
    by: dict[tuple[str, str, float | None, int], dict] = {}
    for c in summary["cells"]:
        by[(c["task"], _method(c), c.get("keep"), _bits(c))] = c
    tasks = sorted({k[0] for k in by})
    methods = sorted({k[1] for k in by if k[1] != "full"})
    cols = [("full", None, 16), ("full", None, 8), ("full", None, 4)] + [(m, k, b) for m in methods for k, b in EQUAL_BYTES] + \
        [(m, k, b) for m in methods for k, b in ((0.5, 16), (0.125, 4)) if any((t, m, k, b) in by for t in tasks)]
    cols = [c for c in cols if any((t, *c) in by for t in tasks)]
    name = {c: f"{c[0]}" + ("" if c[1] is None else f" keep {c[1]:g}") + f" @{c[2]}" for c in cols}
    out = ["| task | " + " | ".join(name[c] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for t in tasks:
        cell = [by.get((t, *c)) for c in cols]
        out.append(f"| {t} (n={max((x['n'] for x in cell if x), default=0)}) | "
                   + " | ".join("-" if x is None else f"{x['score']:.2f}" for x in cell) + " |")
    fracs = [[by[(t, *c)]["kv_frac"] for t in tasks if (t, *c) in by] for c in cols]
    out.append("| resident KV (of full @16, mean over tasks) | "
               + " | ".join("-" if not f else f"{sum(f) / len(f):.3f}" for f in fracs) + " |")
    verdicts = []
    for m in methods:
        low, high = ((m, *EQUAL_BYTES[0]), (m, *EQUAL_BYTES[1]))
        worse = [t for t in tasks if (t, *low) in by and (t, *high) in by and by[(t, *low)]["score"] < by[(t, *high)]["score"]]
        pairs = [t for t in tasks if (t, *low) in by and (t, *high) in by]
        verdicts.append(f"{m}: keep 0.5 @4 bits at least as good as keep 0.125 @16 on "
                        f"{len(pairs) - len(worse)} of {len(pairs)} tasks" + (f" (behind on {', '.join(worse)})" if worse else ""))
    return "\n".join(out), verdicts


def table(summary: dict) -> str:
    head = _load_line(summary)
    tasks = {c["task"] for c in summary["cells"]}
    parts = [f"{summary.get('dtype', 'float32')} model, {head}", ""]
    verdicts: list[str] = []
    if "ppl" in tasks:
        t, v = ppl_table(summary)
        parts.append(t)
        verdicts += v
    if tasks - {"ppl"}:
        if "ppl" in tasks:
            parts.append("")
        t, v = equal_bytes_table({**summary, "cells": [c for c in summary["cells"] if c["task"] != "ppl"]})
        parts.append(t)
        verdicts += v
    parts += ["", "Measured: " + "; ".join(verdicts) + "."]
    return "\n".join(parts)


def full_bits_table(dirs: list[str]) -> str:
    """The full cache at each bit width against 16 bits, sample by sample, from the result lines of
    ``kvtrim eval`` directories (``--kv-bits 16,8,4`` sweeps): per task the samples, the score at
    each width, and how many samples give the 16-bit answer at that width (target: equal at 8 bits)."""
    from kvtrim.eval.store import line_bits, result_files, scan_lines

    per: dict[tuple[str, int], dict[int, dict[int, dict]]] = {}  # (task, seed) -> bits -> sample -> line
    for d in dirs:
        rows, bad = scan_lines(result_files(d))
        if bad:
            raise SystemExit(f"{d}: {len(bad)} corrupted result lines (first: {bad[0][0]} line {bad[0][1]}, {bad[0][2]})")
        for r in rows:
            if r["method"] == "full" and r["task"] != "ppl":
                per.setdefault((r["task"], int(r["seed"] if "sweep_seed" not in r else r["sweep_seed"])), {}) \
                    .setdefault(line_bits(r), {})[int(r["sample"])] = r
    widths = sorted({b for v in per.values() for b in v if b != 16}, reverse=True)
    out = ["| task (seed) | samples | full @16 | " + " | ".join(f"full @{b} | same answer as @16 at {b} bits" for b in widths)
           + " |", "|---|---:|---:|" + "---:|---:|" * len(widths)]
    equal_at = dict.fromkeys(widths, 0)
    total = 0
    for (task, seed), by_bits in sorted(per.items()):
        ref = by_bits.get(16, {})
        cells = []
        for b in widths:
            got = {s: r for s, r in by_bits.get(b, {}).items() if s in ref}
            same = sum(_answers(r) == _answers(ref[s]) for s, r in got.items())
            equal_at[b] += same
            if not got:
                cells.append("- | -")
                continue
            cells.append(f"{sum(float(r['score']) for r in got.values()) / len(got):.2f} | {same}/{len(got)}")
        n = len(ref)
        total += n
        out.append(f"| {task} ({seed}) | {n} | {sum(float(r['score']) for r in ref.values()) / max(n, 1):.2f} | "
                   + " | ".join(cells) + " |")
    out += ["", "Measured: " + "; ".join(f"{equal_at[b]} of {total} samples give the 16-bit answer at {b} bits"
                                          for b in widths) + "."]
    return "\n".join(out)


def _answers(line: dict) -> list[str]:
    return list(line.get("answers") or [line.get("answer")])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", metavar="SUMMARY", help="a kvtrim eval directory's summary.json")
    ap.add_argument("--full-bits", metavar="DIR", nargs="+",
                    help="kvtrim eval directories: the full cache at each bit width against 16 bits, per sample")
    args = ap.parse_args(argv)
    if bool(args.table) == bool(args.full_bits):
        ap.error("give one of --table and --full-bits")
    print(full_bits_table(args.full_bits) if args.full_bits else table(harness.read_result(args.table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
