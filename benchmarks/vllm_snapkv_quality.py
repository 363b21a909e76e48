"""SnapKV inside vLLM (kvtrim's plugin: token selection, memory freed in whole blocks) vs kvtrim's
token-level SnapKV on transformers, same prompts, same model.

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_snapkv_quality.py \
        --tasks passkey niah_single --length 2048 --n 6 --keeps 0.1 0.25 \
        --out benchmarks/results/vllm/snapkv_quality.json
    python benchmarks/vllm_snapkv_quality.py --table benchmarks/results/vllm/snapkv_quality.json

Runs in vLLM's venv (``scripts/setup_vllm.sh``; it has transformers 5.19, which kvtrim supports);
``--table`` reads the JSON only (any venv with kvtrim). The command line, the ``--out`` check (before
anything runs; an existing file is refused unless ``--force``), the machine record and the JSON
output are ``kvtrim.harness``'s. Prompts: ``kvtrim.eval.make_samples(task, tok, length,
n, seed=0)`` through ``build_prompt_ids``; the same token ids go to both engines. Greedy, ``--new``
tokens, no EOS stop. One thread per process.

Engines, per prompt: vLLM dense (one engine for all prompts); vLLM + plugin (``method=snapkv``,
one engine per keep; it keeps the budget rounded up to whole 128-token blocks, the prompt's last
partial block included); kvtrim on transformers: full cache, SnapKV at ``keep`` (token-level
budget) and SnapKV with ``max_tokens`` equal to the number of tokens the plugin kept for that
prompt (the same budget, token-level placement everywhere). Scores: the task's metric
(``kvtrim.eval.metrics.score``) per prompt, and the output tokens' agreement with the same
engine's uncompressed run (leading tokens equal before the first difference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtrim import harness

HERE = Path(__file__).resolve().parent
DRIVER = HERE.parent / "tests" / "vllm_driver.py"
SCHEDULER = "kvtrim.integrations.vllm.scheduler.KVTrimScheduler"


def vllm_run(model_dir: str, prompts: list[list[int]], new: int, kvtrim: dict | None, kv_gib: int) -> dict:
    longest = max(map(len, prompts)) + new
    engine = {"max_model_len": longest, "max_num_batched_tokens": max(longest, 2048), "max_num_seqs": len(prompts)}
    if kvtrim is not None:
        engine["scheduler_cls"] = SCHEDULER
    spec = {"additional_config": {"kvtrim": kvtrim} if kvtrim else {}, "engine": engine, "prompts": prompts,
            "max_tokens": new}
    env = dict(os.environ, KVTRIM_VLLM_MODEL=model_dir, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        p = subprocess.run([sys.executable, str(DRIVER), "@" + f.name], capture_output=True, text=True, env=env)
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


def measure(args) -> dict:
    import torch
    import transformers
    import vllm

    from kvtrim.eval import make_samples
    from kvtrim.eval.metrics import score
    from kvtrim.generation import generate_ids
    from kvtrim.integrations.vllm import plan
    from kvtrim.integrations.vllm.config import PluginConfig
    from kvtrim.models import build_prompt_ids, embedded_model_dir, load_model
    from kvtrim.registry import create_policy

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    model_dir = args.model_dir or str(embedded_model_dir())
    lm = load_model(model_dir)
    tok = lm.tokenizer
    samples = [s for task in args.tasks for s in make_samples(task, tok, args.length, n=args.n, seed=0)]
    prompts = [build_prompt_ids(tok, s.prompt) for s in samples]
    kv_gib = max(1, -(-len(prompts) * (args.length + 256) // 16384))  # SmolLM2 float32: ~23k tokens per GiB
    engines: dict[str, list[list[int]]] = {}
    loads: dict[str, list[float]] = {}
    bs = None
    kept: dict[str, list[int]] = {}
    reused_rows: dict[str, dict] = {}

    def record(name: str, toks: list[list[int]]) -> None:
        engines[name] = toks
        loads[name] = list(os.getloadavg())
        print(f"[{time.perf_counter() - t_start:6.0f}s] {name}", flush=True)

    dense = vllm_run(model_dir, prompts, args.new, None, kv_gib)
    bs = dense["block_size"]
    record("vllm dense", dense["tokens"])
    for keep in args.keeps:
        cfg = {"method": "snapkv", "keep": keep}
        record(f"vllm plugin snapkv keep={keep}", vllm_run(model_dir, prompts, args.new, cfg, kv_gib)["tokens"])
        pc = PluginConfig(**cfg)
        kept[str(keep)] = []
        for ids in prompts:
            first, stop = plan.evicted_range(pc, len(ids), len(ids), bs)
            kept[str(keep)].append(len(ids) - (stop - first) * bs)

    def hf(policy) -> list[list[int]]:
        return [list(generate_ids(lm.model, tok, ids, policy(i), max_new_tokens=args.new, stop_at_eos=False).token_ids)
                for i, ids in enumerate(prompts)]

    reused = None
    if args.reuse_transformers:  # the transformers rows of an earlier run of the same prompts and budgets
        old = json.loads(Path(args.reuse_transformers).read_text())
        same = [s["prompt_tokens"] for s in old["samples"]] == [len(p) for p in prompts] and old["plugin_kept_tokens"] == kept
        if not same or old["new_tokens"] != args.new:
            raise SystemExit(f"{args.reuse_transformers} ran other prompts, budgets or lengths; run without --reuse-transformers")
        reused = {"file": args.reuse_transformers, "date": old["date"]}
        for r in old["rows"]:
            if r["engine"].startswith("kvtrim"):
                engines[r["engine"]] = [list(tok(o, add_special_tokens=False).input_ids) for o in r["outputs"]]
                loads[r["engine"]] = r["loadavg_after"]
                reused_rows[r["engine"]] = r
    else:
        record("kvtrim full", hf(lambda i: create_policy("full")))
        for keep in args.keeps:
            record(f"kvtrim snapkv keep={keep}", hf(lambda i, k=keep: create_policy("snapkv", keep=k)))
            record(f"kvtrim snapkv same budget as plugin keep={keep}",
                   hf(lambda i, k=keep: create_policy("snapkv", max_tokens=kept[str(k)][i])))

    rows = []
    for name, toks in engines.items():
        if name in reused_rows:  # kept as recorded (its token ids are not stored, only its text)
            rows.append(reused_rows[name])
            continue
        ref = engines["vllm dense"] if name.startswith("vllm") else engines["kvtrim full"]
        texts = [tok.decode(t, skip_special_tokens=True) for t in toks]
        rows.append({"engine": name, "scores": [score(s, t) for s, t in zip(samples, texts)],
                     "leading_tokens_equal_to_uncompressed": [lead(a, b) for a, b in zip(toks, ref)],
                     "outputs": texts, "loadavg_after": loads[name]})
    return {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "model": Path(model_dir).name, "threads": 1, "seconds": round(time.perf_counter() - t_start, 1),
        "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()),
        "tasks": args.tasks, "length": args.length, "n": args.n, "keeps": args.keeps, "new_tokens": args.new,
        "samples": [{"task": s.task, "answers": list(s.answers), "depth": s.depth, "prompt_tokens": len(p)}
                    for s, p in zip(samples, prompts)],
        "block_size": bs, "plugin_kept_tokens": kept, "vllm_kv_cache_gib": kv_gib,
        "transformers_rows_reused_from": reused, "rows": rows,
    }


def table(d: dict) -> str:
    tasks = d["tasks"]
    idx = {t: [i for i, s in enumerate(d["samples"]) if s["task"] == t] for t in tasks}
    by = {r["engine"]: r for r in d["rows"]}

    def cell(name: str, t: str) -> str:
        sc = [by[name]["scores"][i] for i in idx[t]]
        return f"{sum(sc) / len(sc):.2f} ({''.join('1' if x >= 1 else '0' if x <= 0 else '~' for x in sc)})"

    out = ["| engine | kept tokens (mean) | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    n_tok = [s["prompt_tokens"] for s in d["samples"]]
    mean_len = sum(n_tok) / len(n_tok)
    for name in by:
        if "keep=" in name:
            keep = name.rsplit("keep=", 1)[1]
            if "same budget" in name or name.startswith("vllm"):
                k = d["plugin_kept_tokens"][keep]
                kept = f"{sum(k) / len(k):.0f} ({sum(k) / sum(n_tok):.2f})"
            else:
                kept = f"{float(keep) * mean_len:.0f} ({float(keep):.2f})"
        else:
            kept = f"{mean_len:.0f} (1.00)"
        out.append(f"| {name} | {kept} | " + " | ".join(cell(name, t) for t in tasks) + " |")
    lines = ["\n".join(out), ""]
    for keep in (str(k) for k in d["keeps"]):
        block, same = by[f"vllm plugin snapkv keep={keep}"]["scores"], by[f"kvtrim snapkv same budget as plugin keep={keep}"]["scores"]
        tok_keep = by[f"kvtrim snapkv keep={keep}"]["scores"]
        bw = sum(b > s for b, s in zip(block, same))
        sw = sum(s > b for b, s in zip(block, same))
        kw = sum(b > s for b, s in zip(block, tok_keep))
        tw = sum(s > b for b, s in zip(block, tok_keep))
        same_text = sum(a == b for a, b in zip(by[f"vllm plugin snapkv keep={keep}"]["outputs"],
                                               by[f"kvtrim snapkv same budget as plugin keep={keep}"]["outputs"]))
        lines.append(f"- keep {keep}: block-granular (vLLM plugin) vs token-level at the same budget: the plugin "
                     f"scores higher on {bw} prompt(s), token-level on {sw}, equal on {len(block) - bw - sw} "
                     f"(identical output text on {same_text} of {len(block)}); vs token-level at the unrounded "
                     f"budget: plugin higher on {kw}, token-level on {tw}.")
    dense_same = sum(a == b for a, b in zip(by["vllm dense"]["outputs"], by["kvtrim full"]["outputs"]))
    lines.append(f"- uncompressed: vLLM dense and kvtrim's full cache give identical output text on {dense_same} of "
                 f"{len(d['samples'])} prompts.")
    la = d["loadavg_before"]
    reused = d.get("transformers_rows_reused_from")
    if reused:
        lines.append(f"- the kvtrim-on-transformers rows come from the run of {reused['date']} ({reused['file']}), "
                     "the same prompts and budgets; the vLLM rows were rerun.")
    lines.append(f"\n{d['model']}, {d['length']}-token prompts ({min(n_tok)}-{max(n_tok)} tokens with the chat "
                 f"template), {d['n']} per task (kvtrim.eval.make_samples, seed 0), greedy {d['new_tokens']} tokens; "
                 f"score = mean of the task's metric, then per prompt (1 right, 0 wrong); kept = prompt tokens kept "
                 f"(fraction of the prompt). vLLM {d['versions']['vllm']} CPU build, one thread per process; load "
                 f"average {la[0]:.1f} at the start ({d['seconds']:.0f} s for the whole run).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--model-dir", default=None, help="plain transformers directory (default: kvtrim's SmolLM2 copy)")
    ap.add_argument("--tasks", nargs="+", default=["passkey", "niah_single"])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.25])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reuse-transformers", metavar="JSON",
                    help="take the kvtrim-on-transformers rows from an earlier run of the same prompts (rerun vLLM only)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    result = measure(args)
    harness.publish(args.out, result, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
