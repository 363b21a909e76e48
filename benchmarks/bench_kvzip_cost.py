"""What ``kvzip``'s reconstruction costs: prefill and decode time against the full cache and SnapKV.

One prompt of ``--prompt-tokens`` tokens of prose (the standard library's docs) ends with a question
in the model's chat format; each repetition runs every configuration once through
``kvtrim.generate_ids`` (interleaved by :mod:`kvtrim.harness`, after a warm-up round):

* ``full``: the uncompressed cache;
* ``snapkv`` and ``kvzip`` at ``--keep`` (``kvzip``'s prefill time covers its recorded prefill, the
  reconstruction forward and the replayed eviction: :mod:`kvtrim.reconstruction`);
* ``full@kept``: the full cache of a prompt cut to what ``kvzip`` keeps on average per head, the
  decode-time reference for "a full cache of the same stored size".

Reported: the median prefill seconds and decode milliseconds per token, their ratios to ``full``'s
(prefill) and ``full@kept``'s (decode), and the bytes stored.

    python benchmarks/bench_kvzip_cost.py --model qwen2.5-0.5b --prompt-tokens 4096 --keep 0.25 --threads 2 \\
        --out benchmarks/results/kvzip_cost.json
    python benchmarks/bench_kvzip_cost.py --table benchmarks/results/kvzip_cost.json   # its table in docs/methods.md

The JSON is rewritten after every round, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvtrim import harness

CONFIGS = ("full", "snapkv", "kvzip", "full@kept")


def table(r: dict) -> str:
    """Markdown table of a kvzip-cost result."""
    m = r["machine"]
    lines = [f"{r['model']}, {r['dtype']}, prompt {r['prompt_tokens']} tokens, keep {r['keep']}, {r['new_tokens']} new "
             f"tokens, median of {r['reps']} interleaved repetitions; {harness.machine_line(m, r['threads'])}.", "",
             "| configuration | prefill s | prefill / full | decode ms/token | decode / full@kept | KV stored (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    med = r["median"]
    for n in CONFIGS:
        if n not in med:
            continue
        x = med[n]
        lines.append(f"| {n} | {x['prefill_seconds']:.1f} | {x['prefill_seconds'] / med['full']['prefill_seconds']:.2f} | "
                     f"{x['ms_per_token']:.1f} | {x['ms_per_token'] / med['full@kept']['ms_per_token']:.2f} | "
                     f"{x['kv_bytes_stored'] / 2**20:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=2, warmup=1, threads=1)])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0

    from kvtrim.data import pydoc_text
    from kvtrim.generation import generate_ids
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.registry import create_policy

    record = harness.machine_record()
    lm = load_model(args.model)
    question = "\n\nWhat is this text about? Answer in one sentence."
    body = lm.tokenizer(pydoc_text(), add_special_tokens=False)["input_ids"]
    n_tail = len(build_prompt_ids(lm.tokenizer, "x" + question)) - 1
    text = lm.tokenizer.decode(body[: args.prompt_tokens - n_tail])
    ids = build_prompt_ids(lm.tokenizer, text + question)
    kept: dict[str, int] = {}
    raw: dict[str, list[dict]] = {n: [] for n in CONFIGS}

    def one(n: str, rep: int) -> dict:
        prompt = ids
        if n == "full@kept":
            prompt = ids[-kept["kvzip"]:] if "kvzip" in kept else ids
            pol = create_policy("full")
        else:
            pol = create_policy(n, **({} if n == "full" else {"keep": args.keep}))
        r = generate_ids(lm.model, lm.tokenizer, prompt, pol, max_new_tokens=args.new, stop_at_eos=False)
        ms = 1000 * r.decode_seconds / max(1, r.decode_steps)
        out = {"ms_per_token": ms, "prefill_seconds": r.prefill_seconds, "kv_bytes_stored": r.kv_bytes_stored,
               "kv_bytes": r.kv_bytes, "prompt_tokens": len(prompt), "stored_tokens": r.stored_tokens}
        if n == "kvzip":
            # the average tokens kvzip's heads keep: its stored bytes over one token's bytes in every head
            per_token = r.kv_bytes_full / (len(prompt) + args.new)
            kept["kvzip"] = max(1, round(r.kv_bytes_stored / per_token) - args.new)
            out["mean_kept_prompt_tokens"] = kept["kvzip"]
        print(f"rep {rep} {n}: prefill {r.prefill_seconds:.1f}s, decode {ms:.1f} ms/token", file=sys.stderr, flush=True)
        return out

    order = list(CONFIGS)

    def save(sample: harness.Sample) -> None:
        raw[sample.config].append(sample.value)
        if sample.config != harness.order(order, sample.rep + args.warmup, "fixed")[-1]:
            return
        med = {n: {k: statistics.median(x[k] for x in v) for k in ("ms_per_token", "prefill_seconds", "kv_bytes_stored")}
               for n, v in raw.items() if v}
        result = {"benchmark": "kvzip_cost", "model": lm.source, "dtype": str(lm.model.dtype).replace("torch.", ""),
                  "threads": args.threads, "prompt_tokens": len(ids), "keep": args.keep, "new_tokens": args.new,
                  "reps": sample.rep + 1, "reps_requested": args.reps, "median": med, "runs": raw,
                  "machine": harness.finish_record(dict(record))}
        harness.write_json(args.out, result)

    # fixed order: full@kept needs kvzip's kept count from the same round
    harness.interleave(order, one, reps=args.reps, warmup=args.warmup, how="fixed", on_sample=save)
    print(table(harness.read_result(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
