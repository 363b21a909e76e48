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

3. Phases (``--phases``): ``--dtype auto`` beside the fixed dtypes. Each of ``--configs`` (``float32``,
   ``bfloat16``, ``auto``, and ``auto-mixed``: auto forced by ``KVTRIM_AUTO_DTYPE=mixed`` onto the plan it
   picks on a CPU without bfloat16 arithmetic, bfloat16 weights and KV with a float32 prefill, so it
   can be timed on any CPU) loaded once; per round one ``kvtrim.generate_ids`` run of the full cache on
   the ``--length``-token prompt with ``--new-tokens`` greedy tokens: its prefill seconds and its
   decode milliseconds per token, interleaved. Each config's resolved plan (storage / prefill /
   decode dtype, and why) is recorded.

Medians (min/max/all kept). The load average is recorded before and after: on a shared machine
the absolute times mean little, the ratios within one run a little more. Example::

    python benchmarks/bench_dtype.py --model qwen2.5-0.5b --length 2048 --kernel-length 4096 \\
        --reps 2 --threads 1 --out benchmarks/results/bf16_quality/timing.json
    python benchmarks/bench_dtype.py --table benchmarks/results/bf16_quality/timing.json
    python benchmarks/bench_dtype.py --phases --no-kernel --length 2048 --new-tokens 16 --reps 3 --threads 1 \
        --out benchmarks/results/dtype_auto/smollm2_amx.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kvtrim import harness

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


#: ``--configs`` of the phases part: a dtype name for load_model, and the KVTRIM_AUTO_DTYPE value it loads under
PHASE_CONFIGS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "auto": ("auto", None),
                 "auto-mixed": ("auto", "mixed")}


def phases_table(result: dict) -> str:
    ph = result["phases"]
    base = ph["rows"].get("float32")
    lines = ["| config | storage | prefill computes in | decode computes in | prefill s | vs float32 | decode ms/token "
             "| vs float32 | KV MiB |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for name, row in ph["rows"].items():
        d = row["dtypes"]
        pre, dec = row["prefill_s"]["median"], row["decode_ms"]["median"]
        rp = f"{pre / base['prefill_s']['median']:.2f}x" if base else ""
        rd = f"{dec / base['decode_ms']['median']:.2f}x" if base else ""
        lines.append(f"| {name} | {d['storage']} | {d['prefill']} | {d['decode']} | {pre:.2f} | {rp} | {dec:.1f} | {rd} "
                     f"| {row['kv_bytes'] / 2**20:.1f} |")
    m = result["machine"]
    flags = ", ".join(m.get("cpu_matrix_flags") or []) or "flags unknown"
    lines.append(f"\n{result['model']}, {ph['prompt_tokens']}-token prompt, {ph['new_tokens']} new tokens, full cache; "
                 f"{result['threads']} thread(s); {m.get('cpu_model') or m.get('processor')} ({flags}); torch "
                 f"{m['torch']}; load {m['loadavg_start'][0]:.1f} before, {m['loadavg_end'][0]:.1f} after; "
                 f"{m['date'][:10]}; medians of {ph['reps']} interleaved rounds after {ph['warmup']} warm-up. "
                 "vs float32: time / float32's (below 1: faster). auto-mixed: auto forced (KVTRIM_AUTO_DTYPE=mixed) "
                 "onto the plan of a CPU without bfloat16 arithmetic.")
    for name, row in ph["rows"].items():
        lines.append(f"{name}: {row['dtypes']['reason']}.")
    return "\n".join(lines)


def table(result: dict) -> str:
    if "phases" in result and not result.get("prefill") and not result.get("kernel"):
        return phases_table(result)
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


def phases_part(args) -> tuple[dict, str]:
    from kvtrim import create_policy, generate_ids
    from kvtrim.eval.tasks import passkey
    from kvtrim.models import AUTO_ENV, build_prompt_ids, load_model

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in PHASE_CONFIGS]
    if bad or not names:
        raise SystemExit(f"--configs takes {', '.join(PHASE_CONFIGS)}; got {args.configs!r}")
    lms = {}
    for name in names:
        dtype, env = PHASE_CONFIGS[name]
        before = os.environ.pop(AUTO_ENV, None)
        if env is not None:
            os.environ[AUTO_ENV] = env
        try:
            lms[name] = load_model(args.model, dtype=dtype)
        finally:
            os.environ.pop(AUTO_ENV, None)
            if before is not None:
                os.environ[AUTO_ENV] = before
    tok = next(iter(lms.values())).tokenizer
    ids = build_prompt_ids(tok, passkey(tok, args.length, depth=0.5, seed=0).prompt)
    kv: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}

    def run(name: str, rep: int) -> dict:
        r = generate_ids(lms[name].model, tok, ids, create_policy("full"), max_new_tokens=args.new_tokens,
                         stop_at_eos=False)
        kv[name], tokens[name] = r.kv_bytes, r.token_ids
        return {"prefill_s": r.prefill_seconds, "decode_ms": 1000 * r.decode_seconds / max(1, r.decode_steps)}

    samples = harness.interleave(names, run, reps=args.reps, warmup=args.warmup)
    rows = {}
    for name in names:
        vals = [smp.value for smp in samples[name]]
        rows[name] = {"dtypes": lms[name].dtypes.names(), "kv_bytes": kv[name],
                      "prefill_s": harness.stats([v["prefill_s"] for v in vals]),
                      "decode_ms": harness.stats([v["decode_ms"] for v in vals]),
                      "same_tokens_as_float32": tokens[name] == tokens.get("float32", tokens[name])}
    return {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "reps": args.reps, "warmup": args.warmup,
            "rows": rows}, next(iter(lms.values())).source


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
    p.add_argument("--phases", action="store_true",
                   help="time prefill and decode per --configs through kvtrim.generate_ids (instead of the prefill part)")
    p.add_argument("--configs", default=",".join(PHASE_CONFIGS), help="with --phases: comma-separated, of "
                   f"{', '.join(PHASE_CONFIGS)} (default: all)")
    p.add_argument("--new-tokens", type=int, default=16, help="with --phases: greedy tokens per run (default 16)")
    p.add_argument("--no-kernel", action="store_true", help="skip the native kernel part")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    machine = harness.machine_record()
    kernel, density = ({}, float("nan")) if args.no_kernel else kernel_part(args)
    phases = None
    if args.phases:
        phases, source = phases_part(args)
        prefill: dict = {}
    else:
        prefill, source = prefill_part(args)
    result = {"what": "bf16 vs fp32 on CPU: model prefill (dense SDPA) and the native sparse kernel"
                      + ("; prefill and decode per --dtype, auto included" if phases else ""),
              "command": " ".join([sys.executable, *sys.argv]), "model": source, "length": args.length,
              "kernel_length": args.kernel_length, "kernel_density": density, "threads": torch.get_num_threads(),
              "prefill": prefill, "kernel": kernel, "machine": harness.finish_record(machine)}
    if phases is not None:
        result["phases"] = phases
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
