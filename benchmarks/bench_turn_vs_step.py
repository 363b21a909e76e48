"""Per-turn eviction (inf_mllm) vs per-step eviction (h2o): time per generated token, side by side.

Same prompt, same budget; each repetition runs every method once (``kvtrim.generate_ids``), in a
rotating order (interleaved by :mod:`kvtrim.harness`, after one warm-up round), and the median
per-token decode time over repetitions is reported. ``full`` and
``streaming_llm`` are timed too for reference. inf_mllm evicts once at the prompt and appends
decoded tokens (up to ``decode_cap``); h2o scores and evicts at every decoded token.

    nice -n 10 python benchmarks/bench_turn_vs_step.py --prompt-tokens 2048 --budget 512 --new 32 --reps 5 \\
        --out results/turn_vs_step.json                                   # writes results/turn_vs_step.json
    python benchmarks/bench_turn_vs_step.py --table benchmarks/results/turn_vs_step.json   # its table in docs/results.md

The JSON is rewritten after every repetition, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from kvtrim import harness


def table(r: dict) -> str:
    """Markdown table of a turn-vs-step result."""
    lines = [f"Prompt {r['prompt_tokens']} tokens, budget {r['budget']}, {r['new_tokens']} new tokens, median of {r['reps']} "
             f"interleaved repetitions (load average {r['info']['loadavg_start'][0]:.1f} at the start).", "",
             "| method | decode ms/token (median) | runs (ms/token) | prefill s (median) |", "|---|---:|---|---:|"]
    for n, med in r["median_ms_per_token"].items():
        runs = r["runs"][n]
        pre = statistics.median(x["prefill_seconds"] for x in runs)
        ms = ", ".join(f"{x['ms_per_token']:.0f}" for x in runs)
        lines.append(f"| {n} | {med:.1f} | {ms} | {pre:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=5, warmup=1)])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--methods", default="inf_mllm,h2o,streaming_llm,full")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0

    from kvtrim.data import pydoc_text
    from kvtrim.generation import generate_ids
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    info = harness.machine_record()
    lm = load_model(None)
    ids = lm.tokenizer(pydoc_text(), add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    names = args.methods.split(",")
    raw: dict[str, list[dict]] = {n: [] for n in names}

    def one(n: str, rep: int) -> dict:
        pol = create_policy(n, **({} if n == "full" else {"max_tokens": args.budget}))
        r = generate_ids(lm.model, lm.tokenizer, ids, pol, max_new_tokens=args.new, stop_at_eos=False)
        ms = 1000 * r.decode_seconds / r.decode_steps
        print(f"rep {rep} {n}: {ms:.1f} ms/token (prefill {r.prefill_seconds:.1f}s)", file=sys.stderr, flush=True)
        return {"ms_per_token": ms, "prefill_seconds": r.prefill_seconds, "stored": r.stored_tokens,
                "kv_bytes": r.kv_bytes, "loadavg1": os.getloadavg()[0]}

    def save(sample: harness.Sample) -> None:  # rewritten after every round: a run cut short keeps what it measured
        raw[sample.config].append(sample.value)
        if sample.config != harness.order(names, sample.rep + args.warmup, "rotate")[-1]:
            return
        med = {n: statistics.median(x["ms_per_token"] for x in v) for n, v in raw.items() if v}
        result = {"benchmark": "turn_vs_step", "model": lm.source, "dtype": "float32", "info": harness.finish_record(info),
                  "prompt_tokens": len(ids), "budget": args.budget, "new_tokens": args.new, "reps": sample.rep + 1,
                  "reps_requested": args.reps, "median_ms_per_token": med, "runs": raw,
                  "speedup_inf_mllm_over_h2o": med["h2o"] / med["inf_mllm"] if "h2o" in med and "inf_mllm" in med else None}
        harness.write_json(args.out, result)

    harness.interleave(names, one, reps=args.reps, warmup=args.warmup, how="rotate", on_sample=save)
    print(table(harness.read_result(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
