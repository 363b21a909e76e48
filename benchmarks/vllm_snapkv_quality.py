"""SnapKV inside vLLM (kvtrim's plugin: token selection, memory freed in whole blocks) vs kvtrim's
token-level SnapKV on transformers, same prompts, same model.

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_snapkv_quality.py \
        --length 1500 --n 6 --keep 0.25 --out benchmarks/results/vllm/snapkv_quality.json

Runs in vLLM's venv (``scripts/setup_vllm.sh``; it has transformers 5.19, which kvtrim supports).
Prompts: ``kvtrim.eval.make_samples("passkey", tok, length, n, seed=0)`` through
``build_prompt_ids``; the same token ids go to both engines. Greedy, ``--new`` tokens, no EOS stop.

Rows: vLLM dense; vLLM + plugin (``method=snapkv, keep``; it keeps the budget rounded up to whole
128-token blocks, the prompt's last partial block included); kvtrim on transformers: full cache,
SnapKV at ``keep`` (token-level budget), and SnapKV with ``max_tokens`` equal to the number of
tokens the plugin kept for that prompt (same budget, token-level placement). Scores: pass-key
accuracy (``kvtrim.eval.metrics.score``) and agreement of the output tokens with the same engine's
dense run (leading tokens equal before the first difference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRIVER = HERE.parent / "tests" / "vllm_driver.py"
SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"


def vllm_run(model_dir: str, prompts: list[list[int]], new: int, kvtrim: dict | None) -> dict:
    engine = {"max_model_len": 4096, "max_num_batched_tokens": 4096, "max_num_seqs": len(prompts)}
    if kvtrim is not None:
        engine["scheduler_cls"] = SCHEDULER
    spec = {"additional_config": {"kvtrim": kvtrim} if kvtrim else {}, "engine": engine, "prompts": prompts,
            "max_tokens": new, "probe_after": 2}
    env = dict(os.environ, KVTRIM_VLLM_MODEL=model_dir, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               PYTHONPATH=str(HERE.parent / "src"))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("@@RESULT ")), None)
    if line is None:
        raise SystemExit(f"vLLM run failed:\n{(p.stdout + p.stderr)[-4000:]}")
    return {**json.loads(line[9:]), "wall_seconds": time.perf_counter() - t0}


def lead(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="plain transformers directory (default: kvtrim's SmolLM2 copy)")
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    import transformers
    import vllm

    from kvtrim.eval import make_samples
    from kvtrim.eval.metrics import score
    from kvtrim.generation import generate_ids
    from kvtrim.integrations.vllm import plan
    from kvtrim.integrations.vllm.config import PluginConfig
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.registry import create_policy

    torch.set_num_threads(1)
    model_dir = args.model_dir or str(next(d for d in sorted((Path.home() / ".cache" / "kvtrim").glob("SmolLM2-135M-Instruct-*"))
                                           if (d / "model.safetensors").is_file()))
    lm = load_model(model_dir)
    tok = lm.tokenizer
    samples = make_samples("passkey", tok, args.length, n=args.n, seed=0)
    prompts = [build_prompt_ids(tok, s.prompt) for s in samples]
    load0 = os.getloadavg()
    cfg = {"method": "snapkv", "keep": args.keep}
    dense = vllm_run(model_dir, prompts, args.new, None)
    ours = vllm_run(model_dir, prompts, args.new, cfg)
    bs = dense["block_size"]
    pc = PluginConfig(**cfg)
    kept = []
    for ids in prompts:
        first, stop = plan.evicted_range(pc, len(ids), len(ids), bs)
        kept.append(len(ids) - (stop - first) * bs)

    def hf(policy) -> list[list[int]]:
        return [list(generate_ids(lm.model, tok, ids, policy(i), max_new_tokens=args.new, stop_at_eos=False).token_ids)
                for i, ids in enumerate(prompts)]

    rows = {
        "vllm dense": dense["tokens"],
        f"vllm + kvtrim plugin snapkv keep={args.keep}": ours["tokens"],
        "kvtrim transformers full": hf(lambda i: create_policy("full")),
        f"kvtrim transformers snapkv keep={args.keep}": hf(lambda i: create_policy("snapkv", keep=args.keep)),
        "kvtrim transformers snapkv max_tokens=plugin's kept count": hf(lambda i: create_policy("snapkv", max_tokens=kept[i])),
    }
    out_rows = []
    for name, toks in rows.items():
        ref = rows["vllm dense"] if name.startswith("vllm") else rows["kvtrim transformers full"]
        texts = [tok.decode(t, skip_special_tokens=True) for t in toks]
        out_rows.append({
            "engine": name,
            "passkey_accuracy": sum(score(s, t) for s, t in zip(samples, texts)) / len(samples),
            "mean_leading_tokens_equal_to_dense": sum(lead(a, b) for a, b in zip(toks, ref)) / len(toks),
            "outputs": texts,
        })
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
        "task": f"passkey, {args.n} samples, {args.length} tokens (kvtrim.eval.make_samples, seed 0)",
        "prompt_tokens": [len(p) for p in prompts], "block_size": bs, "plugin_kept_tokens": kept,
        "kv_blocks_in_use_after_2_tokens": {"vllm dense": dense["blocks_in_use"], "vllm + plugin": ours["blocks_in_use"]},
        "new_tokens": args.new, "rows": out_rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in out_rows:
        print(f"{r['engine']:<62} passkey {r['passkey_accuracy']:.2f}  lead-equal {r['mean_leading_tokens_equal_to_dense']:.1f}")


if __name__ == "__main__":
    main()
