"""kvtrim's best configuration against vLLM's CPU backend, both in bfloat16, end to end (issue 19, P6).

    python benchmarks/beat_vllm.py --model qwen2.5-0.5b smollm2 --lengths 7680 32000 --threads 2 --reps 3 \\
        --out results/beat_vllm/idle.json                       # the measurement; writes the JSON after every length
    python benchmarks/beat_vllm.py --table benchmarks/results/beat_vllm/smoke_qwen.json   # its tables

Both sides get the same prompt token ids (``kvtrim.eval.make_samples("passkey", ..., seed=0)`` through
``kvtrim.models.build_prompt_ids``; repetition ``r`` uses sample ``r``), greedy, 65 new tokens with
no EOS stop: end to end = prefill (prompt -> first token) + 64 decode steps.

- **vLLM** (``--vllm-dtype``, default bfloat16): dense attention, prefix caching off, the prompt
  in one prefill step, driven by :mod:`anchor_vllm`'s worker (its venv ``benchmarks/.venv-vllm``,
  its timestamps, its KV accounting: blocks the request occupies x block bytes). It loads kvtrim's
  converted transformers directory of the model (``kvtrim.models.resolve_model``).
- **kvtrim** (``--kvtrim-dtype``, default bfloat16): each ``--kvtrim-configs`` entry
  ``METHOD[@KEEP][+minference]`` is one ``generate_ids`` call; ``+minference`` adds MInference
  sparse prefill with the config shipped for the model (``make_prefill(model, "minference")``,
  prompts shorter than ``--min-length`` prefill dense) and the method compresses the cache
  (``snapkv`` keeps ``KEEP``, default ``--keep``). Resident KV = ``result.kv_bytes``.

Every measured answer is scored against the sample's pass key (``kvtrim.eval.metrics.score``), so
a table shows whether the compressed configuration kept the needle answers that dense vLLM gives.

Context. A length whose prompt + new tokens exceeds the model's trained context (SmolLM2: 8,192)
runs with linear RoPE scaling on *both* sides, factor = context needed (rounded up to 1,024) /
trained context: kvtrim through ``bench_minference_prefill.scale_rope``, vLLM through
``hf_overrides={"rope_parameters": {"rope_type": "linear", "factor": F, ...}}``, which vLLM's
max-length check multiplies into the trained context. Lengths within the context use the model's
own RoPE. vLLM's ``max_model_len`` (= ``max_num_batched_tokens``) is the context those lengths
need; a vLLM worker is started per (model, RoPE factor) and closed when its lengths are done.
``--rope-context N`` runs every length as if it needed N tokens of context, which exercises the
scaled path on short prompts (a ``full`` config beside shows whether both sides scale alike: its
greedy tokens then match vLLM's).

Repetitions: one warm-up round, then ``--reps`` rounds, vLLM and kvtrim interleaved with the order
alternating (:func:`kvtrim.harness.interleave`). Medians are reported with ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import anchor_vllm as av

CONTEXT_STEP = 1024
KV_TARGET = 0.3


def needed_context(prompt_tokens: int, max_new: int, step: int = CONTEXT_STEP) -> int:
    """Tokens a request needs (prompt + new tokens), rounded up to a multiple of ``step``."""
    return step * math.ceil((prompt_tokens + max_new) / step)


def rope_plan(context: int, base_ctx: int) -> dict:
    """Linear RoPE factor for a ``context`` beyond the trained ``base_ctx`` (1.0 within it)."""
    factor = context / base_ctx if context > base_ctx else 1.0
    return {"context": context, "factor": factor}


def parse_config(text: str, keep: float) -> dict:
    """``METHOD[@KEEP][+minference]`` -> ``{"name", "method", "keep", "prefill"}``."""
    body, plus, tail = text.partition("+")
    if plus and tail != "minference":
        raise SystemExit(f"--kvtrim-configs: {text!r}: only '+minference' may follow the method")
    method, at, k = body.partition("@")
    kept = float(k) if at else (None if method == "full" else keep)
    name = method + (f"@{kept:g}" if kept is not None else "") + ("+minference" if plus else "")
    return {"name": name, "method": method, "keep": kept, "prefill": "minference" if plus else None}


# ------------------------------------------------------------------------------- RoPE agreement
def rope_check_worker(factors: list, theta: float, head_dim: int, positions: int) -> None:
    """In vLLM's venv: rotate random q and k with vLLM's ``get_rope`` (linear scaling at each factor)
    and with transformers' ``LlamaRotaryEmbedding`` built from the same ``rope_parameters`` (what
    ``scale_rope`` installs in kvtrim's model); print the largest differences as JSON."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    base_ctx, heads, kv_heads = 8192, 9, 3
    out = {}
    for f in factors:
        rp = {"rope_type": "linear", "factor": f, "rope_theta": theta}
        cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim, max_position_embeddings=int(base_ctx * f), rope_parameters=rp)
        pos = torch.arange(positions)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, positions, head_dim, generator=gen)
        k = torch.randn(1, kv_heads, positions, head_dim, generator=gen)
        qh, kh = apply_rotary_pos_emb(q, k, *LlamaRotaryEmbedding(cfg)(q, pos[None]))
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(head_dim, max_position=base_ctx, is_neox_style=True, rope_parameters=rp, dtype=torch.float32)
        qv, kv = rope.forward_native(pos, q[0].transpose(0, 1).reshape(positions, -1).clone(),
                                     k[0].transpose(0, 1).reshape(positions, -1).clone())
        qv = qv.reshape(positions, heads, head_dim).transpose(0, 1)[None]
        kv = kv.reshape(positions, kv_heads, head_dim).transpose(0, 1)[None]
        out[str(f)] = {"vllm_class": type(rope).__name__, "max_abs_diff_q": float((qv - qh).abs().max()),
                       "max_abs_diff_k": float((kv - kh).abs().max()), "max_abs_q": float(qh.abs().max())}
    print(av.TAG + json.dumps(out), flush=True)


