"""A decode step's attention on CPU: PyTorch's SDPA against kvtrim's grouped decode attention.

One decode query per head over every stored key, with grouped KV heads (GQA), is what each layer of
a decode step computes. On CPU, ``torch.nn.functional.scaled_dot_product_attention`` for that one
row is slow, most of all in bfloat16; :func:`kvtrim.scores.decode_attention` computes the same
thing as two float32 products over each KV head's group of query heads (``q [G, D] @ K^T``, softmax,
``p @ V``), reading each key and value once. kvtrim takes it for every CPU decode step inside
``kvtrim.attach`` (``KVTRIM_DECODE_ATTENTION=sdpa`` restores SDPA).

Two parts, both timed on this machine with ``--threads`` torch threads, configurations interleaved:

* ``kernel``: random tensors of a model's shapes (``--shapes``: query heads / KV heads / head dim)
  at ``--lengths`` stored tokens, float32 and bfloat16: median ms of one call, times ``layers``
  for a step's attention, and each one's largest error against float64 from the same rounded inputs;
* ``model`` (with ``--model``): a real model in ``--dtype``, a full cache filled by one prefill of
  ``--model-lengths`` random tokens, then decode steps alternating between the two attentions on
  that cache (``--steps`` each per round, ``--reps`` rounds): median ms per whole decode step.

    python benchmarks/bench_decode_attention.py --threads 2 --out results/decode_attention.json
    python benchmarks/bench_decode_attention.py --model qwen2.5-0.5b --dtype bfloat16 --out results/decode_attention_qwen.json
    python benchmarks/bench_decode_attention.py --table benchmarks/results/decode_attention/epyc.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kvtrim import harness
from kvtrim.scores import decode_attention

#: name: (query heads, KV heads, head dim, layers)
SHAPES = {"qwen2.5-0.5b": (14, 2, 64, 24), "smollm2": (9, 3, 64, 30)}


def sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)


def kvtrim_decode(q, k, v, scale):
    return decode_attention(q, k, v, scale)[0]


def kernel_rows(args) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name in args.shapes:
        hq, hkv, d, layers = SHAPES[name]
        for n in args.lengths:
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(1, hq, 1, d, generator=gen).to(dtype)
                k, v = (torch.randn(1, hkv, n, d, generator=gen).to(dtype) for _ in range(2))
                scale = d ** -0.5
                ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(hq // hkv, 1),
                                                     v.double().repeat_interleave(hq // hkv, 1), scale=scale).transpose(1, 2)
                fns = {"sdpa": lambda q=q, k=k, v=v: sdpa(q, k, v, scale),
                       "kvtrim": lambda q=q, k=k, v=v: kvtrim_decode(q, k, v, scale)}
                err = {c: float((f().double() - ref).abs().max()) for c, f in fns.items()}
                samples = harness.interleave(list(fns), lambda c, r: harness.per_call(fns[c], args.calls), reps=args.reps, warmup=1)
                med = {c: harness.median([s.value for s in samples[c]]) for c in fns}
                row = {"shape": name, "stored": n, "dtype": str(dtype).removeprefix("torch."), "layers": layers,
                       "sdpa_ms": 1000 * med["sdpa"], "kvtrim_ms": 1000 * med["kvtrim"],
                       "sdpa_step_ms": 1000 * med["sdpa"] * layers, "kvtrim_step_ms": 1000 * med["kvtrim"] * layers,
                       "speedup": med["sdpa"] / med["kvtrim"], "sdpa_err": err["sdpa"], "kvtrim_err": err["kvtrim"]}
                rows.append(row)
                print(f"{name} {n} {row['dtype']}: sdpa {row['sdpa_step_ms']:.1f} ms/step, kvtrim "
                      f"{row['kvtrim_step_ms']:.1f} ({row['speedup']:.2f}x)", file=sys.stderr, flush=True)
    return rows


@torch.inference_mode()
def model_rows(args) -> tuple[str, list[dict]]:
    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache
    from kvtrim.integrations.hf import attach
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    lm = load_model(args.model, dtype=args.dtype)
    model = lm.model
    rows = []
    for n in args.model_lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        saved = os.environ.get("KVTRIM_DECODE_ATTENTION")
        with attach(model):
            cache = KVTrimCache(model, create_policy("full"))
            logits = decoding.run(model, decoding.prefill(cache, ids))

            def steps(config: str, rep: int, cache=cache, logits=logits) -> list[float]:
                """``--steps`` decode steps on the shared cache with one attention; their seconds."""
                os.environ["KVTRIM_DECODE_ATTENTION"] = "sdpa" if config == "sdpa" else "auto"
                got: list[float] = []
                decoding.run(model, decoding.decode(cache, logits, args.steps + 1), on_step=lambda s, t: got.append(t))
                return got

            try:
                samples = harness.interleave(["sdpa", "kvtrim"], steps, reps=args.reps, warmup=1)
            finally:  # the caller's setting back
                if saved is None:
                    os.environ.pop("KVTRIM_DECODE_ATTENTION", None)
                else:
                    os.environ["KVTRIM_DECODE_ATTENTION"] = saved
        times = {c: [t for s in samples[c] for t in s.value] for c in samples}
        med = {c: harness.median(v) for c, v in times.items()}
        row = {"stored": n, "dtype": args.dtype, "sdpa_step_ms": 1000 * med["sdpa"], "kvtrim_step_ms": 1000 * med["kvtrim"],
               "speedup": med["sdpa"] / med["kvtrim"], "steps_each": len(times["sdpa"])}
        rows.append(row)
        print(f"{lm.source} {n}: sdpa {row['sdpa_step_ms']:.1f} ms/step, kvtrim {row['kvtrim_step_ms']:.1f} "
              f"({row['speedup']:.2f}x)", file=sys.stderr, flush=True)
    return lm.source, rows


def table(d: dict) -> str:
    head = (f"{harness.machine_line(d['machine'], d['args']['threads'])}, {d['date'][:10]}; medians of {d['args']['reps']} "
            "interleaved rounds.")
    lines = [head, ""]
    if d.get("kernel"):
        lines += ["| shape (q / KV heads, layers) | stored tokens | dtype | SDPA ms per step | kvtrim ms per step | "
                  "faster | SDPA max error | kvtrim max error |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in d["kernel"]:
            hq, hkv, _, layers = SHAPES[r["shape"]]
            lines.append(f"| {r['shape']} ({hq} / {hkv}, {layers}) | {r['stored']} | {r['dtype']} | {r['sdpa_step_ms']:.1f} | "
                         f"{r['kvtrim_step_ms']:.1f} | {r['speedup']:.2f}x | {r['sdpa_err']:.1e} | {r['kvtrim_err']:.1e} |")
    if d.get("model_rows"):
        lines += ["", f"Whole decode steps of {d['model']} ({d['model_rows'][0]['dtype']}), full cache:", "",
                  "| stored tokens | SDPA ms per step | kvtrim ms per step | faster | steps each |", "|---:|---:|---:|---:|---:|"]
        for r in d["model_rows"]:
            lines.append(f"| {r['stored']} | {r['sdpa_step_ms']:.1f} | {r['kvtrim_step_ms']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['steps_each']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 parents=[harness.options(reps=5, warmup=None, threads=2)])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 8192, 32768])
    ap.add_argument("--calls", type=int, default=20, help="calls per timed sample (kernel part)")
    ap.add_argument("--model", default=None, help="also time whole decode steps of this model")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model-lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per configuration per round (model part)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    out: dict = {"benchmark": "decode_attention", "date": machine["date"], "machine": machine,
                 "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")}}
    out["kernel"] = kernel_rows(args) if args.shapes and args.lengths else []
    if args.model:
        out["model"], out["model_rows"] = model_rows(args)
    harness.publish(args.out, out, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
