"""Time dense causal SDPA against each MInference pattern's sparse path (CPU or CUDA/Triton).

One head configuration like the embedded model (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, batch 1), random inputs. For each T: dense ``scaled_dot_product_attention``
(is_causal, enable_gqa) and, per pattern, the index estimation and the sparse attention, each
the median of ``--reps`` runs after ``--warmup`` runs. Density = executed work / dense causal work
(whole 64x64 blocks and 64-row columns, as the kernel runs them). Random q/k spread slashes and
top-k blocks uniformly, so densities here are an upper bound for real prompts.

FLOP model: dense causal = 4 * Hq * D * T^2 / 2; a sparse path does ``density`` times that.

Output: one JSON object per line (machine, versions, date in every record), then one ``summary``
line per pattern with the crossover length: the smallest measured T at which sparse (estimation
+ attention) beat dense. Examples::

    python benchmarks/bench_sparse_kernel.py --lengths 4096 8192
    python benchmarks/bench_sparse_kernel.py --lengths 8192 --cpu-kernels native torch   # CPU paths side by side
    python benchmarks/bench_sparse_kernel.py --device cuda --lengths 16384 32768 65536 --out gpu.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtrim.attention import AShape, BlockSparse, VerticalSlash, sparse_attention_cpu, sparse_prefill

PATTERNS = {
    "a_shape": lambda: AShape(n_init=1024, n_local=4096),
    "vertical_slash": lambda: VerticalSlash(k_v=1000, k_s=6096),
    "vertical_slash_small": lambda: VerticalSlash(k_v=500, k_s=200),
    "block_sparse": lambda: BlockSparse(k_b=100),
    "block_sparse_32": lambda: BlockSparse(k_b=32),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], object], warmup: int, reps: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default: float32 on CPU, float16 on CUDA")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-kernels", nargs="+", default=["native"], choices=["native", "torch"],
                   help="CPU paths to time side by side (default: native; add torch for the PyTorch fallback)")
    p.add_argument("--out", default=None, help="write JSON lines here instead of stdout")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    backend = "triton" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype or ("float16" if args.device == "cuda" else "float32"))
    meta = {
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
    }
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 - closed in the finally below
    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in args.patterns}
    try:
        for t in args.lengths:
            g = torch.Generator(device=args.device).manual_seed(args.seed)
            q = torch.randn(1, args.q_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
            k = torch.randn(1, args.kv_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
            v = torch.randn(1, args.kv_heads, t, args.head_dim, generator=g, device=args.device, dtype=dtype)
            dense_s = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), args.warmup, args.reps, args.device)  # noqa: B023 - timed in this iteration
            flops = 4 * args.q_heads * args.head_dim * t * t / 2
            rec = {**meta, "kind": "dense_sdpa", "T": t, "seconds": dense_s, "gflops_per_s": flops / dense_s / 1e9}
            print(json.dumps(rec), file=out, flush=True)
            for name in args.patterns:
                pattern = PATTERNS[name]()
                est_s = _median_time(lambda: pattern.layout(q, k), args.warmup, args.reps, args.device)  # noqa: B023 - timed now
                layout = pattern.layout(q, k)
                density = layout.density()
                kernels = args.cpu_kernels if args.device == "cpu" else ["triton"]
                for kn in kernels:
                    if kn == "triton":
                        run = lambda: sparse_prefill(q, k, v, layout, backend=backend)  # noqa: E731, B023 - timed in this iteration
                    else:
                        run = lambda kn=kn: sparse_attention_cpu(q, k, v, layout, kernel=kn)  # noqa: E731, B023 - timed in this iteration
                    attn_s = _median_time(run, args.warmup, args.reps, args.device)
                    if kn == kernels[0]:
                        results[name].append((t, est_s + attn_s, dense_s))
                    rec = {
                        **meta, "kind": name, "kernel": kn, "pattern": repr(pattern), "T": t, "density": round(density, 4),
                        "estimate_s": est_s, "attention_s": attn_s, "total_s": est_s + attn_s, "dense_s": dense_s,
                        "speedup_attention": dense_s / attn_s, "speedup_total": dense_s / (est_s + attn_s),
                        "gflops_per_s_effective": density * flops / attn_s / 1e9,
                    }
                    print(json.dumps(rec), file=out, flush=True)
        for name, rows in results.items():
            wins = [t for t, sparse_s, dense_s in rows if sparse_s < dense_s]
            rec = {**meta, "kind": "summary", "pattern": name, "crossover_T": min(wins) if wins else None,
                   "measured_T": [t for t, _, _ in rows]}
            print(json.dumps(rec), file=out, flush=True)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
