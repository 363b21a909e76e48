"""Two checkouts of kvtrim side by side: the same prefill and decode work, interleaved old vs new.

For showing that a change of structure changed no speed: each repetition runs, in a fresh process
per checkout (its ``src/`` first on ``PYTHONPATH``), the prompt's prefill and ``--new`` greedy decode
steps for every method, the two checkouts alternating first from one repetition to the next
(:func:`kvtrim.harness.order`). Reported per method and checkout: the median prefill seconds and
decode milliseconds per token, and the new/old ratios.

    git worktree add /tmp/kvtrim_old b2235d6
    .venv/bin/python benchmarks/bench_ab.py --old /tmp/kvtrim_old/src --new src --threads 2 \\
        --out benchmarks/results/ab/decisions_smollm2.json
    .venv/bin/python benchmarks/bench_ab.py --table benchmarks/results/ab/decisions_smollm2.json

The child uses only the public API both checkouts share (``load_model``, ``KVTrimCache``, ``attach``,
``kvtrim.decoding``); the prompt is a pass-key sample (``kvtrim.eval.make_samples``, seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvtrim import harness


def child(spec: dict) -> dict:
    """One checkout's run: every method's prefill and decode, timed (this process imports that checkout)."""
    import torch

    import kvtrim
    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache
    from kvtrim.eval.programs import prompt_ids
    from kvtrim.eval.tasks import make_samples

    torch.set_num_threads(spec["threads"])
    lm = kvtrim.load_model(spec["model"], dtype=spec["dtype"])
    ids = prompt_ids(lm.tokenizer, make_samples("passkey", lm.tokenizer, spec["length"], 1, seed=0)[0])
    out = {"kvtrim": str(Path(kvtrim.__file__).resolve().parent), "prompt_tokens": len(ids), "methods": {}}
    with torch.inference_mode(), kvtrim.attach(lm.model):
        decoding.run(lm.model, decoding.prefill(KVTrimCache(lm.model, "full"), ids[:128]))  # warm-up
        for method in spec["methods"]:
            params = {} if method == "full" else {"keep": spec["keep"]}
            cache = KVTrimCache(lm.model, kvtrim.create_policy(method, **params))
            t0 = time.perf_counter()
            logits = decoding.run(lm.model, decoding.prefill(cache, ids))
            t1 = time.perf_counter()
            tokens, steps = decoding.run(lm.model, decoding.decode(cache, logits, spec["new"]))
            t2 = time.perf_counter()
            out["methods"][method] = {"prefill_s": t1 - t0, "decode_ms": 1000 * (t2 - t1) / max(steps, 1),
                                      "tokens": tokens}
    return out


def table(result: dict) -> str:
    lines = [harness.machine_line(result["machine"], result["threads"]), "",
             f"{result['model']}, {result['dtype']}, pass-key prompt of {result['prompt_tokens']} tokens, keep "
             f"{result['keep']}, {result['new']} decode steps; old = {result['old_commit'] or result['old']}, "
             f"new = {result['new_commit'] or result['new_src']}; medians of {result['reps']} interleaved repetitions",
             "",
             "| method | prefill s old | prefill s new | new/old | decode ms/token old | decode ms/token new | new/old | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for m, r in result["methods"].items():
        lines.append(f"| {m} | {r['old']['prefill_s']:.2f} | {r['new']['prefill_s']:.2f} | {r['prefill_ratio']:.3f} | "
                     f"{r['old']['decode_ms']:.1f} | {r['new']['decode_ms']:.1f} | {r['decode_ratio']:.3f} | "
                     f"{'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[harness.options(reps=3, warmup=1, warmup_help="discarded rounds first (each checkout builds its native kernels then)")])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--old", help="the older checkout's src/ folder")
    ap.add_argument("--new", dest="new_src", default="src", help="the newer checkout's src/ folder (default src)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", dest="new", type=int, default=32)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--methods", default="full,snapkv,h2o,streaming_llm,inf_mllm,elastic")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.child:
        harness.child_result(child(json.loads(args.child)))
        return 0
    if harness.start(ap, args, table=table):
        return 0
    if not args.old:
        ap.error("--old is required (the older checkout's src/ folder)")
    sides = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new_src).resolve())}
    spec = {"model": args.model, "dtype": args.dtype, "length": args.length, "new": args.new, "keep": args.keep,
            "methods": args.methods.split(","), "threads": args.threads}
    record = harness.machine_record()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rep in range(-args.warmup, args.reps):
        for side in harness.order(["old", "new"], rep):
            env = dict(os.environ, PYTHONPATH=sides[side], OMP_NUM_THREADS=str(args.threads))
            got = harness.isolated(__file__, ["--child", json.dumps(spec)], env=env)
            if Path(got["kvtrim"]) != Path(sides[side]) / "kvtrim":
                raise SystemExit(f"kvtrim: error: the {side} run imported {got['kvtrim']}, not {sides[side]}")
            if rep >= 0:
                runs[side].append(got)
            print(f"{'warm-up' if rep < 0 else f'rep {rep}'} {side}: " + ", ".join(
                f"{m} {v['prefill_s']:.2f}s {v['decode_ms']:.1f}ms" for m, v in got["methods"].items()),
                file=sys.stderr, flush=True)
    methods = {}
    for m in spec["methods"]:
        med = {side: {k: harness.median(r["methods"][m][k] for r in runs[side]) for k in ("prefill_s", "decode_ms")}
               for side in runs}
        methods[m] = {**med, "prefill_ratio": med["new"]["prefill_s"] / med["old"]["prefill_s"],
                      "decode_ratio": med["new"]["decode_ms"] / med["old"]["decode_ms"],
                      "same_tokens": all(r["methods"][m]["tokens"] == runs["old"][0]["methods"][m]["tokens"]
                                         for side in runs for r in runs[side]),
                      "samples": {side: [r["methods"][m] for r in runs[side]] for side in runs}}
    result = {**spec, "reps": args.reps, "old": sides["old"], "new_src": sides["new"],
              "old_commit": harness.git_commit(Path(sides["old"])), "new_commit": harness.git_commit(Path(sides["new"])),
              "prompt_tokens": runs["new"][0]["prompt_tokens"], "methods": methods}
    harness.publish(args.out, result, record, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
