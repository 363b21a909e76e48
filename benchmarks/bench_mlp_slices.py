"""The fused gated MLP's slice size (``kvtrim.cpu_layers.MLP_CHUNK_ROWS``): one MLP of a model's
shapes, random bfloat16 weights, packed, over a prompt of ``--tokens`` tokens, run as
transformers runs it (three packed products, SiLU and product as separate passes), fused in one
piece, and fused in slices of each ``--slices`` size; configurations interleaved by
:mod:`kvtrim.harness`, medians of ``--reps``::

    OMP_NUM_THREADS=2 python benchmarks/bench_mlp_slices.py --threads 2 --tokens 8192 --out results/mlp_slices.json
    python benchmarks/bench_mlp_slices.py --table benchmarks/results/mlp_slices.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvtrim import cpu_layers, harness
from kvtrim.cpu_linear import PackedLinear, packing_supported
from kvtrim.errors import KVTrimError

SHAPES = {"qwen2.5-0.5b": (896, 4864), "smollm2": (576, 1536)}  # hidden, intermediate


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, gen: torch.Generator) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=torch.bfloat16)
        self.act_fn = nn.SiLU()
        with torch.no_grad():
            for lin in (self.gate_proj, self.up_proj, self.down_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * lin.in_features ** -0.5)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@torch.inference_mode()
def run(args) -> dict:
    if not packing_supported():
        raise KVTrimError("this CPU has no oneDNN bfloat16 support: nothing is fused here")
    gen = torch.Generator().manual_seed(0)
    hidden, inter = SHAPES[args.shapes]
    mlp = _MLP(hidden, inter, gen)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, PackedLinear(getattr(mlp, name)))
    fused = cpu_layers.FusedGatedMLP(mlp)
    x = torch.randn(1, args.tokens, hidden, generator=gen).to(torch.bfloat16)

    def fused_with(rows: int):
        def f():
            old = cpu_layers.MLP_CHUNK_ROWS
            cpu_layers.MLP_CHUNK_ROWS = rows
            try:
                return fused(x)
            finally:
                cpu_layers.MLP_CHUNK_ROWS = old
        return f

    fns = {"transformers (unfused)": lambda: mlp(x), "fused, one piece": fused_with(args.tokens)}
    fns.update({f"fused, slices of {n}": fused_with(n) for n in args.slices})

    def measure(name: str, rep: int) -> float:
        t0 = time.perf_counter()
        fns[name]()
        return time.perf_counter() - t0

    runs = harness.interleave(list(fns), measure, reps=args.reps, warmup=args.warmup)
    rows = [{"config": name, "ms": 1000 * statistics.median(s.value for s in ss)} for name, ss in runs.items()]
    base = rows[0]["ms"]
    for r in rows:
        r["speedup"] = base / r["ms"]
    return {"benchmark": "mlp_slices", "shapes": args.shapes, "hidden": hidden, "intermediate": inter,
            "tokens": args.tokens, "reps": args.reps, "default_slice": cpu_layers.MLP_CHUNK_ROWS, "rows": rows}


def table(d: dict) -> str:
    m = d["machine"]
    lines = [f"One gated MLP of {d['shapes']}'s shapes ({d['hidden']} -> {d['intermediate']} -> {d['hidden']}), random bfloat16 "
             f"weights packed, {d['tokens']} tokens; {harness.machine_line(m, m['torch_threads'])}, {m['date'][:10]}; "
             f"median of {d['reps']} interleaved rounds. kvtrim's slice: {d['default_slice']} tokens.", "",
             "| MLP | ms | faster than transformers' |", "|---|---:|---:|"]
    lines += [f"| {r['config']} | {r['ms']:.1f} | {r['speedup']:.2f}x |" for r in d["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=7, warmup=1, threads=2)])
    p.add_argument("--shapes", default="qwen2.5-0.5b", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--slices", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    record = harness.machine_record()
    harness.publish(args.out, run(args), record, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
