"""The fused attention kernel alone against PyTorch's SDPA, on random inputs of a model's shape.

What the fused scoring costs inside one attention call, without a model around it: PyTorch's
causal ``scaled_dot_product_attention`` (the full cache's prefill attention), kvtrim's native
fused kernel returning only the attention output (``nocol``), and the same kernel returning the
per-key column sums as well (``colsums``: what H2O and Elastic Cache's prefill uses). Queries and
keys of one batch row, ``--heads`` query heads over ``--kv-heads`` KV heads (SDPA reads the KV
heads repeated, as transformers passes them), head size ``--head-dim``; configurations interleaved
(:mod:`kvtrim.harness`), medians, the load average and the CPU's matrix flags recorded.

    OMP_NUM_THREADS=1 python benchmarks/bench_fused_kernel.py --lengths 4096 8192 --threads 1 --out results/fused_kernel.json
    python benchmarks/bench_fused_kernel.py --table benchmarks/results/fused_scoring/kernel_vs_sdpa.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvtrim import harness

CONFIGS = ("sdpa", "nocol", "colsums")


def table(res: dict) -> str:
    """Markdown: per length, median seconds of each configuration and the kernel's ratios to SDPA."""
    m = res["machine"]
    cpu = "".join(f"{m[key]}{unit}, " for key, unit in (("cpu_model", ""), ("l2_cache_kib", " KiB L2 per core")) if m.get(key))
    lines = [
        f"Causal attention of {res['heads']} query heads over {res['kv_heads']} KV heads, head size "
        f"{res['head_dim']}, {res['dtype']}, {res['threads']} thread(s), random inputs; medians of "
        f"{res['reps']} interleaved repetition(s); CPU {cpu}flags {', '.join(m.get('cpu_matrix_flags') or ['?'])}; "
        f"load average {m['loadavg_start'][0]:.1f} at the start, {m['loadavg_end'][0]:.1f} at the end.",
        "",
        "| length | SDPA s | fused, output only: s | x SDPA | fused, output + column sums: s | x SDPA |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in res["rows"]:
        med = row["median_seconds"]
        lines.append(f"| {row['length']} | {med['sdpa']:.3f} | {med['nocol']:.3f} | {med['nocol'] / med['sdpa']:.3f} | "
                     f"{med['colsums']:.3f} | {med['colsums'] / med['sdpa']:.3f} |")
    return "\n".join(lines) + (
        "\n\nx SDPA: the kernel's median seconds / SDPA's, same run. The full cache's prefill attention is SDPA; "
        "H2O's and Elastic Cache's fused prefill is the last column.")


def main(argv=None) -> int:
    from kvtrim.attention.native import load_native, native_causal_attention_scores

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=5, warmup=1, threads=1)])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads or min(args.lengths) < 1:  # before start(), which sets torch's threads
        ap.error("--heads must be a multiple of --kv-heads and every length >= 1")
    if harness.start(ap, args, table=table):
        return 0
    if not load_native():
        ap.error("kvtrim's native CPU kernel is not available (needs a C++ compiler and ninja)")
    info = harness.machine_record()
    dt = getattr(torch, args.dtype)
    rows = []
    with torch.inference_mode():
        for n in args.lengths:
            g = torch.Generator().manual_seed(n)
            q = torch.randn(1, args.heads, n, args.head_dim, generator=g).to(dt)
            k = torch.randn(1, args.kv_heads, n, args.head_dim, generator=g).to(dt)
            v = torch.randn(1, args.kv_heads, n, args.head_dim, generator=g).to(dt)
            rep = args.heads // args.kv_heads
            kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scale = args.head_dim ** -0.5

            def run(config: str, r: int, q=q, k=k, v=v, kr=kr, vr=vr, scale=scale) -> None:
                if config == "sdpa":
                    torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)
                else:
                    native_causal_attention_scores(q[0], k[0], v[0], scale, column_sums=config == "colsums")

            runs = harness.interleave(CONFIGS, run, reps=args.reps, warmup=args.warmup)
            med = {c: harness.median(s) for c, s in runs.items()}
            rows.append({"length": n, "seconds": {c: [s.seconds for s in ss] for c, ss in runs.items()},
                         "median_seconds": med})
            print(f"{n}: " + ", ".join(f"{c} {med[c]:.3f}s" for c in CONFIGS), file=sys.stderr, flush=True)
    res = {
        "benchmark": "fused_kernel",
        "command": "python benchmarks/bench_fused_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "reps": args.reps, "warmup": args.warmup,
        "rows": rows,
        "machine": harness.finish_record(dict(info)),
    }
    harness.write_json(args.out, res)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
