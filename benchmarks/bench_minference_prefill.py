"""End-to-end prefill of the embedded model: dense SDPA vs each MInference pattern vs the searched config.

For each length, one prefill forward (full KV cache, ``logits_to_keep=1``) per configuration,
configurations interleaved within each repetition (the order alternates between repetitions),
medians over ``--reps`` after one warm-up at that length (lengths >= 16k: ``--long-reps``, default 1, no warm-up; the warm-up is negligible
there). Beyond the model's 8k context the RoPE is scaled linearly (factor = length / 8192; timing
only, the outputs are not judged there).

Configurations:
- ``dense``: SDPA (``is_causal``), timed inside the same hook so attention-only time is measured
  the same way as for the sparse paths;
- ``minference``: the per-head config (shipped for the model, or ``--pattern-config``);
- ``a_shape``, ``vertical_slash``, ``block_sparse``: one pattern on every head, at the median
  sizes the searched config gives that pattern (so all run at comparable cost).

Reported per (length, config): wall seconds and process CPU seconds (the CPU time is robust to
other load on a shared machine when ``--threads 1``), executed attention density, attention
seconds (kernel alone) and index-estimation seconds, the end-to-end and attention-only speedups
vs dense, and the estimation overhead as a fraction of the prefill. Summary: the crossover length
(smallest measured length at which the config beat dense end to end).

    python benchmarks/bench_minference_prefill.py --lengths 2048 4096 8192 16384 32768 \\
        --out benchmarks/results/minference_prefill.json

``--isolate`` runs every forward in a fresh process. At 32k a forward holds ~10 GB and the
configuration that ran second in one process was measured 10-20% slower outside the attention,
whichever it was; isolated runs remove that effect:

    python benchmarks/bench_minference_prefill.py --isolate --lengths 16384 32768 --long-reps 3 \\
        --configs dense minference --out benchmarks/results/minference_prefill_long_isolated.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from kvtrim.integrations.prefill import SIZE_KEYS, SparsePrefill, make_prefill
from kvtrim.cache import KVTrimCache
from kvtrim.data import essays_text
from kvtrim.integrations.hf import attach, cache_kwarg
from kvtrim.models import load_model


def scale_rope(model, length: int, base_ctx: int) -> None:
    """Linear RoPE scaling so ``length`` positions map into the trained range (timing only)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = model.config
    factor = max(1.0, length / base_ctx)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    cfg.rope_parameters = {"rope_type": "linear" if factor > 1 else "default", "factor": factor, "rope_theta": theta}
    cfg.max_position_embeddings = max(base_ctx, length)
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)


def median_sizes(cfg, pattern: str) -> dict:
    vals = {k: [] for k in SIZE_KEYS[pattern]}
    for row in cfg.layers:
        for e in row:
            if e["pattern"] == pattern:
                for k in vals:
                    vals[k].append(e[k])
    if not all(vals.values()):
        return {}
    return {k: int(statistics.median(v)) for k, v in vals.items()}


@torch.inference_mode()
def one_prefill(model, ids, hook) -> tuple[float, float, dict]:
    cache = KVTrimCache(model, "full")
    hook.reset_stats()
    with attach(model, prefill_attention=hook):
        w0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=ids, **{cache_kwarg(): cache}, logits_to_keep=1)
        w1, c1 = time.perf_counter(), time.process_time()
    return w1 - w0, c1 - c0, hook.stats()


def build(pattern_config: str | None):
    """The embedded model, its hooks by configuration name, the single-pattern sizes and the prompt ids."""
    lm = load_model(None)
    model = lm.model
    mi = make_prefill(model, "minference", pattern_config, min_length=1)
    hooks = {"dense": SparsePrefill("dense"), "minference": mi}
    single_sizes = {}
    for pat in ("a_shape", "vertical_slash", "block_sparse"):
        sizes = median_sizes(mi.config, pat)
        single_sizes[pat] = sizes
        hooks[pat] = SparsePrefill(pat, sizes=sizes or None, min_length=1)
    all_ids = lm.tokenizer(essays_text(), return_tensors="pt").input_ids
    return lm, hooks, single_sizes, all_ids


def prompt(all_ids: torch.Tensor, n: int) -> torch.Tensor:
    while all_ids.shape[1] < n:
        all_ids = torch.cat([all_ids, all_ids], dim=1)
    return all_ids[:, :n]


def run_one(n: int, name: str, pattern_config: str | None) -> int:
    """A child of ``--isolate``: one forward (after one warm-up below 16k) in this fresh process; JSON on stdout."""
    lm, hooks, _, all_ids = build(pattern_config)
    scale_rope(lm.model, n, int(lm.model.config.max_position_embeddings))
    ids = prompt(all_ids, n)
    if n < 16384:
        one_prefill(lm.model, ids, hooks[name])
    wall, cpu, stats = one_prefill(lm.model, ids, hooks[name])
    print(json.dumps({"wall": wall, "cpu": cpu, "stats": stats}))
    return 0


