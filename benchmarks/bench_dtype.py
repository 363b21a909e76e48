"""bfloat16 against float32 on CPU: a whole-model prefill, and kvtrim's native sparse kernel.

1. Prefill: the model loaded twice (``kvtrim.models.load_model(dtype=...)``), one ``--length``-token
   prompt (the bench pass-key prompt) prefilled by each, interleaved by :mod:`kvtrim.harness`
   (``--warmup`` rounds, then ``--reps`` rounds, the order alternating); dense SDPA attention,
   only the last position's logits computed.
2. Kernel: kvtrim's native CPU sparse kernel on random ``[1, 14, T, 64]`` queries and
   ``[1, 2, T, 64]`` keys/values (Qwen2.5-Coder-0.5B-Instruct's heads) with one vertical-slash layout, in
   float32, in bfloat16 as the kernel now reads it (in place, float32 tiles inside), and in
   bfloat16 the way it ran before (whole q/k/v converted to float32 copies, the output converted
   back); dense causal SDPA in both dtypes beside them. All interleaved.

Medians (min/max/all kept). The load average is recorded before and after: on a shared machine
the absolute times mean little, the ratios within one run a little more. Example::

    python benchmarks/bench_dtype.py --model qwen2.5-0.5b --length 2048 --kernel-length 4096 \\
        --reps 2 --threads 1 --out benchmarks/results/bf16_quality/timing.json
    python benchmarks/bench_dtype.py --table benchmarks/results/bf16_quality/timing.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvtrim import harness

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def table(result: dict) -> str:
    lines = ["| what | config | median s | vs float32 |", "|---|---|---:|---:|"]
    for part in ("prefill", "kernel"):
        rows = result.get(part, {})
        base = rows.get("float32", rows.get("native float32", {})).get("median")
        for name, st in rows.items():
            ratio = f"{st['median'] / base:.2f}x" if base else ""
            lines.append(f"| {part} | {name} | {st['median']:.3f} | {ratio} |")
    m = result["machine"]
    lines.append(f"\n{result['model']}, prefill {result['length']} tokens, kernel T={result['kernel_length']} "
                 f"(density {result['kernel_density']:.3f}); {result['threads']} threads; load "
                 f"{m['loadavg_start'][0]:.1f} before, {m['loadavg_end'][0]:.1f} after.")
    return "\n".join(lines)


def prefill_part(args) -> tuple[dict, str]:
    from kvtrim.eval.tasks import passkey
    from kvtrim.models import build_prompt_ids, load_model

    lms = {name: load_model(args.model, dtype=dt) for name, dt in DTYPES.items()}
    tok = lms["float32"].tokenizer
    ids = torch.tensor([build_prompt_ids(tok, passkey(tok, args.length, depth=0.5, seed=0).prompt)])  # as kvtrim bench

    def run(name: str, rep: int) -> None:
        with torch.no_grad():
            lms[name].model(input_ids=ids, use_cache=False, logits_to_keep=1)

    samples = harness.interleave(list(DTYPES), run, reps=args.reps, warmup=args.warmup)
    return {name: harness.stats(s) for name, s in samples.items()}, lms["float32"].source


def kernel_part(args) -> tuple[dict, float]:
    from kvtrim.attention import VerticalSlash, sparse_attention_cpu
    from kvtrim.attention.native import load_native

    if not load_native():
        return {}, float("nan")
    t = args.kernel_length
    g = torch.Generator().manual_seed(0)
    q32, k32, v32 = (torch.randn(1, h, t, 64, generator=g) for h in (14, 2, 2))
    layout = VerticalSlash(k_v=500, k_s=200).layout(q32, k32)
    bf = {n: x.bfloat16() for n, x in (("q", q32), ("k", k32), ("v", v32))}

    def run(name: str, rep: int) -> None:
        if name == "native float32":
            sparse_attention_cpu(q32, k32, v32, layout, kernel="native")
        elif name == "native bfloat16 (in place)":
            sparse_attention_cpu(bf["q"], bf["k"], bf["v"], layout, kernel="native")
        elif name == "native bfloat16 (float32 copies, as before)":
            sparse_attention_cpu(bf["q"].float(), bf["k"].float(), bf["v"].float(), layout, kernel="native").bfloat16()
        elif name == "dense SDPA float32":
            torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
        else:
            torch.nn.functional.scaled_dot_product_attention(bf["q"], bf["k"], bf["v"], is_causal=True, enable_gqa=True)

    names = ["native float32", "native bfloat16 (in place)", "native bfloat16 (float32 copies, as before)",
             "dense SDPA float32", "dense SDPA bfloat16"]
    samples = harness.interleave(names, run, reps=max(3, args.reps), warmup=1)
    return {name: harness.stats(s) for name, s in samples.items()}, float(layout.density())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=2, warmup=1, threads=1)])
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.add_argument("--length", type=int, default=2048, help="prefill prompt tokens (default 2048)")
    p.add_argument("--kernel-length", type=int, default=4096, help="T of the kernel part (default 4096)")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    machine = harness.machine_record()
    kernel, density = kernel_part(args)
    prefill, source = prefill_part(args)
    result = {"what": "bf16 vs fp32 on CPU: model prefill (dense SDPA) and the native sparse kernel",
              "command": " ".join([sys.executable, *sys.argv]), "model": source, "length": args.length,
              "kernel_length": args.kernel_length, "kernel_density": density, "threads": torch.get_num_threads(),
              "prefill": prefill, "kernel": kernel, "machine": harness.finish_record(machine)}
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
