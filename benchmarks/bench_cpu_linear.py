"""Linear layers on CPU in bfloat16: ``F.linear`` on the plain weight against kvtrim's packed linear.

``kvtrim.load_model`` packs a bfloat16 CPU model's linear weights into oneDNN's layout once
(:mod:`kvtrim.cpu_linear`); this measures what that changes, on this machine, configurations
interleaved, ``--threads`` torch threads:

* ``kernel``: random bfloat16 weights of each linear of a model's shapes (``--shapes``) times
  ``--rows`` input rows (1 = a decode step; more = a prefill's chunk): median ms of one product
  each way, each one's largest error against float64 from the same rounded inputs, and per model
  the sum over one forward's linears (every layer's seven, and the output projection);
* ``model`` (with ``--model``): the model loaded twice in bfloat16, plain and packed, each with a
  full cache filled by one prefill of the same ``--model-lengths`` random tokens, then decode
  steps alternating between the two (``--steps`` each per round, ``--reps`` rounds): median ms
  per whole decode step.

    python benchmarks/bench_cpu_linear.py --threads 2 --out results/cpu_linear/epyc.json --model qwen2.5-0.5b
    python benchmarks/bench_cpu_linear.py --table benchmarks/results/cpu_linear/epyc.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from kvtrim import harness
from kvtrim.cpu_linear import PackedLinear, packed_count, packing_supported

#: name: (hidden, intermediate, query heads, KV heads, head dim, layers, vocabulary, output tied)
SHAPES = {"qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24, 151936, False),
          "smollm2": (576, 1536, 9, 3, 64, 30, 49152, True)}


def linears(name: str) -> list[tuple[str, int, int, bool, int]]:
    """``(linear, out, in, bias, times per forward)`` of one forward of the model ``name``."""
    h, inter, hq, hkv, d, layers, vocab, _ = SHAPES[name]
    bias = name.startswith("qwen")  # Qwen2's q/k/v projections have a bias
    return [("q_proj", hq * d, h, bias, layers), ("k_proj", hkv * d, h, bias, layers), ("v_proj", hkv * d, h, bias, layers),
            ("o_proj", h, hq * d, False, layers), ("gate_proj", inter, h, False, layers),
            ("up_proj", inter, h, False, layers), ("down_proj", h, inter, False, layers), ("lm_head", vocab, h, False, 1)]


@torch.inference_mode()
def kernel_rows(args) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name in args.shapes:
        for lin_name, n_out, n_in, bias, times in linears(name):
            lin = nn.Linear(n_in, n_out, bias=bias, dtype=torch.bfloat16)
            lin.weight.copy_(torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5)
            packed = PackedLinear(lin)
            for rows_in in args.rows:
                x = torch.randn(1, rows_in, n_in, generator=gen).to(torch.bfloat16)
                ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
                fns = {"plain": lambda x=x, lin=lin: lin(x), "packed": lambda x=x, p=packed: p(x)}
                err = {c: float((f().double() - ref).abs().max()) for c, f in fns.items()}
                calls = max(1, args.calls // rows_in)
                samples = harness.interleave(list(fns), lambda c, r: harness.per_call(fns[c], calls), reps=args.reps, warmup=1)
                med = {c: harness.median([s.value for s in samples[c]]) for c in fns}
                rows.append({"shape": name, "linear": lin_name, "out": n_out, "in": n_in, "rows": rows_in,
                             "per_forward": times, "plain_ms": 1000 * med["plain"], "packed_ms": 1000 * med["packed"],
                             "speedup": med["plain"] / med["packed"], "plain_err": err["plain"], "packed_err": err["packed"]})
                r = rows[-1]
                print(f"{name} {lin_name} {n_out}x{n_in} rows {rows_in}: plain {r['plain_ms']:.3f} ms, packed "
                      f"{r['packed_ms']:.3f} ({r['speedup']:.2f}x)", file=sys.stderr, flush=True)
    return rows


def forward_sums(rows: list[dict]) -> list[dict]:
    """Per model and row count: ms of one forward's linears, plain and packed (the output
    projection counted once; for a tied one, as the default leaves it, plain both ways)."""
    out = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        tied = SHAPES[name][7]
        for n in dict.fromkeys(r["rows"] for r in rows if r["shape"] == name):
            sel = [r for r in rows if r["shape"] == name and r["rows"] == n]
            plain = sum(r["plain_ms"] * r["per_forward"] for r in sel)
            packed = sum((r["plain_ms"] if tied and r["linear"] == "lm_head" else r["packed_ms"]) * r["per_forward"]
                         for r in sel)
            out.append({"shape": name, "rows": n, "plain_ms": plain, "packed_ms": packed, "speedup": plain / packed,
                        "lm_head_packed": not tied})
    return out


@torch.inference_mode()
def model_rows(args) -> tuple[str, list[dict], dict]:
    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache
    from kvtrim.integrations.hf import attach
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    lms = {"plain": load_model(args.model, dtype="bfloat16", pack_linears=False),
           "packed": load_model(args.model, dtype="bfloat16")}
    counts = {c: packed_count(lm.model)[0] for c, lm in lms.items()}
    rows = []
    for n in args.model_lengths:
        ids = torch.randint(0, lms["plain"].model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        state: dict = {}
        for c, lm in lms.items():
            with attach(lm.model):
                cache = KVTrimCache(lm.model, create_policy("full"))
                state[c] = (cache, decoding.run(lm.model, decoding.prefill(cache, ids)))
        same = bool(torch.equal(state["plain"][1].argmax(-1), state["packed"][1].argmax(-1)))

        def steps(config: str, rep: int) -> list[float]:
            """``--steps`` decode steps of one model on its own cache; their seconds."""
            model = lms[config].model
            cache, logits = state[config]
            got: list[float] = []
            with attach(model):
                decoding.run(model, decoding.decode(cache, logits, args.steps + 1), on_step=lambda s, t: got.append(t))
            return got

        samples = harness.interleave(["plain", "packed"], steps, reps=args.reps, warmup=1)
        times = {c: [t for s in samples[c] for t in s.value] for c in samples}
        med = {c: harness.median(v) for c, v in times.items()}
        rows.append({"stored": n, "plain_step_ms": 1000 * med["plain"], "packed_step_ms": 1000 * med["packed"],
                     "speedup": med["plain"] / med["packed"], "steps_each": len(times["plain"]),
                     "same_next_token": same})
        r = rows[-1]
        print(f"{lms['plain'].source} {n}: plain {r['plain_step_ms']:.1f} ms/step, packed {r['packed_step_ms']:.1f} "
              f"({r['speedup']:.2f}x)", file=sys.stderr, flush=True)
        state.clear()  # both caches freed before the next length
    return lms["plain"].source, rows, counts


def table(d: dict) -> str:
    head = (f"{harness.machine_line(d['machine'], d['args']['threads'])}, {d['date'][:10]}; medians of {d['args']['reps']} "
            "interleaved rounds; bfloat16.")
    lines = [head, ""]
    if d.get("kernel"):
        lines += ["| model | input rows | linears of one forward, plain ms | packed ms | faster |",
                  "|---|---:|---:|---:|---:|"]
        for r in d["forward_sums"]:
            note = "" if r["lm_head_packed"] else " (tied output projection left plain)"
            lines.append(f"| {r['shape']}{note} | {r['rows']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | {r['speedup']:.2f}x |")
        worst = max(r["packed_err"] / max(r["plain_err"], 1e-30) for r in d["kernel"])
        lines += ["", f"Largest error against float64, packed over plain, across all {len(d['kernel'])} products: "
                      f"{worst:.2f}x."]
    if d.get("model_rows"):
        lines += ["", f"Whole decode steps of {d['model']} (bfloat16, full cache; {d['packed_linears']['packed']} "
                      "linears packed):", "",
                  "| stored tokens | plain ms per step | packed ms per step | faster | steps each | same next token |",
                  "|---:|---:|---:|---:|---:|---|"]
        for r in d["model_rows"]:
            lines.append(f"| {r['stored']} | {r['plain_step_ms']:.1f} | {r['packed_step_ms']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['steps_each']} | {'yes' if r['same_next_token'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 parents=[harness.options(reps=5, warmup=None, threads=2)])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 512])
    ap.add_argument("--calls", type=int, default=20, help="products per timed sample at 1 row (fewer for more rows)")
    ap.add_argument("--model", default=None, help="also time whole decode steps of this model, plain and packed")
    ap.add_argument("--model-lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per configuration per round (model part)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    if not packing_supported():
        print("kvtrim: error: this CPU has no oneDNN bfloat16 support, nothing is packed here", file=sys.stderr)
        return 2
    machine = harness.machine_record()
    out: dict = {"benchmark": "cpu_linear", "date": machine["date"], "machine": machine,
                 "args": {k: v for k, v in vars(args).items() if k not in ("table", "force")}}
    out["kernel"] = kernel_rows(args) if args.shapes and args.rows else []
    out["forward_sums"] = forward_sums(out["kernel"])
    if args.model:
        out["model"], out["model_rows"], out["packed_linears"] = model_rows(args)
    harness.publish(args.out, out, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
