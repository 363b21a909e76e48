"""Quality in bfloat16 against float32: two ``kvtrim eval`` directories of one plan, side by side.

The sweeps are made with ``kvtrim eval ... --dtype float32 --out A`` and ``... --dtype bfloat16 --out B``
(same tasks, lengths, methods, budgets, samples). This script pairs their result lines by (task,
length, sample, method, budget) and writes, per cell, each dtype's mean score over the samples
both hold (accuracy for the needle tasks, perplexity for ``ppl``), how many answers differ, and the
largest per-sample perplexity ratio; ``--table FILE`` prints the markdown table. Example::

    python benchmarks/dtype_quality.py --dirs benchmarks/results/bf16_quality/float32 \\
        benchmarks/results/bf16_quality/bfloat16 --out benchmarks/results/bf16_quality/quality.json
    python benchmarks/dtype_quality.py --table benchmarks/results/bf16_quality/quality.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvtrim import harness


def _lines(d: Path) -> dict[tuple, dict]:
    from kvtrim.eval.store import read_lines, result_files

    return {(r["task"], r["length"], r["sample"], r["method"], r["keep"]): r for r in read_lines(result_files(d))}


def _dtype(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    return str(cfg.get("dtype", "float32"))


def compare(a: Path, b: Path) -> dict:
    la, lb = _lines(a), _lines(b)
    da, db = _dtype(a), _dtype(b)
    cells: dict[tuple, list[tuple[dict, dict]]] = {}
    for key in sorted(set(la) & set(lb), key=str):
        cells.setdefault((key[0], key[1], key[3], key[4]), []).append((la[key], lb[key]))
    rows = []
    for (task, length, method, keep), pairs in sorted(cells.items(), key=str):
        row = {"task": task, "length": length, "method": method, "keep": keep, "n": len(pairs),
               da: statistics.mean(p[0]["score"] for p in pairs), db: statistics.mean(p[1]["score"] for p in pairs),
               "answers_differ": sum(p[0].get("answer") != p[1].get("answer") for p in pairs)}
        if task == "ppl":
            row["max_ppl_ratio"] = max(p[1]["score"] / p[0]["score"] for p in pairs)
        row["kv_bytes_" + da] = statistics.mean(p[0]["kv_bytes"] for p in pairs)
        row["kv_bytes_" + db] = statistics.mean(p[1]["kv_bytes"] for p in pairs)
        rows.append(row)
    missing = {da: len(set(la) - set(lb)), db: len(set(lb) - set(la))}
    return {"dtypes": [da, db], "dirs": [str(a), str(b)], "rows": rows, "unpaired_lines": missing}


def table(result: dict) -> str:
    da, db = result["dtypes"]
    lines = [f"| task | method | samples | {da} | {db} | answers differ | KV MiB {da} | KV MiB {db} |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        label = r["method"] if r["keep"] is None else f"{r['method']} @{r['keep']:g}"
        fmt = (lambda x: f"{x:.2f}") if r["task"] == "ppl" else (lambda x: f"{x:.0%}")
        lines.append(f"| {r['task']} {r['length']} | {label} | {r['n']} | {fmt(r[da])} | {fmt(r[db])} | "
                     f"{r['answers_differ'] if r['task'] != 'ppl' else '—'} | {r['kv_bytes_' + da] / 2**20:.1f} | "
                     f"{r['kv_bytes_' + db] / 2**20:.1f} |")
    lines.append(f"\nScores over the samples both sweeps hold (needle tasks: share correct; ppl: mean perplexity); "
                 f"lines without a partner: {result['unpaired_lines']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    p.add_argument("--dirs", nargs=2, metavar="DIR", help="the two kvtrim eval directories (e.g. float32, then bfloat16)")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    if not args.dirs:
        p.error("--dirs A B is required")
    result = compare(Path(args.dirs[0]), Path(args.dirs[1]))
    result["command"] = " ".join([sys.executable, *sys.argv])
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
