"""The time cost of trimming the heap after every module in a chunked prefill.

``kvtrim.generate_ids`` with ``prefill_chunk`` calls glibc's ``malloc_trim(0)`` after the forward of
every module while it prefills (``kvtrim.machine.heap_trimmed_per_module``), which is what keeps a
chunked prefill's resident memory near what is alive (docs/memory.md, "The allocator"). This
benchmark times the same chunked prefill with the trimming (``on``, what ``generate`` does) and
without it (``off``: the per-module hooks are not installed; the trim between chunks stays), in one
process, interleaved, after a warm-up round. The prompt and the model loading are
``bench_prefill_memory.py``'s, so the seconds sit beside its memory tables.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_heap_trim.py --model qwen2.5-0.5b \\
        --length 8192 --chunk 2048 --reps 3 --threads 2 --out results/prefill_memory/heap_trim_time.json
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

from kvtrim import harness

CONFIGS = ("on", "off")


def table(res: dict) -> str:
    s = res["setting"]
    lines = [f"{res['model']}, float32, {s['length']} tokens in chunks of {s['chunk']}, {s['method']} keep {s['keep']}; "
             f"{harness.machine_line(res['machine'], s['threads'])}; median of {s['reps']} interleaved rounds after "
             f"{s['warmup']} warm-up round(s).",
             "",
             "| per-module heap trimming | prefill s (median) | min | max | trims per prefill |",
             "|---|---:|---:|---:|---:|"]
    for name in CONFIGS:
        r = res["results"][name]
        lines.append(f"| {name} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} | {r['trims']} |")
    lines += ["", f"Trimming on / off, ratio of medians: {res['ratio_on_over_off']:.3f}."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                parents=[harness.options(reps=3, warmup=1, threads=2)])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--method", default="snapkv")
    p.add_argument("--keep", type=float, default=0.1)
    args = p.parse_args()
    if harness.start(p, args, table=table):
        return 0
    if args.chunk < 2 or args.length <= args.chunk:
        p.error("--length must be longer than --chunk, and --chunk at least 2")

    from bench_minference_prefill import scale_rope
    from bench_prefill_memory import prompt_ids

    import kvtrim.generation as generation
    import kvtrim.machine as machine
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    machine_rec = harness.machine_record()
    lm = load_model(args.model)
    model = lm.model
    scale_rope(model, args.length, int(model.config.max_position_embeddings))
    ids = prompt_ids(lm.tokenizer, args.length)
    trimmed = generation.heap_trimmed_per_module
    if machine._malloc_trim() is None:
        p.error("this system has no glibc malloc_trim: the trimming is a no-op here, nothing to measure")
    trims = {"n": 0}

    @contextlib.contextmanager
    def counted_trims(m):  # generate's own per-module trimming, keeping the count it yields
        with trimmed(m) as count:
            yield count
        trims["n"] = count.trims

    def run(name: str, rep: int) -> dict:
        trims["n"] = 0
        generation.heap_trimmed_per_module = counted_trims if name == "on" else (lambda m: contextlib.nullcontext())
        try:
            policy = create_policy(args.method, keep=args.keep)
            res = generation.generate_ids(model, lm.tokenizer, ids, policy, max_new_tokens=0, prefill_chunk=args.chunk)
        finally:
            generation.heap_trimmed_per_module = trimmed
        print(f"[{time.strftime('%H:%M:%S')}] {name} rep {rep}: {res.prefill_seconds:.2f} s, {trims['n']} trims",
              flush=True)
        return {"prefill_seconds": res.prefill_seconds, "trims": trims["n"], "stored_tokens": res.stored_tokens}

    samples = harness.interleave(CONFIGS, run, reps=args.reps, warmup=args.warmup)
    results = {}
    for name, ss in samples.items():
        st = harness.stats(ss, key="prefill_seconds")
        results[name] = {k: st[k] for k in ("median", "min", "max", "all")} | {"trims": ss[0].value["trims"]}
    out = {"benchmark": "bench_heap_trim", "model": args.model,
           "setting": {k: getattr(args, k) for k in ("length", "chunk", "method", "keep", "reps", "warmup", "threads")},
           "machine": harness.finish_record(machine_rec), "results": results,
           "ratio_on_over_off": results["on"]["median"] / results["off"]["median"]}
    harness.write_json(args.out, out)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
