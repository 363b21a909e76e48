"""Throughput of batch > 1 (``kvtrim.generate_batch``): 1, 2, 4 and 8 prompts generated together.

For each method (``full`` and ``snapkv@0.25`` by default) and each row count B, ``generate_batch``
runs the first B of 8 prompts of different lengths (512 to 1024 tokens of prose, raw text, each a
different passage) with ``--new`` new tokens each (EOS ignored, so every row generates exactly
that many): every prompt is prefilled alone, then the B rows decode together, one forward per step.
Reported per configuration (medians over ``--reps`` interleaved repetitions after ``--warmup``):
the wall time, the total new tokens per second (B x new / wall, prefill included), the decode-only
throughput (B x new / decode seconds), and the speed-up of both over B = 1. After the timing, each
row's tokens are compared with its own batch-1 ``generate_ids`` run (``rows_equal_batch1``).

    python benchmarks/bench_batch.py --threads 1 --out benchmarks/results/batch/bench_batch.json   # the committed run
    python benchmarks/bench_batch.py --table benchmarks/results/batch/bench_batch.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvtrim import harness
from kvtrim.data import prose_haystack
from kvtrim.generation import generate_batch, generate_ids
from kvtrim.models import load_model
from kvtrim.registry import create_policy

#: prompt lengths in tokens, in row order (row b of a B-row batch is prompt b)
LENGTHS = (512, 1024, 640, 896, 768, 576, 960, 704)


def table(d: dict) -> str:
    m = d["machine"]

    def load(x):
        return "/".join(f"{v:.1f}" for v in x) if x else "?"

    lines = [f"{d['model']}, {d['dtype']}, torch {m.get('torch')}, {m.get('torch_threads', m.get('threads'))} thread(s), "
             f"{d['date'][:10]}, load average (1/5/15 min) {load(m.get('loadavg_start'))} at the start, "
             f"{load(m.get('loadavg_end'))} at the end on {m.get('cpus')} CPUs; prompts of "
             f"{', '.join(map(str, d['lengths']))} tokens, {d['args']['new']} new tokens per row; medians of "
             f"{d['args']['reps']} repetition(s).\n",
             "| method | rows | wall s | new tok/s total | vs 1 row | decode tok/s | vs 1 row | rows equal batch 1 |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['method']} | {r['rows']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['decode_tokens_per_s']:.1f} | {r['decode_speedup']:.2f}x | {r['rows_equal_batch1']} |")
    return "\n".join(lines)


def policy(spec: str):
    name, _, keep = spec.partition("@")
    return create_policy(name, **({"keep": float(keep)} if keep else {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=3, warmup=1, threads=1)])
    ap.add_argument("--methods", default="full,snapkv@0.25", help="comma-separated METHOD[@KEEP] (default full,snapkv@0.25)")
    ap.add_argument("--rows", default="1,2,4,8", help="row counts (default 1,2,4,8; at most 8)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per row (default 32)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    row_counts = [int(x) for x in args.rows.split(",")]
    if not all(1 <= b <= len(LENGTHS) for b in row_counts):
        ap.error(f"--rows must be between 1 and {len(LENGTHS)}")
    methods = args.methods.split(",")
    for spec in methods:
        policy(spec)  # validate before the model loads
    torch.manual_seed(0)
    machine = harness.machine_record()
    lm = load_model()
    hay = lm.tokenizer(prose_haystack()[:120000], add_special_tokens=False)["input_ids"]
    prompts, start = [], 0
    for n in LENGTHS:
        prompts.append(hay[start:start + n])
        start += n
    configs = [f"{spec}/{b}" for spec in methods for b in row_counts]

    def run(config: str, rep: int) -> dict:
        spec, _, b = config.rpartition("/")
        res = generate_batch(lm.model, lm.tokenizer, prompts[: int(b)], policy(spec), max_new_tokens=args.new,
                             stop_at_eos=False)
        return {"prefill_s": sum(r.prefill_seconds for r in res), "decode_s": sum(r.decode_seconds for r in res),
                "new_tokens": sum(r.new_tokens for r in res), "tokens": [r.token_ids for r in res],
                "kv_bytes": sum(r.kv_bytes for r in res), "decode_rows": max(r.decode_rows for r in res)}

    samples = harness.interleave(configs, run, reps=args.reps, warmup=args.warmup,
                                 on_sample=lambda s: print(f"{s.config} rep {s.rep}: {s.seconds:.2f}s", file=sys.stderr, flush=True))
    reference = {}
    for spec in methods:
        for i in range(max(row_counts)):
            reference[(spec, i)] = generate_ids(lm.model, lm.tokenizer, prompts[i], policy(spec), max_new_tokens=args.new,
                                                stop_at_eos=False).token_ids
    rows = []
    for config in configs:
        spec, _, b = config.rpartition("/")
        ss = samples[config]
        wall = harness.stats(ss)
        decode = harness.stats(ss, "decode_s")
        new = ss[0].value["new_tokens"]
        last = ss[-1].value
        rows.append({
            "method": spec, "rows": int(b), "prompt_tokens": sum(len(p) for p in prompts[: int(b)]), "new_tokens": new,
            "wall_s": wall["median"], "wall_all": wall["all"], "prefill_s": harness.median(ss, "prefill_s"),
            "decode_s": decode["median"], "tokens_per_s": new / wall["median"], "decode_tokens_per_s": new / decode["median"],
            "kv_bytes": last["kv_bytes"], "decode_rows": last["decode_rows"],
            "rows_equal_batch1": all(t == reference[(spec, i)] for i, t in enumerate(last["tokens"])),
        })
    for r in rows:
        one = next(x for x in rows if x["method"] == r["method"] and x["rows"] == min(row_counts))
        r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"]
        r["decode_speedup"] = r["decode_tokens_per_s"] / one["decode_tokens_per_s"]
    result = {
        "benchmark": "batch",
        "command": "python benchmarks/bench_batch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": machine["date"],
        "machine": harness.finish_record(machine),
        "model": lm.source,
        "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        "lengths": list(LENGTHS[: max(row_counts)]),
        "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")},
        "rows": rows,
    }
    harness.write_json(args.out, result)
    print(table(result))
    print(json.dumps({"equal": all(r["rows_equal_batch1"] for r in rows)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
