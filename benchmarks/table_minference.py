"""Markdown tables for docs/minference.md and the README from the committed MInference JSON files.

    python benchmarks/table_minference.py [--prefill benchmarks/results/minference_prefill.json [MORE.json ...]]
                                          [--quality benchmarks/results/minference_quality.json]

Each prefill file gets its own table (e.g. the full sweep, then a rerun of some lengths with more
repetitions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def prefill_table(d: dict) -> str:
    m = d["machine"]
    lines = [
        f"SmolLM2-135M-Instruct, float32, torch {d['versions']['torch']}, {m.get('torch_threads')} threads, {d['date'][:10]}; "
        "median wall seconds of one prefill forward (reps per row), configurations interleaved"
        + ("; every forward in its own process." if d.get("isolated") else "."),
        "",
        "| length | prefill | density | wall s | speed-up | CPU s | attention s (kernel) | attention speed-up | 1/density | estimation share | reps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["records"]:
        sp = f"{r['speedup_wall']:.2f}x" if "speedup_wall" in r else ""
        asp = f"{r['speedup_attention']:.2f}x" if r.get("speedup_attention") else ""
        ideal = f"{r['ideal_attention_speedup']:.1f}" if "ideal_attention_speedup" in r else ""
        lines.append(
            f"| {r['length']} | {r['config']} | {r['density']:.3f} | {r['wall_seconds']:.2f} | {sp} | {r['cpu_seconds']:.1f} | "
            f"{r['attention_seconds']:.2f} | {asp} | {ideal} | {r['estimate_fraction']:.1%} | {r['reps']} |"
        )
    if d.get("summary"):
        lines.append("")
        for name, s in d["summary"].items():
            measured = sorted({r["length"] for r in d["records"] if r["config"] == name})
            lines.append(f"- `{name}`: smallest measured length that beats dense end to end: "
                         f"{s['crossover_length'] or 'none'} (measured: {', '.join(map(str, measured))})")
    return "\n".join(lines)


def quality_table(d: dict) -> str:
    s = d["summary"]
    lengths = sorted({r["length"] for r in d["rows"] if r["kind"] == "passkey"})
    head = "| prefill | " + " | ".join(f"pass key {n}" for n in lengths) + " | pass key all | vs dense | ppl 4k (vs dense) | ppl 8k (vs dense) | mean density |"
    lines = [head, "|---|" + "---:|" * (len(lengths) + 5)]
    for name, v in s.items():
        cells = []
        for n in lengths:
            rr = [r for r in d["rows"] if r["kind"] == "passkey" and r["prefill"] == name and r["length"] == n]
            cells.append(f"{sum(r['correct'] for r in rr)}/{len(rr)}")
        ppl = []
        for n in ("4096", "8000"):
            if n in v["perplexity"]:
                ppl.append(f"{v['perplexity'][n]:.3f} ({v['perplexity_vs_dense'][n] - 1:+.2%}, density {v['ppl_density'][n]:.2f})")
            else:
                ppl.append("")
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {v['passkey_correct']}/{v['passkey_samples']} | {v['passkey_vs_dense']:.0%} | "
            + " | ".join(ppl) + f" | {v['mean_density']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", nargs="+", default=["benchmarks/results/minference_prefill.json"])
    p.add_argument("--quality", default="benchmarks/results/minference_quality.json")
    a = p.parse_args(argv)
    for path in a.prefill:
        if Path(path).is_file():
            print(prefill_table(json.loads(Path(path).read_text())))
            print()
    if Path(a.quality).is_file():
        print(quality_table(json.loads(Path(a.quality).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
