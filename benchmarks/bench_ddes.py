"""DDES (HAE's recycle-bin decode eviction) vs H2O's per-step eviction: eviction operations and decode time.

Embedded SmolLM2-135M (fp32, CPU), a prose prompt of ``--length`` tokens, ``--steps`` greedy
decode steps under the same budget (``keep``). Both policies score every step from q and k; H2O
evicts one token per layer at every step (one gather of the whole cache per layer per step),
HAE's DDES moves low scorers to a bin and empties it in one gather when it overflows. Counted,
per layer, over the decode steps, from the cache's public state (each layer's stored length after
every step; a step appends one token, so a layer that holds fewer than before + 1 ran one gather
and freed the difference; both policies evict only when over budget, so every gather frees at
least one token): gathers and tokens freed; decode time per step (median after ``--warmup``
steps). Prefill and decode go through :mod:`kvtrim.decoding`; configurations are interleaved per
repetition by :mod:`kvtrim.harness` (order alternating); medians over repetitions.

    python benchmarks/bench_ddes.py --steps 64 --reps 3 --out results/ddes.json   # the committed run's arguments
    python benchmarks/bench_ddes.py --table benchmarks/results/ddes.json             # its table in docs/results.md
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.data import prose_haystack
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy


def table(d: dict) -> str:
    """The docs/results.md table of a DDES result."""
    load = (d["machine"].get("loadavg_end") if isinstance(d.get("machine"), dict) else d["loadavg_end"])[0]
    threads = d["machine"]["torch_threads"] if isinstance(d.get("machine"), dict) else d["threads"]
    out = [
        f"{d['model']}, {d['context']}-token prose prompt, keep {d['keep']}, {d['decode_steps']} decode steps, "
        f"{threads} thread(s), {d['reps']} rep(s), {d['date'][:10]}, load average at the end {load:.1f}.",
        "",
        "| config | gathers per layer | tokens freed per layer | max stored / budget | restored per layer and head | decode ms/token (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['config']} | {r['gathers_per_layer']:.0f} | {r['tokens_freed_per_layer']:.0f} | "
            f"{r['max_stored_during_decode']} / {r['budget_at_end']} | {r['restored_per_layer_head']:.1f} | "
            f"{r['decode_ms_median']:.0f} ({', '.join(f'{x:.0f}' for x in r['decode_ms_per_rep'])}) |"
        )
    return "\n".join(out)


@torch.inference_mode()
def run(model, ids: list[int], name: str, kw: dict, steps: int, warmup: int) -> dict:
    """One prefill and ``steps + warmup`` greedy decode steps; gathers counted from the stored lengths."""
    cache = KVTrimCache(model, create_policy(name, **kw))
    layers = cache.compressed_layers
    times: list[float] = []
    gathers = freed = max_stored = 0
    before: list[int] = []

    def on_step(step, seconds: float) -> None:
        nonlocal gathers, freed, max_stored
        after = [layer.length for layer in layers]
        for b, a in zip(before, after):
            if a < b + 1:  # the step appended one token; fewer stored means a gather freed the rest
                gathers += 1
                freed += b + 1 - a
        before[:] = after
        times.append(seconds)
        max_stored = max(max_stored, max(cache.stored_tokens()))

    with attach(model):
        logits = decoding.run(model, decoding.prefill(cache, ids))
        before[:] = [layer.length for layer in layers]
        decoding.run(model, decoding.decode(cache, logits, steps + warmup + 1), on_step=on_step)
    n_layers = len(layers)
    return {
        "decode_ms_median": 1000 * harness.median(times[warmup:]),
        "gathers_per_layer": gathers / n_layers,
        "tokens_freed_per_layer": freed / n_layers,
        "max_stored_during_decode": max_stored,
        "budget_at_end": cache.policy.budget(cache.seen_tokens()),
        "kv_bytes_end": cache.kv_bytes(),
        "kv_bytes_full_end": cache.kv_bytes_full(),
        "restored_per_layer_head": (sum(layer.state.get("hae_restored", 0) for layer in layers) / n_layers / cache.num_kv_heads),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 parents=[harness.options(reps=2, warmup=4, warmup_help="decode steps dropped at the start of each run", threads=2)])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--keep", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    lm = load_model(None)
    ids = lm.tokenizer(prose_haystack()[:100000], add_special_tokens=False)["input_ids"][: args.length]
    cfgs = {
        "h2o": ("h2o", {"keep": args.keep}),
        "hae_ddes(bin 0.15)": ("hae", {"keep": args.keep}),
        "hae_ddes(bin 0.10)": ("hae", {"keep": args.keep, "bin_ratio": 0.10}),
    }
    samples = harness.interleave(
        list(cfgs), lambda c, rep: run(lm.model, ids, *cfgs[c], args.steps, args.warmup), reps=args.reps,
        on_sample=lambda s: print(s.rep, s.config, json.dumps(s.value), file=sys.stderr, flush=True))
    rows = []
    for cname, ss in samples.items():
        row = dict(ss[-1].value)
        row["decode_ms_median"] = harness.median(ss, "decode_ms_median")
        row["decode_ms_per_rep"] = [s.value["decode_ms_median"] for s in ss]
        rows.append({"config": cname, "policy": cfgs[cname][1], **row})
    out = {
        "benchmark": "ddes_vs_h2o", "model": "SmolLM2-135M-Instruct", "context": args.length, "keep": args.keep,
        "decode_steps": args.steps, "warmup": args.warmup, "reps": args.reps, "date": machine["date"],
        "machine": harness.finish_record(machine), "dtype": "float32", "rows": rows,
    }
    harness.write_json(args.out, out)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
