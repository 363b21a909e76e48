"""End-to-end prefill of a model (default: the embedded one): dense SDPA vs each MInference pattern vs the searched config.

For each length, one prefill forward (full KV cache, ``logits_to_keep=1``, through
:mod:`kvtrim.decoding`) per configuration, configurations interleaved within each repetition by
:mod:`kvtrim.harness` (the order alternates between repetitions),
medians over ``--reps`` after one warm-up at that length (lengths >= 16k: ``--long-reps``, default 1, no warm-up; the warm-up is negligible
there). Beyond the model's trained context (8k for the embedded model, 32k for qwen2.5-0.5b) the
RoPE is scaled linearly (factor = length / context; timing only, the outputs are not judged there);
within it the model's own RoPE is used unchanged. ``--rope-scaling KIND:FACTOR`` sets one scaling
for every length instead (e.g. ``yarn:2``, the scaling a config was searched under at 64k), and
``--extra-config NAME=FILE`` times another searched config beside the shipped ones.

Configurations:
- ``dense``: SDPA (``is_causal``), timed inside the same hook so attention-only time is measured
  the same way as for the sparse paths;
- ``minference``: the per-head config (shipped for the model, or ``--pattern-config``);
- ``a_shape``, ``vertical_slash``, ``block_sparse``: one pattern on every head, at the median
  sizes the searched config gives that pattern (so all run at comparable cost).

Reported per (length, config): wall seconds and process CPU seconds (the CPU time is robust to
other load on a shared machine when ``--threads 1``), executed attention density, attention
seconds (kernel alone) and index-estimation seconds, the end-to-end and attention-only speedups
vs dense, the estimation overhead as a fraction of the prefill and, with ``--isolate``, the peak
resident memory of the forward's process (its model loading included, which can be the larger
peak) and, on Linux, the peak during the timed forward alone. Summary: the crossover length
(smallest measured length at which the config beat dense end to end).

    python benchmarks/bench_minference_prefill.py --lengths 2048 4096 8192 16384 32768 \\
        --out results/minference_prefill.json                       # writes results/minference_prefill.json
    python benchmarks/bench_minference_prefill.py --table benchmarks/results/minference_prefill.json   # its table

``--isolate`` runs every forward in a fresh process (:func:`kvtrim.harness.isolated`). At 32k a
forward holds ~10 GB and the configuration that ran second in one process was measured 10-20%
slower outside the attention, whichever it was; isolated runs remove that effect:

    python benchmarks/bench_minference_prefill.py --isolate --lengths 16384 32768 --long-reps 3 \\
        --configs dense minference --out results/minference_prefill_long_isolated.json

``--compare-unfused`` (with ``--isolate``) also runs each config as ``CONFIG:unfused``, its process
loading the model with ``KVTRIM_CPU_FUSION=0`` (no fused MLPs or RMS norms, :mod:`kvtrim.cpu_layers`),
interleaved with the fused one; every record names the fused modules it ran with.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.cli.common import rope_scaling_arg
from kvtrim.cpu_layers import fused_count
from kvtrim.data import essays_text
from kvtrim.integrations.hf import attach
from kvtrim.integrations.prefill import SIZE_KEYS, SparsePrefill, calibration_length, make_prefill
from kvtrim.machine import load_average
from kvtrim.models import extend_context, load_model
from kvtrim.rope import scaling_label

UNFUSED = ":unfused"  # --compare-unfused: a config run on the model without fused CPU layers


def table(d: dict) -> str:
    """The markdown table of a prefill result (docs/minference.md)."""
    m = d["machine"]
    peak = any("peak_rss_mib" in r for r in d["records"])  # isolated runs since 2026-12-07
    fwd = any("forward_peak_rss_mib" in r for r in d["records"])
    lines = [
        f"{d.get('model') or 'SmolLM2-135M-Instruct'}, {d.get('dtype', 'float32')}, torch {d.get('versions', m)['torch']}, {m.get('torch_threads')} threads, {d['date'][:10]}; "
        "median wall seconds of one prefill forward (reps per row), configurations interleaved"
        + ("; every forward in its own process." if d.get("isolated") else "."),
        "",
        "| length | prefill | density | wall s | speed-up | CPU s | attention s (kernel) | attention speed-up | 1/density | estimation share | reps |"
        + (" process peak RSS GiB |" if peak else "") + (" forward peak RSS GiB |" if fwd else ""),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if peak else "") + ("---:|" if fwd else ""),
    ]
    for r in d["records"]:
        sp = f"{r['speedup_wall']:.2f}x" if "speedup_wall" in r else ""
        asp = f"{r['speedup_attention']:.2f}x" if r.get("speedup_attention") else ""
        ideal = f"{r['ideal_attention_speedup']:.1f}" if "ideal_attention_speedup" in r else ""
        lines.append(
            f"| {r['length']} | {r['config']} | {r['density']:.3f} | {r['wall_seconds']:.2f} | {sp} | {r['cpu_seconds']:.1f} | "
            f"{r['attention_seconds']:.2f} | {asp} | {ideal} | {r['estimate_fraction']:.1%} | {r['reps']} |"
            + (f" {r['peak_rss_mib'] / 1024:.1f} |" if "peak_rss_mib" in r else " |" if peak else "")
            + (f" {r['forward_peak_rss_mib'] / 1024:.1f} |" if "forward_peak_rss_mib" in r else " |" if fwd else "")
        )
    if d.get("summary") and any(r["config"] == "dense" for r in d["records"]):  # a crossover needs a dense row
        lines.append("")
        for name, s in d["summary"].items():
            measured = sorted({r["length"] for r in d["records"] if r["config"] == name})
            x = s["crossover_length"]
            margin = next((r["speedup_wall"] for r in d["records"] if r["config"] == name and r["length"] == x), None)
            noise = f"; by {margin - 1:.1%} there, within run-to-run noise" if margin is not None and margin < 1.02 else ""
            lines.append(f"- `{name}`: smallest measured length that beats dense end to end: "
                         f"{x or 'none'} (measured: {', '.join(map(str, measured))}{noise})")
    return "\n".join(lines)


def scale_rope(model, length: int, base_ctx: int, spec: tuple[str, float] | None = None) -> None:
    """The RoPE for a prompt of ``length`` tokens (:func:`kvtrim.models.extend_context`).

    With ``spec`` (``--rope-scaling KIND:FACTOR``) that scaling, at every length; without it, past
    the trained context a linear scaling by ``length / base_ctx`` (timing only), within it the
    model's own RoPE. The model's original RoPE is restored first, so lengths can follow one
    another in one process."""
    cfg = model.config.get_text_config(decoder=True)
    orig = getattr(model, "_kvtrim_rope_orig", None)
    if orig is None:
        orig = model._kvtrim_rope_orig = (copy.deepcopy(cfg.rope_parameters), cfg.max_position_embeddings,
                                          model.model.rotary_emb)
    cfg.rope_parameters, cfg.max_position_embeddings, model.model.rotary_emb = copy.deepcopy(orig[0]), orig[1], orig[2]
    if spec is None and length <= base_ctx:
        return
    kind, factor = spec or ("linear", length / base_ctx)
    extend_context(model, factor, kind)


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
def one_prefill(model, ids: list[int], hook) -> tuple[float, float, dict]:
    """One prefill forward: (wall seconds of the forward, process CPU seconds, the hook's statistics)."""
    cache = KVTrimCache(model, "full")
    hook.reset_stats()
    wall: list[float] = []
    with attach(model, prefill_attention=hook):
        c0 = time.process_time()
        decoding.run(model, decoding.prefill(cache, ids), on_step=lambda step, seconds: wall.append(seconds))
        c1 = time.process_time()
    return wall[0], c1 - c0, hook.stats()


def build(pattern_config: str | None, model_name: str | None = None, dtype: str = "float32", extra: tuple[str, ...] = (),
          rope: tuple[str, float] | None = None):
    """The model (default: the embedded one), its hooks by configuration name, the single-pattern sizes and the prompt ids.

    With ``rope`` (``--rope-scaling``) the model is scaled before the hooks are made, so
    ``minference`` takes the configs searched under that scaling (``shipped_configs``)."""
    lm = load_model(model_name, dtype=dtype)
    model = lm.model
    if rope is not None:
        scale_rope(model, 0, int(model.config.max_position_embeddings), rope)
    mi = make_prefill(model, "minference", pattern_config, min_length=1)
    hooks = {"dense": SparsePrefill("dense"), "minference": mi}
    for spec in extra:  # --extra-config NAME=FILE: another searched config under its own name
        name, sep, path = spec.partition("=")
        if not sep or not name or name in hooks:
            raise SystemExit(f"--extra-config takes NAME=FILE with a new NAME; got {spec!r}")
        hooks[name] = make_prefill(model, "minference", path, min_length=1)
    for cfg in mi.configs:  # "minference@8222": one config whatever the length (minference picks per prompt)
        hooks[f"minference@{calibration_length(cfg)}"] = SparsePrefill("minference", config=cfg, min_length=1)
    single_sizes = {}
    for pat in ("a_shape", "vertical_slash", "block_sparse"):
        sizes = median_sizes(mi.config, pat)
        single_sizes[pat] = sizes
        hooks[pat] = SparsePrefill(pat, sizes=sizes or None, min_length=1)
    all_ids = lm.tokenizer(essays_text())["input_ids"]
    return lm, hooks, single_sizes, all_ids


def prompt(all_ids: list[int], n: int) -> list[int]:
    while len(all_ids) < n:
        all_ids = all_ids + all_ids
    return all_ids[:n]


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: ``5`` into ``/proc/self/clear_refs`` sets VmHWM back to
    the current RSS); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return peak_rss_mib() is not None
    except OSError:
        return False


