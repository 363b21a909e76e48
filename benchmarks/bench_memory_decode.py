"""Resident KV bytes and per-token decode time vs context length, side by side in one run.

Configurations: transformers' own DynamicCache (what users have without kvtrim), kvtrim ``full``,
and ``snapkv`` / ``h2o`` at keep 0.1 and 0.2, on the embedded model (fp32, CPU), at context
lengths 1k, 2k, 4k and ~8k tokens of essay prose. For each: one prefill, then ``--steps`` greedy
decode steps, each timed; the median step time is reported (the first ``--warmup`` steps are
dropped). Configurations are interleaved per length so machine noise hits all alike.

Targets (issue 2): resident bytes <= keep * full + 2% of full; at 8k, decode per token with keep
0.1 at least 1.3x faster than full. Resident bytes are reported right after prefill and at the
end: ``snapkv`` compresses the prompt and appends decoded tokens, ``h2o`` holds the budget at
every step.

    .venv/bin/python benchmarks/bench_memory_decode.py --out benchmarks/results/memory_decode.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import DynamicCache

import kvtrim
from kvtrim.cache import KVTrimCache
from kvtrim.data import prose_haystack
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model


def kv_bytes_dynamic(cache: DynamicCache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.inference_mode()
def run(model, ids: torch.Tensor, config: str, steps: int, warmup: int) -> dict:
    if config == "hf_dynamic":
        cache, ctx = DynamicCache(config=model.config), None
    else:
        name, _, keep = config.partition("@")
        cache = KVTrimCache(model, name, **({"keep": float(keep)} if keep else {}))
        ctx = attach(model)
    if ctx is not None:
        ctx.__enter__()
    try:
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        kv_after_prefill = cache.kv_bytes() if isinstance(cache, KVTrimCache) else kv_bytes_dynamic(cache)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps + warmup):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            tok = out.logits[:, -1:].argmax(-1)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    times = times[warmup:]
    seen = ids.shape[1] + steps + warmup
    cfg = model.config
    full_bytes = seen * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers
    if isinstance(cache, KVTrimCache):
        kv, stored = cache.kv_bytes(), max(cache.stored_tokens())
        index = cache.index_bytes()
    else:
        kv, stored, index = kv_bytes_dynamic(cache), seen, 0
    return {
        "config": config,
        "context": ids.shape[1],
        "seen": seen,
        "stored_tokens": stored,
        "kv_bytes": kv,
        "kv_bytes_full": full_bytes,
        "kv_fraction_of_full": kv / full_bytes,
        "kv_bytes_after_prefill": kv_after_prefill,
        "kv_fraction_after_prefill": kv_after_prefill / (full_bytes * ids.shape[1] / seen),
        "index_bytes": index,
        "prefill_s": prefill,
        "decode_ms_median": 1000 * statistics.median(times),
        "decode_ms_p10": 1000 * sorted(times)[len(times) // 10],
        "decode_ms_p90": 1000 * sorted(times)[(9 * len(times)) // 10],
        "steps": len(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,8000")
    ap.add_argument("--configs", default="hf_dynamic,full,snapkv@0.1,snapkv@0.2,h2o@0.1,h2o@0.2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model()
    hay = lm.tokenizer(prose_haystack()[:200000], add_special_tokens=False)["input_ids"]
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.tensor([hay[:n]])
        for config in args.configs.split(","):
            r = run(lm.model, ids, config, args.steps, args.warmup)
            rows.append(r)
            print(json.dumps(r), flush=True)
    base = {r["context"]: r for r in rows if r["config"] == "hf_dynamic"}
    for r in rows:
        r["decode_speedup_vs_hf_dynamic"] = base[r["context"]]["decode_ms_median"] / r["decode_ms_median"]
    result = {
        "benchmark": "memory_decode",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads()},
        "versions": {"kvtrim": kvtrim.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "model": lm.source,
        "dtype": "float32",
        "args": vars(args),
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
