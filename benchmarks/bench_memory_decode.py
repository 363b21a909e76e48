"""Resident KV bytes and per-token decode time vs context length, side by side in one run.

Configurations: transformers' own DynamicCache (what users have without kvtrim), kvtrim ``full``,
and ``snapkv`` / ``h2o`` at keep 0.1 and 0.2, on the embedded model (fp32, CPU), at context
lengths 1k, 2k, 4k and ~8k tokens of essay prose. For each: one prefill, then ``--steps`` greedy
decode steps (:mod:`kvtrim.decoding` programs; the DynamicCache runs the same programs with a
plain forward), each timed; the median step time is reported (the first ``--warmup`` steps are
dropped). Configurations are interleaved per length by :mod:`kvtrim.harness` so machine noise hits
all alike.

Targets (issue 2): resident bytes <= keep * full + 2% of full; at 8k, decode per token with keep
0.1 at least 1.3x faster than full. Resident bytes are reported right after prefill and at the
end: ``snapkv`` compresses the prompt and appends decoded tokens, ``h2o`` holds the budget at
every step.

    python benchmarks/bench_memory_decode.py --steps 24 --out results/memory_decode.json   # the committed run's arguments
    python benchmarks/bench_memory_decode.py --table benchmarks/results/memory_decode.json  # its table in docs/results.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from transformers import DynamicCache

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache, cache_keyword
from kvtrim.data import prose_haystack
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model


def table(d: dict) -> str:
    """The docs/results.md table of a memory/decode result."""
    m = d["machine"]
    versions = d.get("versions") or m
    lines = [f"{d['model']}, {d['dtype']}, torch {versions['torch']}, transformers {versions['transformers']}, "
             f"{m.get('threads', m.get('torch_threads'))} threads, {d['date'][:10]}; median of {d['args']['steps']} decode steps after "
             f"{d['args']['warmup']} warm-up steps.\n",
             "| context | config | stored tokens | KV after prefill (of full) | KV at end (of full) | prefill s | decode ms/token | decode speed-up vs HF DynamicCache |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['context']} | {r['config']} | {r['stored_tokens']} | {r['kv_bytes_after_prefill'] / 2**20:.1f} MiB "
                     f"({r['kv_fraction_after_prefill']:.1%}) | {r['kv_bytes'] / 2**20:.1f} MiB ({r['kv_fraction_of_full']:.1%}) | "
                     f"{r['prefill_s']:.2f} | {r['decode_ms_median']:.1f} | {r['decode_speedup_vs_hf_dynamic']:.2f}x |")
    return "\n".join(lines)


def kv_bytes_dynamic(cache: DynamicCache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.inference_mode()
def run(model, ids: list[int], config: str, steps: int, warmup: int) -> dict:
    serve = None
    if config == "hf_dynamic":
        cache = DynamicCache(config=model.config)

        def serve(step):  # transformers' own cache: a plain forward (no kvtrim positions to pass)
            x = torch.tensor([step.ids])
            return model(input_ids=x, **{cache_keyword(): step.cache}, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    else:
        name, _, keep = config.partition("@")
        cache = KVTrimCache(model, name, **({"keep": float(keep)} if keep else {}))
    times: list[float] = []
    with attach(model) if serve is None else contextlib.nullcontext():  # transformers' cache runs unattached
        pre: list[float] = []
        logits = decoding.run(model, decoding.prefill(cache, ids), serve=serve, on_step=lambda step, seconds: pre.append(seconds))
        prefill = sum(pre)
        kv_after_prefill = cache.kv_bytes() if isinstance(cache, KVTrimCache) else kv_bytes_dynamic(cache)
        decoding.run(model, decoding.decode(cache, logits, steps + warmup + 1), serve=serve,
                     on_step=lambda step, seconds: times.append(seconds))
    times = times[warmup:]
    seen = len(ids) + steps + warmup
    cfg = model.config
    full_bytes = seen * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers
    if isinstance(cache, KVTrimCache):
        kv, stored = cache.kv_bytes(), max(cache.stored_tokens())
        index = cache.index_bytes()
    else:
        kv, stored, index = kv_bytes_dynamic(cache), seen, 0
    st = harness.stats(times)
    return {
        "config": config,
        "context": len(ids),
        "seen": seen,
        "stored_tokens": stored,
        "kv_bytes": kv,
        "kv_bytes_full": full_bytes,
        "kv_fraction_of_full": kv / full_bytes,
        "kv_bytes_after_prefill": kv_after_prefill,
        "kv_fraction_after_prefill": kv_after_prefill / (full_bytes * len(ids) / seen),
        "index_bytes": index,
        "prefill_s": prefill,
        "decode_ms_median": 1000 * st["median"],
        "decode_ms_p10": 1000 * sorted(times)[len(times) // 10],
        "decode_ms_p90": 1000 * sorted(times)[(9 * len(times)) // 10],
        "steps": len(times),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=4, warmup_help="decode steps dropped at the start of each run")])
    ap.add_argument("--lengths", default="1024,2048,4096,8000")
    ap.add_argument("--configs", default="hf_dynamic,full,snapkv@0.1,snapkv@0.2,h2o@0.1,h2o@0.2")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    torch.manual_seed(0)
    machine = harness.machine_record()
    lm = load_model()
    hay = lm.tokenizer(prose_haystack()[:200000], add_special_tokens=False)["input_ids"]
    configs = args.configs.split(",")
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        samples = harness.interleave(configs, lambda c, rep: run(lm.model, hay[:n], c, args.steps, args.warmup), reps=1,
                                     on_sample=lambda s: print(json.dumps(s.value), file=sys.stderr, flush=True))
        rows += [samples[c][0].value for c in configs]
    base = {r["context"]: r for r in rows if r["config"] == "hf_dynamic"}
    for r in rows:
        if r["context"] in base:
            r["decode_speedup_vs_hf_dynamic"] = base[r["context"]]["decode_ms_median"] / r["decode_ms_median"]
    result = {
        "benchmark": "memory_decode",
        "date": machine["date"],
        "machine": harness.finish_record(machine),
        "model": lm.source,
        "dtype": "float32",
        "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")},
        "rows": rows,
    }
    harness.write_json(args.out, result)
    print(table(result) if base else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
