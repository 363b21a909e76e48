"""Per-head budgets against uniform ones at the same stored tokens: decode-step time and KV bytes.

SnapKV with ``heads=uniform`` (every KV head of a layer keeps ``budget`` tokens, one rectangular
buffer per layer) and with ``heads=adaptive`` (the layer's ``H * budget`` shared unevenly by its KV
heads, one buffer per head, attention one SDPA call per KV head: ``kvtrim.ragged_storage``) on the
same prompt: the prose haystack cut to ``--length`` tokens. The prompt's forward runs once
(``kvtrim.eval.replay.record_prefill``); each run replays a fresh cache of either configuration from
it and times ``--steps`` greedy decode steps, the configurations alternating within each of
``--reps`` rounds (:func:`kvtrim.harness.interleave`). Reported per keep: the median (and min / max)
step time of each, the stored bytes (keys and values, no spare capacity: equal by construction),
the resident bytes (allocated, with each buffer's slack: one slack per head under ``adaptive``) and
the spread of the heads' counts (min / max over every layer and head).

    python benchmarks/bench_head_budgets.py --threads 1 --out benchmarks/results/head_budgets/decode.json
    python benchmarks/bench_head_budgets.py --table benchmarks/results/head_budgets/decode.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvtrim import decoding, harness
from kvtrim.data import prose_haystack
from kvtrim.eval.replay import record_prefill, replay
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy

CONFIGS = ("uniform", "adaptive")


def table(d: dict) -> str:
    lines = [harness.machine_line(d["machine"], d["args"]["threads"]) + f"; {d['model']}, float32, prompt of "
             f"{d['prompt_tokens']} tokens, median (min-max) of {d['args']['steps']} decode steps x "
             f"{d['args']['reps']} interleaved rounds.\n",
             "| keep | heads | ms/step | stored KV bytes | resident KV bytes | tokens per head (min-max) |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['keep']} | {r['heads']} | {r['ms_median']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) | "
                     f"{r['kv_bytes_stored']:,} | {r['kv_bytes']:,} | {r['head_min']}-{r['head_max']} |")
    return "\n".join(lines)


def counts(cache) -> list[int]:
    """Tokens stored by every KV head of every compressed layer."""
    out: list[int] = []
    for layer in cache.compressed_layers:
        out += list(layer.head_lengths or (layer.length,) * cache.num_kv_heads)
    return out


@torch.inference_mode()
def run_one(model, recording, logits, heads: str, keep: float, steps: int, warmup: int) -> dict:
    cache = replay(model, create_policy("snapkv", keep=keep, heads=heads), recording)
    at_start = {"kv_bytes_stored": cache.kv_bytes_stored(), "kv_bytes": cache.kv_bytes(), "heads": counts(cache)}
    times: list[float] = []
    decoding.run(model, decoding.decode(cache, logits, steps + warmup + 1), on_step=lambda step, s: times.append(s))
    return {**at_start, "samples": times[warmup:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=3, warmup=4, threads=1,
                                                          warmup_help="decode steps dropped at the start of each run")])
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--keep", default="0.1,0.25", help="budgets, comma-separated")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    lm = load_model()
    ids = lm.tokenizer(prose_haystack())["input_ids"][: args.length]
    recording = record_prefill(lm.model, ids)
    logits = recording.logits
    rows = []
    for keep in [float(x) for x in args.keep.split(",")]:
        def run(heads: str, rep: int, keep=keep) -> dict:
            return run_one(lm.model, recording, logits, heads, keep, args.steps, args.warmup)

        with attach(lm.model):
            samples = harness.interleave(list(CONFIGS), run, reps=args.reps, warmup=0,
                                         on_sample=lambda s: print(s.config, f"{harness.median(s.value['samples']) * 1000:.1f} ms",
                                                                   file=sys.stderr, flush=True))
        for heads in CONFIGS:
            per = [x for s in samples[heads] for x in s.value["samples"]]
            st = harness.stats(per)
            first = samples[heads][0].value
            rows.append({"keep": keep, "heads": heads, "ms_median": 1000 * st["median"], "ms_min": 1000 * st["min"],
                         "ms_max": 1000 * st["max"], "kv_bytes_stored": first["kv_bytes_stored"],
                         "kv_bytes": first["kv_bytes"], "stored_tokens": sum(first["heads"]),
                         "head_min": min(first["heads"]), "head_max": max(first["heads"])})
    result = {"benchmark": "head_budgets", "date": machine["date"], "machine": harness.finish_record(machine),
              "model": lm.source, "prompt_tokens": len(ids),
              "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")}, "rows": rows}
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
