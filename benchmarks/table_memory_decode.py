"""Render benchmarks/results/memory_decode.json as the README's markdown table (numbers not typed by hand).

    .venv/bin/python benchmarks/table_memory_decode.py [benchmarks/results/memory_decode.json]
"""

from __future__ import annotations

import json
import sys


def main(path: str = "benchmarks/results/memory_decode.json") -> None:
    with open(path) as f:
        d = json.load(f)
    print(f"{d['model']}, {d['dtype']}, torch {d['versions']['torch']}, transformers {d['versions']['transformers']}, "
          f"{d['machine']['threads']} threads, {d['date'][:10]}; median of {d['args']['steps']} decode steps after "
          f"{d['args']['warmup']} warm-up steps.\n")
    print("| context | config | stored tokens | KV after prefill (of full) | KV at end (of full) | prefill s | decode ms/token | decode speed-up vs HF DynamicCache |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in d["rows"]:
        print(f"| {r['context']} | {r['config']} | {r['stored_tokens']} | {r['kv_bytes_after_prefill'] / 1e6:.1f} MB "
              f"({r['kv_fraction_after_prefill']:.1%}) | {r['kv_bytes'] / 1e6:.1f} MB ({r['kv_fraction_of_full']:.1%}) | "
              f"{r['prefill_s']:.2f} | {r['decode_ms_median']:.1f} | {r['decode_speedup_vs_hf_dynamic']:.2f}x |")


if __name__ == "__main__":
    main(*sys.argv[1:])