def peak_rss_mib() -> float | None:
    """VmHWM (peak resident set) of this process in MiB, from ``/proc/self/status``; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_one(n: int, name: str, args) -> int:
    """A child of ``--isolate``: one forward (after one warm-up below 16k) in this fresh process, reported to the parent."""
    lm, hooks, _, all_ids = build(args.pattern_config, args.model, args.dtype, tuple(args.extra_config), args.rope_scaling)
    scale_rope(lm.model, n, int(lm.model.config.max_position_embeddings), args.rope_scaling)
    ids = prompt(all_ids, n)
    if n < 16384:
        one_prefill(lm.model, ids, hooks[name])
    reset = reset_peak_rss()
    wall, cpu, stats = one_prefill(lm.model, ids, hooks[name])
    stats["cpu_layers_fused"] = fused_count(lm.model)
    # the process's peak resident memory (KiB on Linux): the model's loading, its warm-up and this forward
    stats["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if reset:  # and the peak during this forward alone (the weights are resident already)
        stats["forward_peak_rss_mib"] = peak_rss_mib()
    harness.child_result({"wall": wall, "cpu": cpu, "stats": stats})
    return 0


def isolated(n: int, name: str, args) -> tuple[float, float, dict]:
    unfused = name.endswith(UNFUSED)  # the same config on a model whose CPU layers are not fused (kvtrim.cpu_layers)
    argv = ["--one", str(n), name[: -len(UNFUSED)] if unfused else name]
    if args.pattern_config:
        argv += ["--pattern-config", args.pattern_config]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.model:
        argv += ["--model", args.model]
    argv += ["--dtype", args.dtype]
    if args.rope_scaling:
        argv += ["--rope-scaling", scaling_label(*args.rope_scaling)]
    if args.extra_config:
        argv += ["--extra-config", *args.extra_config]
    env = {**os.environ, "KVTRIM_CPU_FUSION": "0"} if unfused else None
    rec = harness.isolated(__file__, argv, env=env)
    return rec["wall"], rec["cpu"], rec["stats"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=3, warmup=1, warmup_help=(
        "warm-up rounds at lengths below 16k, in one process"))])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--configs", nargs="+", default=["dense", "minference", "a_shape", "vertical_slash", "block_sparse"])
    p.add_argument("--long-configs", nargs="+", default=None, help="configs at lengths >= 16k (default: all)")
    p.add_argument("--pattern-config", default=None)
    p.add_argument("--model", default=None, help="model (default: the embedded one), e.g. qwen2.5-0.5b")
    p.add_argument("--long-reps", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight and KV dtype (default float32; the sparse kernel computes scores in float32 either way)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--extra-config", nargs="*", default=[], metavar="NAME=FILE",
                   help="more per-head configs to time, each under its NAME (e.g. one not shipped yet)")
    p.add_argument("--rope-scaling", type=rope_scaling_arg, default=None, metavar="KIND:FACTOR",
                   help="this RoPE scaling at every length (kvtrim.models.extend_context; default: linear, "
                        "past the trained context only)")
    p.add_argument("--isolate", action="store_true",
                   help="run every forward in a fresh process (no order or allocator effects between configurations)")
    p.add_argument("--compare-unfused", action="store_true",
                   help=f"with --isolate: also run every config as CONFIG{UNFUSED}, on the model loaded with "
                        "KVTRIM_CPU_FUSION=0 (no fused CPU layers), interleaved with the fused one")
    p.add_argument("--one", nargs=2, metavar=("LENGTH", "CONFIG"), help=argparse.SUPPRESS)  # a child of --isolate
    args = p.parse_args(argv)
    if args.compare_unfused:
        if not args.isolate:
            p.error("--compare-unfused needs --isolate (each forward in its own process, loaded with or without fusion)")
        args.configs = [c for name in args.configs for c in (name, name + UNFUSED)]
        if args.long_configs is not None:
            args.long_configs = [c for name in args.long_configs for c in (name, name + UNFUSED)]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        return run_one(int(args.one[0]), args.one[1], args)
    if harness.start(p, args, table=table):
        return 0

    machine = harness.machine_record()
    lm, hooks, single_sizes, all_ids = build(args.pattern_config, args.model, args.dtype, tuple(args.extra_config),
                                             args.rope_scaling)
    model, mi = lm.model, hooks["minference"]
    base_ctx = int(model.config.max_position_embeddings)
    records = []
    meta = {
        "benchmark": "minference_prefill",
        "date": machine["date"],
        "machine": machine,
        "model": lm.source,
        "dtype": args.dtype,
        "rope_scaling": scaling_label(*args.rope_scaling) if args.rope_scaling else None,
        "extra_configs": {spec.partition("=")[0]: hooks[spec.partition("=")[0]].config.search for spec in args.extra_config},
        "single_pattern_sizes": single_sizes,
        "pattern_config_search": mi.config.search,
        "pattern_config_searches": [c.search for c in mi.configs],  # minference picks one per prompt length
        "isolated": bool(args.isolate),
        "cpu_layers_fused": fused_count(model),  # this process's model; a child's is in its records
        "order": "configurations interleaved; the order alternates between repetitions",
    }
    for n in args.lengths:
        scale_rope(model, n, base_ctx, args.rope_scaling)
        ids = prompt(all_ids, n)
        names = args.configs if (n < 16384 or args.long_configs is None) else args.long_configs
        reps = args.reps if n < 16384 else args.long_reps
        warm = args.warmup if n < 16384 and not args.isolate else 0
        load0 = load_average()

        def one(name: str, rep: int) -> tuple[float, float, dict]:
            r = isolated(n, name, args) if args.isolate else one_prefill(model, ids, hooks[name])
            print(f"{n} {name}: {r[0]:.2f}s wall, density {r[2]['density']:.3f}", file=sys.stderr, flush=True)
            return r

        runs = {name: [s.value for s in ss] for name, ss in harness.interleave(names, one, reps=reps, warmup=warm).items()}
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
                "loadavg": [load0, load_average()],
            }
            if all("cpu_layers_fused" in r[2] for r in rr):
                rec["cpu_layers_fused"] = rr[0][2]["cpu_layers_fused"]
            for key in ("peak_rss_mib", "forward_peak_rss_mib"):  # --isolate: one process per forward
                if all(key in r[2] for r in rr):
                    rec[key] = max(r[2][key] for r in rr)
            if dense_wall:
                rec["speedup_wall"] = dense_wall / wall
                rec["speedup_cpu"] = dense_cpu / cpu
                rec["speedup_attention"] = dense_attn / (attn + est) if attn + est > 0 else None
                rec["ideal_attention_speedup"] = 1 / rec["density"]
            records.append(rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
        harness.write_json(args.out, {**meta, "records": records})  # rewritten after every length: a long run keeps what it measured
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
    meta["machine"] = harness.finish_record(machine)
    result = {**meta, "summary": summary, "records": records}
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
