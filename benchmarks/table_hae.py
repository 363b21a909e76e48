"""Render the README tables of the multimodal benchmarks from their JSON results.

    .venv/bin/python benchmarks/table_hae.py
"""

from __future__ import annotations

import json
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"


def prefill_table() -> str:
    d = json.loads((RES / "hae_prefill.json").read_text())
    out = [
        f"{d['model']}, {d['dtype']}, torch {d['torch']}, transformers {d['transformers']}, {d['threads']} thread(s), "
        f"{d['date'][:10]}, load average at the end {d['loadavg_end'][0]:.1f} (shared machine).",
        "",
        "| visual tokens | prompt | config | visual kept | prefill s (median) | vs full | KV stored (of full) | tokens first/last layer |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {576 * r['images']} | {r['prompt_tokens']} | {r['config']} | {r['visual_kept']}/{r['visual_tokens']} | "
            f"{r['prefill_s_median']:.2f} (n={len(r['prefill_s_all'])}) | {r['speedup_vs_full']:.2f}x | "
            f"{r['kv_bytes_stored'] / 1e6:.1f} MB ({r['kv_share_of_full']:.0%}) | "
            f"{r['stored_tokens_first_last_layer'][0]}/{r['stored_tokens_first_last_layer'][1]} |"
        )
    return "\n".join(out)


def ddes_table() -> str:
    d = json.loads((RES / "ddes.json").read_text())
    out = [
        f"{d['model']}, {d['context']}-token prose prompt, keep {d['keep']}, {d['decode_steps']} decode steps, "
        f"{d['threads']} thread(s), {d['reps']} rep(s), {d['date'][:10]}, load average at the end {d['loadavg_end'][0]:.1f}.",
        "",
        "| config | gathers per layer | tokens freed per layer | max stored / budget | restored per layer and head | decode ms/token (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['config']} | {r['gathers_per_layer']:.0f} | {r['tokens_freed_per_layer']:.0f} | "
            f"{r['max_stored_during_decode']} / {r['budget_at_end']} | {r['restored_per_layer_head']:.1f} | "
            f"{r['decode_ms_median']:.0f} ({', '.join(f'{x:.0f}' for x in r['decode_ms_per_rep'])}) |"
        )
    return "\n".join(out)


def qa_table() -> str:
    d = json.loads((RES / "qa_proxy_dap.json").read_text())
    s = d["summary"]
    n = s["n"]
    out = [
        f"Proxy ({d['proxy']}): {d['model']}, pass key in ~{d['length']} tokens, {n} samples; full cache "
        f"{s['full']}/{n}.",
        "",
        "| DAP point | document kept | prompt kept | hae (prune) | hae (kv) | fastv (same share) | snapkv (same share) | compared |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, v in s.items():
        if not k.startswith("r="):
            continue
        c = v["compared_samples"]
        cmp = (lambda m, v=v, c=c: f"{v[m]}/{c}") if c else (lambda m: "-")
        out.append(
            f"| {k} | {v['mean_doc_kept_fraction']:.1%} | {v['mean_prompt_kept_fraction']:.1%} | {v['hae_prune']}/{n} | "
            f"{cmp('hae_kv')} | {cmp('fastv')} | {cmp('snapkv')} | {c} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    for f in (prefill_table, ddes_table, qa_table):
        try:
            print(f())
        except FileNotFoundError as e:
            print(f"(missing {e.filename})")
        print()
