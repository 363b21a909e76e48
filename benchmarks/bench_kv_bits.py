"""Resident KV bytes and decode step time per ``kv_bits`` (16, 8, 4, 2) and method.

Each configuration (method x bit width) prefills the same prompt (``--length`` tokens of the pydoc
text) and decodes ``--new`` tokens with ``kvtrim.generate_ids``; the repetitions are interleaved by
:mod:`kvtrim.harness` after a warm-up round. Recorded per configuration: the stored tokens, the
resident bytes the cache reports (``kv_bytes``: codes, group ids, scales and zero points, the
residual's buffers), the same bytes computed from the layers' counts by the storage's formula (see
docs/quantization.md), and the median decode milliseconds per step.

    OMP_NUM_THREADS=1 python benchmarks/bench_kv_bits.py --length 2048 --new 32 --reps 3 \\
        --out results/kv_bits.json                                      # writes results/kv_bits.json
    python benchmarks/bench_kv_bits.py --table benchmarks/results/kv_bits.json   # its table (docs/quantization.md)

The JSON is rewritten after every round, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvtrim import harness


def formula_bytes(cache) -> int | None:
    """The bytes a low-bit cache's key/value storage holds by the storage's formula, from its layers'
    counts: per allocated quantized slot and KV head the packed codes, a 4-byte group id and a float16
    value scale and zero (the slots an in-place decode drop freed stay allocated until the next group
    is packed: ``LowBitKV.allocated``), per key group and KV head a float16 scale and zero per channel,
    and the residual's allocated slots in the model's dtype. None for a 16-bit cache (its buffers'
    bytes are the count)."""
    if cache.kv_bits == 16:
        return None
    total = 0
    for layer in cache.compressed_layers:
        el = layer.element_size()
        b, h = layer.positions.shape[:2]
        d = cache.head_dim
        kv, bits = layer.lowbit, layer.bits
        res_slots = layer.residual[0].untyped_storage().nbytes() // (b * h * d * el)
        total += b * h * (kv.allocated() * (2 * d * bits // 8 + 4 + 4) + kv.groups * d * 4 + res_slots * 2 * d * el)
    return total


def table(r: dict) -> str:
    """Markdown table of a result: one row per method and bit width."""
    lines = [f"{r['model']} ({r['dtype']}), prompt {r['prompt_tokens']} tokens, {r['new_tokens']} decoded, median of "
             f"{r['reps']} interleaved repetitions, {r['info'].get('torch_threads', '?')} torch thread(s) (load average "
             f"{r['info']['loadavg_start'][0]:.1f} at the start).", "",
             "| method | kv_bits | stored tokens | resident KV MiB | of 16-bit | reported = formula | decode ms/step (median) | runs |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for c in r["configs"]:
        runs = r["runs"].get(c["name"], [])
        if not runs:
            continue
        first = runs[0]
        base = next((x for x in r["configs"] if x["method"] == c["method"] and x["bits"] == 16), None)
        base_bytes = r["runs"][base["name"]][0]["kv_bytes"] if base and r["runs"].get(base["name"]) else None
        ratio = f"{first['kv_bytes'] / base_bytes:.3f}" if base_bytes else "-"
        med = statistics.median(x["ms_per_step"] for x in runs)
        ms = ", ".join(f"{x['ms_per_step']:.1f}" for x in runs)
        same = ("-" if c["bits"] == 16 else
                "yes" if all(x["kv_bytes"] == x["formula_bytes"] for x in runs) else "no")
        lines.append(f"| {c['method']} | {c['bits']} | {first['stored']} | {first['kv_bytes'] / 2**20:.2f} | {ratio} | "
                     f"{same} | {med:.1f} | {ms} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=3, warmup=1)])
    ap.add_argument("--model", help="model to load [default: the embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="tokens to decode")
    ap.add_argument("--bits", default="16,8,4,2", help="comma-separated kv_bits")
    ap.add_argument("--methods", default="full,snapkv", help="comma-separated methods (compressing ones at --keep)")
    ap.add_argument("--keep", type=float, default=0.25, help="budget of the compressing methods")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0

    from kvtrim.cache import KVTrimCache, check_kv_bits
    from kvtrim.data import pydoc_text
    from kvtrim.generation import generate_ids
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy, get_policy_class

    bits = [check_kv_bits(int(b)) for b in args.bits.split(",")]
    methods = args.methods.split(",")
    info = harness.machine_record()
    lm = load_model(args.model)
    ids = lm.tokenizer(pydoc_text(), add_special_tokens=False)["input_ids"][: args.length]
    configs = [{"name": f"{m}@{b}", "method": m, "bits": b} for m in methods for b in bits]
    by_name = {c["name"]: c for c in configs}
    raw: dict[str, list[dict]] = {c["name"]: [] for c in configs}

    def one(name: str, rep: int) -> dict:
        c = by_name[name]
        pol = create_policy(c["method"], **({"keep": args.keep} if get_policy_class(c["method"]).takes_budget else {}))
        cache = KVTrimCache(lm.model, pol, kv_bits=c["bits"])
        r = generate_ids(lm.model, lm.tokenizer, ids, pol, max_new_tokens=args.new, stop_at_eos=False, cache=cache)
        ms = 1000 * r.decode_seconds / max(r.decode_steps, 1)
        print(f"rep {rep} {name}: {ms:.1f} ms/step, KV {r.kv_bytes / 2**20:.2f} MiB", file=sys.stderr, flush=True)
        return {"ms_per_step": ms, "prefill_seconds": r.prefill_seconds, "stored": r.stored_tokens,
                "kv_bytes": r.kv_bytes, "formula_bytes": formula_bytes(cache), "kv_bytes_full": r.kv_bytes_full}

    def save(sample: harness.Sample) -> None:
        raw[sample.config].append(sample.value)
        result = {"benchmark": "kv_bits", "model": lm.source, "dtype": str(next(lm.model.parameters()).dtype),
                  "info": harness.finish_record(info), "prompt_tokens": len(ids), "new_tokens": args.new,
                  "keep": args.keep, "reps": min(len(v) for v in raw.values()), "reps_requested": args.reps,
                  "configs": configs, "runs": raw}
        harness.write_json(args.out, result)

    harness.interleave([c["name"] for c in configs], one, reps=args.reps, warmup=args.warmup, on_sample=save)
    print(table(harness.read_result(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
