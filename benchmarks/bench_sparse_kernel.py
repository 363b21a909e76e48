"""Time dense causal SDPA against each MInference pattern's sparse path (CPU or CUDA/Triton).

One head configuration like the embedded model (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, batch 1), random inputs. For each T: dense ``scaled_dot_product_attention``
(is_causal, enable_gqa) and, per pattern, the index estimation and the sparse attention; all these
functions are interleaved by :mod:`kvtrim.harness` (``--warmup`` rounds, then ``--reps`` rounds,
the order alternating), each reported as its median (min/max/all in the record). Density =
executed work / dense causal work (whole 64x64 blocks and 64-row columns, as the kernel runs
them). Random q/k spread slashes and top-k blocks uniformly, so densities here are an upper bound
for real prompts.

FLOP model: dense causal = 4 * Hq * D * T^2 / 2; a sparse path does ``density`` times that.

Output (``--out``, JSON lines): one record per timed function (the machine record in the first
line), then one ``summary`` line per pattern with the crossover length: the smallest measured T at
which sparse (estimation + attention) beat dense. Examples::

    python benchmarks/bench_sparse_kernel.py --lengths 8192 --cpu-kernels native torch --out results/cpu_kernel.jsonl
    python benchmarks/bench_sparse_kernel.py --table benchmarks/results/cpu_kernel.jsonl     # markdown table
    python benchmarks/bench_sparse_kernel.py --device cuda --lengths 16384 32768 65536 --out results/gpu_kernel.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from kvtrim import harness
from kvtrim.attention import AShape, BlockSparse, VerticalSlash, dense_layout, sparse_attention_cpu, sparse_prefill


class AllBlocks:
    """Every causal block listed (density 1): the kernel's rate per unit of work against SDPA's."""

    def layout(self, q, k):
        return dense_layout(q.shape[0], q.shape[1], q.shape[2], device=q.device)

    def __repr__(self) -> str:
        return "AllBlocks()"


PATTERNS = {
    "all_blocks": AllBlocks,
    "a_shape": lambda: AShape(n_init=1024, n_local=4096),
    "vertical_slash": lambda: VerticalSlash(k_v=1000, k_s=6096),
    "vertical_slash_small": lambda: VerticalSlash(k_v=500, k_s=200),
    "block_sparse": lambda: BlockSparse(k_b=100),
    "block_sparse_32": lambda: BlockSparse(k_b=32),
}


def cpu_attention(q, k, v, layout, kernel: str):
    """One CPU path: ``native``, ``native-ungrouped`` (the native kernel with
    ``KVTRIM_NATIVE_QUERY_GROUPS=0`` for this call: one query block per task) or ``torch``."""
    if kernel != "native-ungrouped":
        return sparse_attention_cpu(q, k, v, layout, kernel=kernel)
    os.environ["KVTRIM_NATIVE_QUERY_GROUPS"] = "0"
    try:
        return sparse_attention_cpu(q, k, v, layout, kernel="native")
    finally:
        del os.environ["KVTRIM_NATIVE_QUERY_GROUPS"]


def table(records: list[dict]) -> str:
    """Markdown table of a kernel result (JSON lines)."""
    lines = ["| T | dtype | path | kernel | density | estimate s | attention s | attention speed-up | GFLOP/s (executed) | rate vs SDPA |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    head = []
    for i, r in enumerate(records):  # one machine line per run (a file may hold several runs, e.g. one per dtype)
        if "machine" in r:
            end = next((x["loadavg_end"] for x in records[i:] if x.get("kind") == "summary" and "loadavg_end" in x), None)
            m = dict(r["machine"], loadavg_end=end or r["machine"]["loadavg_start"])
            head.append(f"- {r.get('dtype', '')} run, {m['date'][:10]}: {harness.machine_line(m, r.get('threads', m.get('torch_threads')))}")
    if head:
        lines = head + [""] + lines
    sdpa = {}
    for r in records:
        dt = r.get("dtype", "")
        if r.get("kind") == "dense_sdpa":
            sdpa[(r["T"], dt)] = r["gflops_per_s"]
            lines.append(f"| {r['T']} | {dt} | dense SDPA | torch | 1.000 | | {r['seconds']:.3f} | 1.00x | {r['gflops_per_s']:.0f} | 1.00 |")
        elif r.get("kind") not in (None, "summary"):
            rate = r["gflops_per_s_effective"] / sdpa[(r["T"], dt)] if (r["T"], dt) in sdpa else float("nan")
            lines.append(f"| {r['T']} | {dt} | {r['kind']} | {r['kernel']} | {r['density']:.3f} | {r['estimate_s']:.3f} | "
                         f"{r['attention_s']:.3f} | {r['speedup_attention']:.2f}x | {r['gflops_per_s_effective']:.0f} | {rate:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=3, warmup=1, out_help="write the JSON lines here")])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--patterns", nargs="+", default=[n for n in PATTERNS if n != "all_blocks"], choices=list(PATTERNS),
                   help="all_blocks: every causal block through the sparse kernel (its rate against SDPA's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default: float32 on CPU, float16 on CUDA")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-kernels", nargs="+", default=["native"], choices=["native", "native-ungrouped", "torch"],
                   help="CPU paths to time side by side (default: native; native-ungrouped: the native kernel with "
                        "one query block per task, KVTRIM_NATIVE_QUERY_GROUPS=0; torch: the PyTorch fallback)")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    open(args.out, "w").close()  # the lines are appended as they are measured (--force: replace the old file)

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    backend = "triton" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype or ("float16" if args.device == "cuda" else "float32"))
    machine = harness.machine_record()
    meta = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "date": machine["date"],
        "threads": machine["torch_threads"],
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
    }

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in args.patterns}
    kernels = args.cpu_kernels if args.device == "cpu" else ["triton"]
    first = True
    for t in args.lengths:
        g = torch.Generator(device=args.device).manual_seed(args.seed)
        q = torch.randn(1, args.q_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
        v = torch.randn(1, args.kv_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
        patterns = {name: PATTERNS[name]() for name in args.patterns}
        layouts = {name: pat.layout(q, k) for name, pat in patterns.items()}
        fns = {"dense": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
        for name, pat in patterns.items():
            fns[f"estimate:{name}"] = lambda pat=pat: pat.layout(q, k)
            for kn in kernels:
                if kn == "triton":
                    fns[f"attention:{name}:{kn}"] = lambda lay=layouts[name]: sparse_prefill(q, k, v, lay, backend=backend)
                else:
                    fns[f"attention:{name}:{kn}"] = lambda lay=layouts[name], kn=kn: cpu_attention(q, k, v, lay, kn)

        def timed(fn_name: str, rep: int) -> None:
            fns[fn_name]()
            sync()

        sync()
        st = {n: harness.stats(ss) for n, ss in harness.interleave(list(fns), timed, reps=args.reps, warmup=args.warmup).items()}
        flops = 4 * args.q_heads * args.head_dim * t * t / 2
        dense_s = st["dense"]["median"]
        recs = [{**meta, "kind": "dense_sdpa", "T": t, "seconds": dense_s, "seconds_all": st["dense"]["all"],
                 "gflops_per_s": flops / dense_s / 1e9}]
        for name, pat in patterns.items():
            est_s, density = st[f"estimate:{name}"]["median"], layouts[name].density()
            for kn in kernels:
                a = st[f"attention:{name}:{kn}"]
                attn_s = a["median"]
                if kn == kernels[0]:
                    results[name].append((t, est_s + attn_s, dense_s))
                recs.append({
                    **meta, "kind": name, "kernel": kn, "pattern": repr(pat), "T": t, "density": round(density, 4),
                    "estimate_s": est_s, "attention_s": attn_s, "attention_s_all": a["all"], "total_s": est_s + attn_s,
                    "dense_s": dense_s, "speedup_attention": dense_s / attn_s, "speedup_total": dense_s / (est_s + attn_s),
                    "gflops_per_s_effective": density * flops / attn_s / 1e9,
                })
        for rec in recs:
            if first:
                rec = {"machine": machine, **rec}
                first = False
            harness.append_jsonl(args.out, rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
    for name, rows in results.items():
        wins = [t for t, sparse_s, dense_s in rows if sparse_s < dense_s]
        rec = {**meta, "kind": "summary", "pattern": name, "crossover_T": min(wins) if wins else None,
               "measured_T": [t for t, _, _ in rows], "loadavg_end": harness.finish_record(machine)["loadavg_end"]}
        harness.append_jsonl(args.out, rec)
    print(table(harness.read_result(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
