"""Decode-step overhead of each method against a full cache holding the same number of stored tokens.

What a method adds to a decode step beyond attention over what it stores (its bookkeeping: scores,
eviction copies, key re-rotation) is measured here in isolation: for each method at ``--keep``
after ``--seen`` tokens, the cache's layers are filled **synthetically** (random keys and values,
the stream indices, rotations and policy state the method would hold; no prefill is run, so 8k and
32k cost seconds), then ``--steps`` greedy decode steps (:mod:`kvtrim.decoding` programs) are timed.
Beside each method, a ``full`` cache filled the same way with exactly the method's starting stored
count is timed in the same round (:func:`kvtrim.harness.interleave`). The ratio of medians
``method / full`` is the overhead (target: at most 1.10). Means are reported too: a method that
evicts every few steps or trims once per ``decode_cap`` steps shows it in the mean, not the median.

The synthetic contents make the timing independent of any prompt: attention costs the same whatever
the keys hold, and each method's per-step work depends only on the stored count and its state.
Generated tokens are meaningless (positions beyond the model's trained context are allowed here).

    python benchmarks/bench_decode_overhead.py --threads 1 --out benchmarks/results/decode_overhead/overhead.json
    python benchmarks/bench_decode_overhead.py --table benchmarks/results/decode_overhead/overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy

DEFAULT_METHODS = "snapkv,streaming_llm,h2o,inf_mllm,elastic"


def table(d: dict) -> str:
    m = d["machine"]
    lines = [f"{d['model']}, float32, torch {m['torch']}, {d['args']['threads']} thread(s), load average "
             f"{m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}, {d['date'][:10]}; keep {d['args']['keep']}, "
             f"median (mean) of {d['args']['steps']} decode steps x {d['args']['reps']} interleaved rounds.\n",
             "| seen | method | stored at start | method ms/step | full ms/step (same stored) | ratio of medians | ratio of means |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['seen']} | {r['method']} | {r['stored_start']} | {r['ms_median']:.1f} ({r['ms_mean']:.1f}) | "
                     f"{r['full_ms_median']:.1f} ({r['full_ms_mean']:.1f}) | {r['ratio_median']:.2f} | {r['ratio_mean']:.2f} |")
    return "\n".join(lines)


def stored_positions(policy, seen: int, stored: int, gen: torch.Generator) -> torch.Tensor:
    """Ascending stream indices of ``stored`` tokens a method holds after ``seen`` tokens: the sinks,
    the most recent window, and (for score-based methods) a random choice from between."""
    sinks = policy.n_sinks
    if policy.name in ("streaming_llm", "full"):
        return torch.cat([torch.arange(sinks), torch.arange(seen - stored + sinks, seen)])
    recent = stored // 2
    middle = torch.randperm(seen - recent - sinks, generator=gen)[: stored - recent - sinks] + sinks
    return torch.cat([torch.arange(sinks), middle.sort().values, torch.arange(seen - recent, seen)])


def fill(cache: KVTrimCache, seen: int, stored: int, seed: int) -> None:
    """Load every compressed layer with ``stored`` random tokens of a ``seen``-token stream."""
    gen = torch.Generator().manual_seed(seed)
    policy = cache.policy
    pos = stored_positions(policy, seen, stored, gen)
    h, d = cache.num_kv_heads, cache.head_dim
    meta, tensors = [], {}
    for i in range(len(cache.layers)):
        states = {}
        state: dict = {}
        if policy.name == "h2o":
            states["h2o_acc"] = torch.rand(1, h, stored, generator=gen) * 4
        if policy.name == "elastic":
            state["elastic_P"] = max(policy.n_sinks, stored - policy.distance)
        meta.append({"initialized": True, "seen": seen, "length": stored, "phase": "decode", "n_new": 1,
                     "token_state": sorted(states), "state": state})
        tensors.update({f"layers.{i}.keys": torch.randn(1, h, stored, d, generator=gen),
                        f"layers.{i}.values": torch.randn(1, h, stored, d, generator=gen),
                        f"layers.{i}.positions": pos.view(1, 1, -1).expand(1, h, -1).contiguous()})
        if cache.position_policy != "true":
            tensors[f"layers.{i}.rotations"] = torch.arange(stored).view(1, 1, -1).expand(1, h, -1).contiguous()
        tensors.update({f"layers.{i}.state.{n}": t for n, t in states.items()})
    cache.load_state_dict(tensors, meta)


@torch.inference_mode()
def time_steps(model, method: str, keep: float, seen: int, stored: int, steps: int, warmup: int, seed: int) -> dict:
    cache = KVTrimCache(model, create_policy(method) if method == "full" else create_policy(method, keep=keep))
    fill(cache, seen, stored, seed)
    logits = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    times: list[float] = []
    decoding.run(model, decoding.decode(cache, logits, steps + warmup + 1), on_step=lambda step, s: times.append(s))
    times = times[warmup:]
    return {"median": harness.median(times), "mean": sum(times) / len(times), "stored_end": max(cache.stored_tokens()),
            "samples": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=3, warmup=4, threads=1,
                                                          warmup_help="decode steps dropped at the start of each run")])
    ap.add_argument("--seen", default="8192,32768", help="stream lengths (tokens seen), comma-separated")
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    lm = load_model()
    rows = []
    for seen in [int(x) for x in args.seen.split(",")]:
        for method in args.methods.split(","):
            stored = create_policy(method, keep=args.keep).budget(seen)
            configs = [method, "full"]

            def run(config: str, rep: int, method=method, stored=stored, seen=seen) -> dict:
                full = config == "full"
                return time_steps(lm.model, config, args.keep, stored if full else seen, stored, args.steps, args.warmup, rep)

            with attach(lm.model):
                samples = harness.interleave(configs, run, reps=args.reps, warmup=0,
                                             on_sample=lambda s: print(s.config, f"{s.value['median'] * 1000:.1f} ms", file=sys.stderr, flush=True))
            per = {c: [x for s in samples[c] for x in s.value["samples"]] for c in configs}
            st = {c: harness.stats(per[c]) for c in configs}
            mean = {c: sum(per[c]) / len(per[c]) for c in configs}
            row = {"seen": seen, "method": method, "keep": args.keep, "stored_start": stored,
                   "stored_end": samples[method][0].value["stored_end"],
                   "ms_median": 1000 * st[method]["median"], "ms_mean": 1000 * mean[method],
                   "full_ms_median": 1000 * st["full"]["median"], "full_ms_mean": 1000 * mean["full"],
                   "ratio_median": st[method]["median"] / st["full"]["median"], "ratio_mean": mean[method] / mean["full"]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"benchmark": "decode_overhead", "date": machine["date"], "machine": harness.finish_record(machine),
              "model": lm.source, "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")}, "rows": rows}
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
