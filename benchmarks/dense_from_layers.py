"""A dense prefill too long to run here, computed from its parts: one layer's dense attention timed
on random tensors of the model's shapes, and the rest of the forward timed in a sparse run.

At 128k tokens the reference model's dense prefill would take over 20 minutes on 2 cores. Its
attention is the same SDPA call in every layer (same shapes, same work), so
``benchmarks/bench_sparse_kernel.py`` times it once, for one layer's heads, on random bfloat16
q/k/v; everything else in the forward (linears, norms, MLP, rotary) does not depend on how
attention is computed, so it is taken from a sparse prefill's run at the same length and scaling
(``benchmarks/bench_minference_prefill.py``: its wall time minus its attention and index
estimation). The dense prefill is then::

    dense = (sparse wall - sparse attention - estimation) + layers x (one layer's SDPA)

and the sparse prefill's speed-up is ``dense / sparse wall``; the sparse kernel's rate per unit of
work against SDPA is ``density x layers x SDPA / sparse attention``. Every number that goes in is
read from the two committed result files; the output says it is computed. At 32k both ways were
measured (docs/minference.md): 24 layers of the random-tensor SDPA give 70.4 s against 70.3 s
inside the model, so the attention part carries over::

    python benchmarks/dense_from_layers.py --prefill benchmarks/results/minference_prefill_qwen_bf16_128k_yarn4.json \\
        --kernel benchmarks/results/cpu_kernel_rate_128k.jsonl --config c64k --layers 24 \\
        --out results/dense_computed_128k.json
    python benchmarks/dense_from_layers.py --table benchmarks/results/dense_computed_128k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtrim import harness
from kvtrim.errors import KVTrimError


def compute(prefill: dict, kernel_rows: list[dict], config: str, layers: int) -> dict:
    rows = [r for r in prefill["records"] if r["config"] == config]
    if len(rows) != 1:
        raise KVTrimError(f"the prefill result has {len(rows)} rows of config {config!r}; one is needed")
    sparse = rows[0]
    n = sparse["length"]
    sdpa = [r for r in kernel_rows if r.get("T") == n and r.get("kind") == "dense_sdpa" and r.get("dtype") == prefill["dtype"]]
    if len(sdpa) != 1:
        raise KVTrimError(f"the kernel result has {len(sdpa)} dense SDPA rows at T={n} in {prefill['dtype']}; one is needed")
    per_layer = sdpa[0]["seconds"]
    rest = sparse["wall_seconds"] - sparse["attention_seconds"] - sparse["estimate_seconds"]
    dense_attention = layers * per_layer
    dense = rest + dense_attention
    return {
        "computed": True,
        "length": n, "dtype": prefill["dtype"], "model": prefill.get("model"), "rope_scaling": prefill.get("rope_scaling"),
        "config": config, "layers": layers,
        "sparse": {k: sparse[k] for k in ("wall_seconds", "cpu_seconds", "attention_seconds", "estimate_seconds", "density")
                   if k in sparse} | {"peak_rss_mib": sparse.get("peak_rss_mib")},
        "sdpa_seconds_per_layer": per_layer,
        "rest_of_forward_seconds": rest,
        "dense_attention_seconds": dense_attention,
        "dense_seconds": dense,
        "speedup": dense / sparse["wall_seconds"],
        "attention_speedup": dense_attention / (sparse["attention_seconds"] + sparse["estimate_seconds"]),
        "kernel_rate_vs_sdpa": sparse["density"] * dense_attention / sparse["attention_seconds"],
        "machines": {"prefill": prefill["machine"], "kernel": next((r["machine"] for r in kernel_rows if "machine" in r), None)},
    }


def table(d: dict) -> str:
    s = d["sparse"]
    lines = [f"{d['model']}, {d['dtype']}, {d['length']} tokens, RoPE {d['rope_scaling'] or 'unscaled'}; the dense row is "
             f"**computed** (rest of the forward from the sparse run + {d['layers']} x one layer's SDPA on random tensors), "
             "not run.", "",
             "| prefill | density | wall s | speed-up | attention s | estimation s | rest of the forward s |",
             "|---|---:|---:|---:|---:|---:|---:|",
             f"| dense (computed: {d['layers']} x {d['sdpa_seconds_per_layer']:.2f} s of SDPA) | 1.000 | {d['dense_seconds']:.1f} | 1.00x | "
             f"{d['dense_attention_seconds']:.1f} | | {d['rest_of_forward_seconds']:.1f} |",
             f"| {d['config']} (run) | {s['density']:.3f} | {s['wall_seconds']:.1f} | {d['speedup']:.2f}x | {s['attention_seconds']:.1f} | "
             f"{s['estimate_seconds']:.1f} | {d['rest_of_forward_seconds']:.1f} |", "",
             f"Sparse kernel's rate per unit of work against SDPA: {d['kernel_rate_vs_sdpa']:.2f}; attention with estimation "
             f"{d['attention_speedup']:.2f}x faster than dense attention."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    p.add_argument("--prefill", help="bench_minference_prefill.py result with the sparse row")
    p.add_argument("--kernel", help="bench_sparse_kernel.py result (JSON lines) with the dense SDPA row at that length")
    p.add_argument("--config", help="the sparse row's config name")
    p.add_argument("--layers", type=int, help="the model's layers (each runs the same SDPA)")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    if not (args.prefill and args.kernel and args.config and args.layers):
        p.error("--prefill, --kernel, --config and --layers are required")
    prefill = json.loads(Path(args.prefill).read_text())
    kernel_rows = [json.loads(line) for line in Path(args.kernel).read_text().splitlines() if line.strip()]
    try:
        res = compute(prefill, kernel_rows, args.config, args.layers)
    except KVTrimError as e:
        p.error(str(e))
    res["inputs"] = {"prefill": args.prefill, "kernel": args.kernel}
    harness.write_json(args.out, res)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
