"""kvtrim's side of ``beat_vllm.py`` alone: one configuration's prefill and decode, repeated in one process.

For telling a change in the code from a change in the machine between two ``beat_vllm.py`` runs:
run this once with the current code and once with an older commit's ``src/`` first on
``PYTHONPATH`` (a ``git worktree`` of it), one after the other on the same idle machine, and
compare the prefill and decode times. The prompt (a pass key, ``kvtrim.eval.make_samples`` seed 0),
the model loading and the generation call are ``beat_vllm.py``'s (``anchor_vllm.kvtrim_generate``).

    git worktree add /tmp/kvtrim_old 7b1aebc
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kvtrim_side.py --out results/kvtrim_side/head.json
    OMP_NUM_THREADS=2 PYTHONPATH=/tmp/kvtrim_old/src .venv/bin/python benchmarks/kvtrim_side.py \\
        --out results/kvtrim_side/old.json

The JSON records which ``kvtrim`` was imported (its file and the git commit of its checkout).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path


def commit_of(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the result JSON (an existing file is refused unless --force)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=7680)
    p.add_argument("--method", default="snapkv")
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--no-minference", action="store_true", help="dense prefill")
    p.add_argument("--min-length", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pack-linears", choices=["auto", "off", "tied"], default="auto",
                   help="load_model's pack_linears: auto (default, None), off (False), tied (True); "
                        "only auto works with a kvtrim older than kvtrim.cpu_linear")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new", type=int, default=65)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from kvtrim import harness

    if harness.start(p, args):  # a bad --out or --reps is a usage error before anything loads
        return
    import anchor_vllm as av
    import torch

    import kvtrim
    from kvtrim.eval import make_samples
    from kvtrim.integrations.prefill import make_prefill
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.registry import create_policy

    pack = {"off": {"pack_linears": False}, "tied": {"pack_linears": True}}.get(args.pack_linears, {})
    lm = load_model(args.model, dtype=args.dtype, **pack)
    model, tok = lm.model, lm.tokenizer
    ids = build_prompt_ids(tok, make_samples("passkey", tok, args.length, n=1, seed=0)[0].prompt)
    kv_file = Path(kvtrim.__file__).resolve()
    out = {"benchmark": "kvtrim_side", "setting": vars(args) | {"prompt_tokens": len(ids)},
           "machine": harness.machine_record(), "torch": torch.__version__,
           "kvtrim_file": str(kv_file), "kvtrim_commit": commit_of(kv_file.parent), "measurements": []}
    for rep in range(args.reps):
        pol = create_policy(args.method, keep=args.keep)
        pre = None if args.no_minference else make_prefill(model, "minference", min_length=args.min_length)
        load = os.getloadavg()[0]
        rec = av.kvtrim_generate(model, tok, ids, pol, pre, args.max_new)
        row = {"rep": rep, "loadavg_before": load, "prefill_seconds": rec["prefill_seconds"],
               "prefill_cpu_seconds": rec["prefill_cpu_seconds"], "decode_seconds": rec["decode_seconds"],
               "decode_steps": rec["decode_steps"],
               "decode_ms_per_token": 1000 * rec["decode_seconds"] / max(1, rec["decode_steps"]),
               "stored_tokens": rec.get("stored_tokens"), "prefill_stats": rec.get("prefill_stats")}
        out["measurements"].append(row)
        print(f"[{time.strftime('%H:%M:%S')}] rep {rep}: prefill {row['prefill_seconds']:.2f} s, decode "
              f"{row['decode_ms_per_token']:.1f} ms/token, load {load:.2f}", flush=True)
    out["summary"] = {k: harness.median(m[k] for m in out["measurements"])
                      for k in ("prefill_seconds", "prefill_cpu_seconds", "decode_ms_per_token")}
    harness.finish_record(out["machine"])
    harness.write_json(args.out, out)
    print(out["summary"])


if __name__ == "__main__":
    main()
