"""One decode step per ``kv_bits`` (16, 8, 4, 2) with many tokens stored: is a low-bit step slower?

A low-bit cache reads a quarter (4 bits) of a 16-bit one's key and value bytes per step, but it
unpacks and scales every code it reads (``csrc/lowbit_decode.cpp``); this script times the step at
long contexts, where the attention is a large share of it.

Prefilling 32k tokens on CPU takes hours, so each cache is **filled with random keys and values**
instead, one prompt of ``--lengths`` tokens per layer, through the cache's own ``update`` and
``after_attention`` (what kvtrim's attention function calls for every layer of a prefill): the
stored state is the one a prompt of that length leaves (the policy's decision, the quantized groups
and the residual; ``tests/test_kv_bits_decode.py`` checks it against a real prefill). A decode
step's time does not depend on the values of the stored keys and values.

Two parts, on ``--threads`` torch threads each (one block of measurements per thread count):

* ``step``: whole decode steps of the model (one new token's forward through the filled cache,
  ``kvtrim.decoding``), ``--steps`` steps per configuration per round, ``--reps`` rounds interleaved
  over the bit widths after ``--warmup`` rounds; the median ms per step;
* ``attention``: one layer's decode attention over the same stored state, by the path a step takes:
  16 bits the model's SDPA (float32 CPU steps keep it, ``kvtrim.integrations.hf``; kvtrim's grouped
  ``kvtrim.scores.decode_attention`` beside it), low bits ``lowbit_decode_attention`` (the native
  kernel where it is built), times the model's layers;
* ``profiled_step``: one more step under ``torch.profiler``: the attention operator each layer ran
  (``kvtrim_native::lowbit_decode`` for a low-bit layer on CPU, SDPA for a 16-bit one) and how often.

Recorded per configuration: the stored tokens, the resident KV bytes (``cache.kv_bytes()``), the
step and attention medians and every sample.

    OMP_NUM_THREADS=1 python benchmarks/bench_kv_bits_decode.py --model qwen2.5-0.5b --lengths 8192,32768 \\
        --threads 1,2 --out results/kv_bits_decode.json
    python benchmarks/bench_kv_bits_decode.py --table benchmarks/results/kv_bits_decode/qwen_8k_32k.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kvtrim import harness

FILLED = "cache filled with random keys and values; a decode step's time does not depend on their values"


def fill(cache, model, stored: int, seed: int = 0) -> None:
    """Store ``stored`` random tokens in every layer of ``cache`` as one prompt of that length would:
    per layer, its keys and values through ``cache.update`` and then ``cache.after_attention`` (the
    policy's decision on the prompt, then the low-bit storage quantizing every full group), in the
    model's dtype. Random queries stand in for the prompt's (``[1, heads, stored, head_dim]``)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    hq, hkv, d = cache.num_heads, cache.num_kv_heads, cache.head_dim
    for i in range(len(cache.layers)):
        k, v = (torch.randn(1, hkv, stored, d, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(1, hq, stored, d, generator=gen).to(dtype)
        cache.update(k, v, i)
        cache.after_attention(cache.layers[i], q, k, d ** -0.5)


def attention_fns(cache, dtype: torch.dtype, layer_idx: int = 0) -> tuple[dict, dict]:
    """The decode attentions to time on one layer's stored state: name -> call, and what they ran."""
    from kvtrim.attention.lowbit import lowbit_decode_attention
    from kvtrim.attention.native import kernel_for
    from kvtrim.scores import decode_attention

    layer = cache.layers[layer_idx]
    hq, d = cache.num_heads, cache.head_dim
    q = torch.randn(1, hq, 1, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = d ** -0.5
    if cache.kv_bits == 16:
        k, v = layer.keys, layer.values
        return ({"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
                 "grouped": lambda: decode_attention(q, k, v, scale)},
                {"sdpa": "torch SDPA (the float32 CPU step's path)", "grouped": "kvtrim.scores.decode_attention"})
    kv = layer.lowbit
    rk, rv = layer.residual
    backend = "native" if kernel_for(q) == "native" else "torch"
    return ({"lowbit": lambda: lowbit_decode_attention(q, kv, rk, rv, scale, backend=backend)},
            {"lowbit": f"lowbit_decode_attention, backend {backend}"})


#: the operators a profiled step counts: the attention each kind of layer runs in a decode step
ATTENTION_OPS = ("kvtrim_native::lowbit_decode", "aten::scaled_dot_product_attention")


def profiled_step(model, cache, logits) -> dict:
    """One more decode step under ``torch.profiler``: which attention operators it ran, how often, and
    their total milliseconds (the kernel a low-bit step takes is checked here, not assumed)."""
    from torch.profiler import ProfilerActivity, profile

    from kvtrim import decoding

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoding.run(model, decoding.decode(cache, logits, 2))
    return {e.key: {"calls": e.count, "ms": e.cpu_time_total / 1000} for e in prof.key_averages()
            if e.key in ATTENTION_OPS}


@torch.inference_mode()
def measure(args, lm, threads: int, stored: int) -> list[dict]:
    """Rows of one (thread count, stored length): one per bit width."""
    from kvtrim import decoding
    from kvtrim.cache import KVTrimCache
    from kvtrim.registry import create_policy

    torch.set_num_threads(threads)
    model = lm.model
    caches = {}
    for b in args.bits:
        cache = KVTrimCache(model, create_policy("full"), kv_bits=b)
        t0 = time.perf_counter()
        fill(cache, model, stored)
        caches[b] = cache
        print(f"{threads} thread(s), {stored} stored, {b} bits: filled in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    before = {b: {"stored": c.stored_tokens()[0], "kv_bytes": c.kv_bytes(), "seen": c.seen_tokens()}
              for b, c in caches.items()}
    first = torch.zeros(model.config.vocab_size)  # a decode step's time does not depend on its token

    def steps(name: str, rep: int) -> list[float]:
        got: list[float] = []
        decoding.run(model, decoding.decode(caches[int(name)], first, args.steps + 1),
                     on_step=lambda s, t: got.append(t))
        return got

    names = [str(b) for b in args.bits]
    step_samples = harness.interleave(names, steps, reps=args.reps, warmup=args.warmup)
    profiled = {b: profiled_step(model, c, first) for b, c in caches.items()}

    # one layer's attention over the state the steps left
    fns, paths = {}, {}
    for b, c in caches.items():
        f, p = attention_fns(c, next(model.parameters()).dtype)
        fns |= {f"{b}:{n}": fn for n, fn in f.items()}
        paths |= {f"{b}:{n}": desc for n, desc in p.items()}
    att_samples = harness.interleave(list(fns), lambda n, r: harness.per_call(fns[n], args.calls), reps=args.reps, warmup=1)

    rows = []
    layers = len(caches[args.bits[0]].compressed_layers)
    for b, c in caches.items():
        times = [t for s in step_samples[str(b)] for t in s.value]
        att = {n.split(":")[1]: [s.value for s in att_samples[n]] for n in fns if n.startswith(f"{b}:")}
        row = {"threads": threads, "length": stored, "bits": b, **before[b],
               "stored_after": c.stored_tokens()[0], "kv_bytes_after": c.kv_bytes(),
               "step_ms": 1000 * harness.median(times), "step_ms_all": [1000 * t for t in times],
               "profiled_step": profiled[b],
               "attention": {n: {"path": paths[f"{b}:{n}"], "layer_ms": 1000 * harness.median(v),
                                 "step_ms": 1000 * harness.median(v) * layers, "layer_ms_all": [1000 * x for x in v]}
                             for n, v in att.items()}}
        rows.append(row)
        a = ", ".join(f"{n} {x['step_ms']:.1f}" for n, x in row["attention"].items())
        print(f"{threads} thread(s), {stored} stored, {b} bits: step {row['step_ms']:.1f} ms, attention x {layers} "
              f"layers: {a} ms, KV {row['kv_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    return rows


def table(d: dict) -> str:
    """Markdown table of a result: one row per thread count, stored length and bit width."""
    m = d["machine"]
    counts = d["args"]["thread_counts"]
    machine = harness.machine_line(m, counts[0]) + ("" if len(counts) == 1 else " (thread counts as in the table)")
    head = (f"{d['model']} ({d['dtype']}), method `full`, {d['note']}. {machine}, {m['date'][:10]}; whole steps: median of {d['args']['reps']} "
            f"interleaved rounds x {d['args']['steps']} steps; attention: one layer's call (median of "
            f"{d['args']['reps']} rounds of {d['args']['calls']} calls) x {d['layers']} layers.")
    lines = [head, "",
             "| threads | stored tokens | kv_bits | resident KV MiB | of 16-bit | decode ms/step (median) | of 16-bit | "
             "attention ms/step | the step's attention operator (calls per step) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        base = next(x for x in d["rows"] if x["threads"] == r["threads"] and x["length"] == r["length"] and x["bits"] == 16)
        att = r["attention"]["sdpa" if r["bits"] == 16 else "lowbit"]["step_ms"]
        extra = f" (grouped: {r['attention']['grouped']['step_ms']:.1f})" if "grouped" in r["attention"] else ""
        ops = ", ".join(f"`{name}` ({v['calls']})" for name, v in r["profiled_step"].items()) or "none found"
        lines.append(f"| {r['threads']} | {r['stored']} | {r['bits']} | {r['kv_bytes'] / 2**20:.1f} | "
                     f"{r['kv_bytes'] / base['kv_bytes']:.3f} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f} | "
                     f"{att:.1f}{extra} | {ops} |")
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=5, warmup=1)])
    ap.add_argument("--model", help="model to load [default: the embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int_list, default=[8192, 32768], help="stored tokens (comma-separated)")
    ap.add_argument("--bits", type=int_list, default=[16, 8, 4, 2], help="kv_bits (comma-separated; 16 is needed)")
    ap.add_argument("--threads", dest="thread_counts", type=int_list, default=[1],
                    help="torch thread counts (comma-separated), one block of measurements each")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per configuration per round")
    ap.add_argument("--calls", type=int, default=10, help="attention calls per timed sample")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    from kvtrim.attention.native import cpu_kernel
    from kvtrim.cache import check_kv_bits
    from kvtrim.integrations.hf import attach
    from kvtrim.models import load_model

    args.bits = [check_kv_bits(b) for b in args.bits]
    if 16 not in args.bits:
        ap.error("--bits must include 16 (the baseline every row is compared with)")
    for name, flag in (("lengths", "--lengths"), ("thread_counts", "--threads")):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            ap.error(f"{flag} must be positive integers")
    for name in ("steps", "calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    machine = harness.machine_record()
    lm = load_model(args.model, dtype=args.dtype)
    out: dict = {"benchmark": "kv_bits_decode", "date": machine["date"], "model": lm.source, "dtype": args.dtype,
                 "note": FILLED, "cpu_kernel": cpu_kernel(), "layers": int(lm.model.config.num_hidden_layers),
                 "args": {k: v for k, v in vars(args).items() if k not in ("table", "force", "out")}, "rows": []}
    with attach(lm.model):
        for threads in args.thread_counts:
            for stored in args.lengths:
                out["rows"] += measure(args, lm, threads, stored)
                harness.write_json(args.out, out | {"machine": harness.finish_record(dict(machine))})
    harness.publish(args.out, out, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