def rope_check(factors: list, theta: float = 100000.0, head_dim: int = 64, positions: int = 4096) -> dict:
    """:func:`rope_check_worker` run in ``benchmarks/.venv-vllm``; its JSON."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cmd = [str(av.VPY), str(Path(__file__).resolve()), "--rope-check-worker", *map(str, factors),
           "--rope-theta", str(theta), "--head-dim", str(head_dim), "--positions", str(positions)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    line = next(x for x in r.stdout.splitlines() if x.startswith(av.TAG))
    return {"factors": json.loads(line[len(av.TAG):]), "rope_theta": theta, "head_dim": head_dim, "positions": positions,
            "command": "benchmarks/beat_vllm.py " + " ".join(cmd[2:])}


# ------------------------------------------------------------------------------------- measuring
def run(args) -> dict:
    versions = av.setup_env()
    import torch
    import transformers

    import kvtrim
    from kvtrim import harness

    configs = [parse_config(c, args.keep) for c in args.kvtrim_configs]
    out = {
        "benchmark": "beat_vllm",
        "setting": {
            "label": args.label, "models": args.model, "lengths": args.lengths, "reps": args.reps, "warmup": 1,
            "max_new_tokens": args.max_new, "threads": args.threads, "keep": args.keep,
            "kvtrim_configs": [c["name"] for c in configs], "kvtrim_dtype": args.kvtrim_dtype,
            "vllm_dtype": args.vllm_dtype, "min_length": args.min_length, "rope_context": args.rope_context,
            "kv_space_gib": args.kv_space_gib,
            "task": "passkey (kvtrim.eval.make_samples, seed 0); rep r answers sample r; prompt ids given to both engines",
            "greedy": True, "vllm_prefix_caching": False, "vllm_thread_binding": "nobind",
            "vllm_ld_preload": not args.no_preload, "kv_target": KV_TARGET,
        },
        "machine": harness.machine_record(),
        "kvtrim": {"version": getattr(kvtrim, "__version__", None), "transformers": transformers.__version__,
                   "torch": torch.__version__},
        "vllm_env_versions": versions,
        "models": {},
        "vllm": {},
        "measurements": [],
    }
    for name in args.model:
        run_model(name, args, configs, out)
        gc.collect()  # the model's weights before the next model loads
    harness.finish_record(out["machine"])
    return summarize(out)


def run_model(name: str, args, configs: list, out: dict) -> None:
    """Every length of one model: its vLLM worker(s) and the kvtrim configs, interleaved."""
    from bench_minference_prefill import scale_rope

    from kvtrim import harness
    from kvtrim.cpu_linear import packed_count
    from kvtrim.eval import make_samples
    from kvtrim.eval.metrics import score
    from kvtrim.integrations.prefill import make_prefill
    from kvtrim.models import build_prompt_ids, load_model, resolve_model
    from kvtrim.registry import create_policy

    lm = load_model(name, dtype=args.kvtrim_dtype)  # bfloat16 on a CPU: linears packed (kvtrim.cpu_linear)
    model, tok = lm.model, lm.tokenizer
    model_dir, label = resolve_model(name)
    base_ctx = int(model.config.max_position_embeddings)
    samples, prompts, plans = {}, {}, {}
    for L in args.lengths:
        samples[L] = make_samples("passkey", tok, L, n=args.reps, seed=0)
        prompts[L] = [build_prompt_ids(tok, s.prompt) for s in samples[L]]
        plans[L] = rope_plan(max(needed_context(max(map(len, prompts[L])), args.max_new), args.rope_context), base_ctx)
    unscaled = max((p["context"] for p in plans.values() if p["factor"] == 1.0), default=base_ctx)
    out["models"][label] = {"arg": name, "model_dir": str(model_dir), "trained_context": base_ctx,
                            "kvtrim_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                            "packed_linears": packed_count(model)[0],
                            "rope": {str(L): p for L, p in plans.items()}}
    theta = (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta")
    log = Path(args.log)
    worker, worker_key = None, None
    try:
        for L in args.lengths:
            plan = plans[L]
            key = f"{label}|rope x{plan['factor']:g}"
            if key != worker_key:
                if worker is not None:
                    worker.close()
                    worker = None
                over = None
                if plan["factor"] > 1:
                    over = {"rope_parameters": {"rope_type": "linear", "factor": plan["factor"], "rope_theta": theta}}
                ctx = plan["context"] if plan["factor"] > 1 else unscaled
                print(f"[vllm] starting {key} dtype={args.vllm_dtype} max_model_len={ctx}", flush=True)
                t0 = time.perf_counter()
                worker = av.VLLMWorker(str(model_dir), args.vllm_dtype, args.threads, args.kv_space_gib, log,
                                       preload=not args.no_preload, max_model_len=ctx, hf_overrides=over)
                worker_key = key
                out["vllm"][key] = {**worker.info, "start_seconds": time.perf_counter() - t0}
                print(f"[vllm] ready after {time.perf_counter() - t0:.0f} s: {json.dumps(worker.info)}", flush=True)
            scale_rope(model, plan["context"] if plan["factor"] > 1 else base_ctx, base_ctx)
            engines = [f"vllm:{args.vllm_dtype}"] + [f"kvtrim:{c['name']}" for c in configs]

            def measure(engine: str, rep: int, L=L, key=key, w=worker) -> dict:
                warm = rep < 0
                i = 0 if warm else rep
                ids = prompts[L][i]
                rec = {"model": label, "length": L, "prompt_tokens": len(ids), "rep": rep, "warmup": warm,
                       "engine": engine, "rope_factor": plans[L]["factor"], "loadavg_before": list(os.getloadavg())}
                c0, w0 = time.process_time(), w.cpu_seconds()
                if engine.startswith("vllm:"):
                    r = w.call(op="steps", ids=ids, max_tokens=args.max_new, kv_probe=warm)
                    rec.update(config="dense", dtype=args.vllm_dtype, vllm_worker=key, **r)
                else:
                    c = next(c for c in configs if f"kvtrim:{c['name']}" == engine)
                    pol = create_policy(c["method"], **({"keep": c["keep"]} if c["keep"] is not None else {}))
                    pre = make_prefill(model, c["prefill"], min_length=args.min_length) if c["prefill"] else None
                    rec.update(av.kvtrim_generate(model, tok, ids, pol, pre, args.max_new))
                    rec.update(config=c["name"], dtype=out["models"][label]["kvtrim_dtype"])
                text = tok.decode(rec["token_ids"], skip_special_tokens=True)
                rec.update(answer=text[:80], correct=score(samples[L][i], text) == 1.0,
                           e2e_seconds=rec["prefill_seconds"] + rec["decode_seconds"],
                           decode_ms_per_token=1000 * rec["decode_seconds"] / max(1, rec["decode_steps"]),
                           loadavg_after=list(os.getloadavg()), kvtrim_process_cpu_seconds=time.process_time() - c0,
                           vllm_process_cpu_seconds=w.cpu_seconds() - w0)
                out["measurements"].append(rec)
                print(f"[{time.strftime('%H:%M:%S')}] {label} L={L} rep={rep}{' warm' if warm else ''} {engine}: "
                      f"prefill {rec['prefill_seconds']:.2f}s decode {rec['decode_ms_per_token']:.1f} ms/tok "
                      f"e2e {rec['e2e_seconds']:.2f}s correct={rec['correct']} load {rec['loadavg_before'][0]:.2f}",
                      flush=True)
                return rec

            harness.interleave(engines, measure, reps=args.reps, warmup=1)
            harness.write_json(args.out, summarize(out))  # rewritten after every length
    finally:
        if worker is not None:
            worker.close()
        scale_rope(model, base_ctx, base_ctx)


# ------------------------------------------------------------------------------------- summaries
def summarize(out: dict) -> dict:
    """Medians per (model, length, engine), vLLM's KV bytes, and the comparison of each kvtrim row with vLLM's."""
    ms = [m for m in out["measurements"] if not m["warmup"]]
    keys: list = []
    for m in ms:
        if (m["model"], m["length"], m["engine"]) not in keys:
            keys.append((m["model"], m["length"], m["engine"]))
    first = {k[:2]: i for i, k in reversed(list(enumerate(keys)))}
    keys.sort(key=lambda k: (first[k[:2]], not k[2].startswith("vllm:")))  # (model, length) as run; vLLM's row first
    rows = []
    for model, L, eng in keys:
        sel = [m for m in ms if (m["model"], m["length"], m["engine"]) == (model, L, eng)]
        med = {k: statistics.median(m[k] for m in sel) for k in ("prefill_seconds", "decode_ms_per_token", "e2e_seconds")}
        row = {"model": model, "length": L, "engine": eng, "config": sel[0]["config"], "dtype": sel[0]["dtype"],
               "n": len(sel), "prompt_tokens": statistics.median(m["prompt_tokens"] for m in sel), **med,
               "correct": sum(bool(m["correct"]) for m in sel), "correct_by_rep": {str(m["rep"]): m["correct"] for m in sel},
               "tokens_by_rep": {str(m["rep"]): m["token_ids"] for m in sel},
               "loadavg_1min_median": statistics.median(m["loadavg_before"][0] for m in sel)}
        if all("prefill_cpu_seconds" in m for m in sel):  # CPU time of the engine's processes: the load-robust view
            row["prefill_cpu_seconds"] = statistics.median(m["prefill_cpu_seconds"] for m in sel)
            row["decode_cpu_ms_per_token"] = statistics.median(1000 * m["decode_cpu_seconds"] / max(1, m["decode_steps"])
                                                               for m in sel)
        if eng.startswith("vllm:"):
            warm = [m for m in out["measurements"] if m["warmup"] and (m["model"], m["length"], m["engine"]) == (model, L, eng)]
            row.update(av.vllm_kv(out["vllm"][sel[0]["vllm_worker"]], int(row["prompt_tokens"]) +
                                  out["setting"]["max_new_tokens"] - 1, warm))
        else:
            row["kv_bytes"] = statistics.median(m["kv_bytes"] for m in sel)
            row["stored_tokens"] = statistics.median(m["stored_tokens"] for m in sel)
            dens = [m["prefill_stats"]["density"] for m in sel if m.get("prefill_stats")]
            row["prefill_density"] = statistics.median(dens) if dens else None
            row["kv_bytes_source"] = "kvtrim result.kv_bytes (resident tensors)"
        rows.append(row)
    out["summary"] = rows
    out["comparison"] = compare(rows)
    return out


def compare(rows: list) -> list:
    """Each kvtrim row against the vLLM row of the same model and length: ratios and the targets."""
    res = []
    for k in (r for r in rows if r["engine"].startswith("kvtrim:")):
        v = next((r for r in rows if r["engine"].startswith("vllm:") and (r["model"], r["length"]) == (k["model"], k["length"])), None)
        if v is None:
            continue
        kept = [rep for rep, ok in v["correct_by_rep"].items() if ok]
        agree = [av.prefix_match(k["tokens_by_rep"][rep], v["tokens_by_rep"][rep]) for rep in k["tokens_by_rep"]
                 if rep in v["tokens_by_rep"]]
        c = {"model": k["model"], "length": k["length"], "prompt_tokens": k["prompt_tokens"], "kvtrim": k["config"],
             "vllm": v["engine"], "kv_ratio": k["kv_bytes"] / v["kv_bytes"] if v.get("kv_bytes") else None,
             "correct_kvtrim": k["correct"], "correct_vllm": v["correct"], "n": k["n"],
             "answers_kept": all(k["correct_by_rep"].get(rep) for rep in kept),
             "greedy_prefix_match_vs_vllm": agree, "new_tokens": len(next(iter(k["tokens_by_rep"].values())))}
        for q in ("e2e_seconds", "prefill_seconds", "decode_ms_per_token"):
            c[f"{q}_vllm_over_kvtrim"] = v[q] / k[q]  # > 1: kvtrim is faster
        c["target_e2e"] = k["e2e_seconds"] < v["e2e_seconds"]
        c["target_kv"] = c["kv_ratio"] is not None and c["kv_ratio"] <= KV_TARGET
        c["target_met"] = c["target_e2e"] and c["target_kv"] and c["answers_kept"]
        res.append(c)
    return res


def winner(ratio: float) -> str:
    """``vLLM time / kvtrim time`` as who is faster and by how much."""
    return f"kvtrim {ratio:.2f}x" if ratio >= 1 else f"vLLM {1 / ratio:.2f}x"


def winners(c: dict) -> list[str]:
    """Who is faster in a comparison row, end to end, in prefill and in decode (:func:`winner` each)."""
    return [winner(c[f"{q}_vllm_over_kvtrim"]) for q in ("e2e_seconds", "prefill_seconds", "decode_ms_per_token")]


def missed_targets(c: dict) -> list[str]:
    """The parts of the target a comparison row misses: end to end, KV, answers (empty: met)."""
    return [w for w, ok in (("end to end", c["target_e2e"]), ("KV", c["target_kv"]), ("answers", c["answers_kept"])) if not ok]


def table(res: dict) -> str:
    """Every row (both engines), then each kvtrim row against vLLM's stated both ways, and the target verdict."""
    s = res["setting"]
    lines = []
    if s.get("label"):
        lines += [f"**{s['label']}**", ""]
    lines += [
        f"threads {s['threads']} per side; kvtrim {s['kvtrim_dtype']}, vLLM {s['vllm_dtype']}; medians of {s['reps']} reps "
        f"after 1 warm-up; {s['max_new_tokens']} new tokens (end to end = prefill + {s['max_new_tokens'] - 1} decode steps); "
        f"date {res['machine']['date']}",
        "",
        "| model | length | prompt tokens | engine | config | prefill s | prefill density | decode ms/token | end to end s "
        "| prefill CPU s | decode CPU ms/token | KV MiB | pass key | load (1 min) |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["summary"]:
        kv = f"{r['kv_bytes'] / 2**20:.1f}" if r.get("kv_bytes") else "-"
        cpu = " | ".join(f"{r[k]:{f}}" if r.get(k) is not None else "-"
                         for k, f in (("prefill_cpu_seconds", ".2f"), ("decode_cpu_ms_per_token", ".1f")))
        dens = f"{r['prefill_density']:.3f}" if r.get("prefill_density") is not None else "1 (dense)"
        lines.append(f"| {r['model']} | {r['length']} | {int(r['prompt_tokens'])} | {r['engine'].split(':')[0]} | "
                     f"{r['config']} ({r['dtype']}) | {r['prefill_seconds']:.2f} | {dens} | {r['decode_ms_per_token']:.1f} | "
                     f"{r['e2e_seconds']:.2f} | {cpu} | {kv} | {r['correct']}/{r['n']} | {r['loadavg_1min_median']:.2f} |")
    lines += [
        "",
        f"| model | length | kvtrim config | end to end: faster | prefill: faster | decode: faster | KV kvtrim / vLLM "
        f"| pass key kvtrim / vLLM | same greedy tokens as vLLM | target (end to end < vLLM, KV <= {KV_TARGET}x, answers kept) |",
        "|---|---:|---|---|---|---|---:|---:|---:|---|",
    ]
    for c in res["comparison"]:
        kvr = f"{c['kv_ratio']:.3f}x" if c["kv_ratio"] is not None else "-"
        missed = missed_targets(c)
        lines.append(f"| {c['model']} | {c['length']} | {c['kvtrim']} | {' | '.join(winners(c))} | {kvr} | "
                     f"{c['correct_kvtrim']}/{c['n']} / {c['correct_vllm']}/{c['n']} | "
                     f"{', '.join(map(str, c['greedy_prefix_match_vs_vllm']))} of {c['new_tokens']} | "
                     + ("met" if c["target_met"] else "missed: " + ", ".join(missed)) + " |")
    lines += ["", "faster = the engine that took less time, by (slower time / faster time). vLLM KV = blocks the "
              "request occupies (prompt + generated tokens) x block bytes; kvtrim KV = resident key/value tensors "
              "after generation. CPU = CPU seconds of the engine's processes in the phase (vLLM: front end + engine core + "
              "model worker), less sensitive than wall time to other load. same greedy tokens = leading generated tokens equal to vLLM's, per rep. prefill density = share of the causal attention blocks the sparse prefill computed. "
              "answers kept = kvtrim answers every sample that dense vLLM answers."]
    rope = [f"{m} at {L}: linear x{p['factor']:g}" for m, d in res.get("models", {}).items()
            for L, p in d["rope"].items() if p["factor"] > 1]
    if rope:
        lines.append("RoPE scaled on both sides (past the trained context): " + "; ".join(rope) + ".")
    return "\n".join(lines)


def verdict(res: dict, path: str) -> str:
    """One line per kvtrim configuration of a results file: who is faster end to end, in prefill and
    in decode, the KV ratio and the target, with the machine it ran on (for prose that quotes a run)."""
    m, s = res["machine"], res["setting"]
    flags = m.get("cpu_matrix_flags")
    amx = "CPU flags not recorded" if flags is None else "with AMX" if any(f.startswith("amx") for f in flags) else "without AMX"
    lines = [f"`{path}` ({m['date'][:10]}, {m.get('cpu_model') or m.get('processor', '?')}, {amx}, "
             f"{s['threads']} threads per side, medians of {s['reps']}):", ""]
    for c in res["comparison"]:
        kvr = f"{c['kv_ratio']:.2f}x vLLM's" if c["kv_ratio"] is not None else "not measured"
        missed = missed_targets(c)
        e2e, pre, dec = winners(c)
        lines.append(f"- {c['model']}, {c['length']} tokens, {c['kvtrim']}: end to end {e2e}, prefill {pre}, decode {dec}; "
                     f"KV {kvr}; target "
                     + ("met" if c["target_met"] else "missed (" + ", ".join(missed) + ")") + ".")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", metavar="JSON", help="print the tables of a results file and exit")
    p.add_argument("--verdict", metavar="JSON", nargs="+",
                   help="print one line per kvtrim configuration of each results file (who is faster, the target) and exit")
    p.add_argument("--out", help="the result JSON (required to measure; an existing file is refused unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--model", nargs="+", default=["smollm2"],
                   help="one or more models (kvtrim --model names: smollm2 = the embedded default, qwen2.5-0.5b, a directory)")
    p.add_argument("--lengths", type=int, nargs="+", default=[7680, 32000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new", type=int, default=65, help="new tokens (the first comes from the prefill)")
    p.add_argument("--kvtrim-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--vllm-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kvtrim-configs", nargs="+", default=["snapkv+minference"],
                   help="METHOD[@KEEP][+minference], e.g. snapkv+minference snapkv@0.1+minference full")
    p.add_argument("--keep", type=float, default=0.25, help="KEEP of a config that names none")
    p.add_argument("--min-length", type=int, default=4096, help="MInference: shorter prompts prefill dense")
    p.add_argument("--rope-context", type=int, default=0,
                   help="run every length with the context this asks for (linear RoPE scaling on both sides when it "
                        "exceeds the trained context; checks the scaled path on short prompts); default: what each length needs")
    p.add_argument("--kv-space-gib", type=int, default=2, help="vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--no-preload", action="store_true", help="do not LD_PRELOAD tcmalloc/libiomp5 for vLLM")
    p.add_argument("--rope-check", type=float, nargs="+", metavar="FACTOR",
                   help="only compare vLLM's and transformers' linear RoPE at these factors (q, k rotated by both); "
                        "prints JSON, writes it to --out when given")
    p.add_argument("--rope-check-worker", type=float, nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--rope-theta", type=float, default=100000.0, help=argparse.SUPPRESS)
    p.add_argument("--head-dim", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--positions", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help="a line the table prints first (e.g. that a run is a smoke run)")
    p.add_argument("--log", default=str(av.VENV / "beat_vllm.log"), help="vLLM worker log")
    args = p.parse_args()
    if args.rope_check_worker:
        rope_check_worker(args.rope_check_worker, args.rope_theta, args.head_dim, args.positions)
        return
    if args.rope_check:
        res = rope_check(args.rope_check, args.rope_theta, args.head_dim, args.positions)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return
    if args.table:
        print(table(summarize(json.loads(Path(args.table).read_text()))))
        return
    if args.verdict:
        print("\n\n".join(verdict(summarize(json.loads(Path(f).read_text())), f) for f in args.verdict))
        return
    from kvtrim import harness

    if harness.start(p, args):
        return
    for c in args.kvtrim_configs:
        parse_config(c, args.keep)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill PID` still shuts the vLLM subprocess down
    res = run(args)
    harness.write_json(args.out, res)
    print(table(res))


if __name__ == "__main__":
    main()