def isolated(n: int, name: str, args) -> tuple[float, float, dict]:
    cmd = [sys.executable, __file__, "--one", str(n), name]
    if args.pattern_config:
        cmd += ["--pattern-config", args.pattern_config]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    return rec["wall"], rec["cpu"], rec["stats"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--configs", nargs="+", default=["dense", "minference", "a_shape", "vertical_slash", "block_sparse"])
    p.add_argument("--long-configs", nargs="+", default=None, help="configs at lengths >= 16k (default: all)")
    p.add_argument("--pattern-config", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--long-reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--isolate", action="store_true",
                   help="run every forward in a fresh process (no order or allocator effects between configurations)")
    p.add_argument("--one", nargs=2, metavar=("LENGTH", "CONFIG"), help=argparse.SUPPRESS)  # a child of --isolate
    p.add_argument("--out", required=False)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        return run_one(int(args.one[0]), args.one[1], args.pattern_config)
    if not args.out:
        p.error("--out is required")

    lm, hooks, single_sizes, all_ids = build(args.pattern_config)
    model, mi = lm.model, hooks["minference"]
    base_ctx = int(model.config.max_position_embeddings)
    records = []
    meta = {
        "benchmark": "minference_prefill",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": lm.source,
        "single_pattern_sizes": single_sizes,
        "pattern_config_search": mi.config.search,
        "isolated": bool(args.isolate),
        "order": "configurations interleaved; the order alternates between repetitions",
    }
    for n in args.lengths:
        scale_rope(model, n, base_ctx)
        ids = prompt(all_ids, n)
        names = args.configs if (n < 16384 or args.long_configs is None) else args.long_configs
        reps = args.reps if n < 16384 else args.long_reps
        if n < 16384 and not args.isolate:
            for name in names:
                one_prefill(model, ids, hooks[name])
        runs = {name: [] for name in names}
        load0 = os.getloadavg()
        for rep in range(reps):
            for name in (names if rep % 2 == 0 else names[::-1]):  # the order alternates between repetitions
                if args.isolate:
                    runs[name].append(isolated(n, name, args))
                else:
                    runs[name].append(one_prefill(model, ids, hooks[name]))
                print(f"{n} {name}: {runs[name][-1][0]:.2f}s wall, density {runs[name][-1][2]['density']:.3f}", file=sys.stderr, flush=True)
        dense_wall = statistics.median(r[0] for r in runs["dense"]) if "dense" in runs else None
        dense_cpu = statistics.median(r[1] for r in runs["dense"]) if "dense" in runs else None
        dense_attn = statistics.median(r[2]["attention_seconds"] for r in runs["dense"]) if "dense" in runs else None
        for name, rr in runs.items():
            wall = statistics.median(r[0] for r in rr)
            cpu = statistics.median(r[1] for r in rr)
            attn = statistics.median(r[2]["attention_seconds"] for r in rr)
            est = statistics.median(r[2]["estimate_seconds"] for r in rr)
            rec = {
                "length": n, "config": name, "reps": len(rr), "wall_seconds": wall, "cpu_seconds": cpu,
                "wall_all": [r[0] for r in rr], "density": rr[0][2]["density"],
                "attention_seconds": attn, "estimate_seconds": est, "estimate_fraction": est / wall,
                "loadavg": [load0, os.getloadavg()],
            }
            if dense_wall:
                rec["speedup_wall"] = dense_wall / wall
                rec["speedup_cpu"] = dense_cpu / cpu
                rec["speedup_attention"] = dense_attn / (attn + est) if attn + est > 0 else None
                rec["ideal_attention_speedup"] = 1 / rec["density"]
            records.append(rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
        with open(args.out, "w") as f:  # rewritten after every length: a long run keeps what it measured
            json.dump({**meta, "records": records}, f, indent=1)
    summary = {}
    for name in args.configs:
        if name == "dense":
            continue
        won = sorted(r["length"] for r in records if r["config"] == name and r.get("speedup_wall", 0) > 1.0)
        summary[name] = {
            "lengths_measured": sorted({r["length"] for r in records if r["config"] == name}),
            "crossover_length": won[0] if won else None,  # the smallest *measured* length that beat dense
            "speedup_wall": {r["length"]: round(r["speedup_wall"], 3) for r in records if r["config"] == name and "speedup_wall" in r},
        }
    with open(args.out, "w") as f:
        json.dump({**meta, "summary": summary, "records": records}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
