"""DDES (HAE's recycle-bin decode eviction) vs H2O's per-step eviction: eviction operations and decode time.

Embedded SmolLM2-135M (fp32, CPU), a prose prompt of ``--length`` tokens, ``--steps`` greedy
decode steps under the same budget (``keep``). Both policies score every step from q and k; H2O
evicts one token per layer at every step (one gather of the whole cache per layer per step),
HAE's DDES moves low scorers to a bin and empties it in one gather when it overflows. Counted:
calls of ``CompressedLayer.keep_indices`` (gathers) and tokens freed, per layer, over the decode
steps; decode time per step (median after ``--warmup`` steps). Configurations interleaved per
repetition; medians over repetitions.

    .venv/bin/python benchmarks/bench_ddes.py --out benchmarks/results/ddes.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import transformers

from kvtrim.cache import CompressedLayer, KVTrimCache
from kvtrim.data import prose_haystack
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy

COUNT = {"calls": 0, "freed": 0, "on": False}
_orig_keep = CompressedLayer.keep_indices


def _counting_keep(self, idx, *a, **k):
    if COUNT["on"]:
        COUNT["calls"] += 1
        COUNT["freed"] += self.length - idx.shape[-1]
    return _orig_keep(self, idx, *a, **k)


@torch.inference_mode()
def run(model, ids, name, kw, steps, warmup) -> dict:
    cache = KVTrimCache(model, create_policy(name, **kw))
    n_layers = len(cache.compressed_layers)
    with attach(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        times, max_stored = [], 0
        COUNT.update(calls=0, freed=0, on=True)
        for _ in range(steps + warmup):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            tok = out.logits[:, -1:].argmax(-1)
            max_stored = max(max_stored, max(cache.stored_tokens()))
        COUNT["on"] = False
    budget = cache.policy.budget(cache.seen_tokens())
    return {
        "decode_ms_median": 1000 * statistics.median(times[warmup:]),
        "gathers_per_layer": COUNT["calls"] / n_layers,
        "tokens_freed_per_layer": COUNT["freed"] / n_layers,
        "max_stored_during_decode": max_stored,
        "budget_at_end": budget,
        "kv_bytes_end": cache.kv_bytes(),
        "kv_bytes_full_end": cache.kv_bytes_full(),
        "restored_per_layer_head": (sum(layer.state.get("hae_restored", 0) for layer in cache.compressed_layers) / n_layers / cache.num_kv_heads),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--keep", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/ddes.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    CompressedLayer.keep_indices = _counting_keep  # this script only: counts the gathers
    lm = load_model(None)
    hay = lm.tokenizer(prose_haystack()[:100000], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([hay[: args.length]])
    cfgs = {
        "h2o": ("h2o", {"keep": args.keep}),
        "hae_ddes(bin 0.15)": ("hae", {"keep": args.keep}),
        "hae_ddes(bin 0.10)": ("hae", {"keep": args.keep, "bin_ratio": 0.10}),
    }
    res: dict[str, list[dict]] = {c: [] for c in cfgs}
    for rep in range(args.reps):
        for cname, (name, kw) in cfgs.items():
            r = run(lm.model, ids, name, kw, args.steps, args.warmup)
            res[cname].append(r)
            print(rep, cname, json.dumps(r), flush=True)
    rows = []
    for cname, rs in res.items():
        row = dict(rs[-1])
        row["decode_ms_median"] = statistics.median(r["decode_ms_median"] for r in rs)
        row["decode_ms_per_rep"] = [r["decode_ms_median"] for r in rs]
        rows.append({"config": cname, "policy": cfgs[cname][1], **row})
    out = {
        "benchmark": "ddes_vs_h2o", "model": "SmolLM2-135M-Instruct", "context": args.length, "keep": args.keep,
        "decode_steps": args.steps, "warmup": args.warmup, "reps": args.reps,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "loadavg_end": os.getloadavg(), "torch": torch.__version__, "transformers": transformers.__version__,
        "dtype": "float32", "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
