"""MInference quality on a model (default: the embedded one): pass-key retrieval and perplexity, sparse vs dense prefill.

- Pass key: ``--lengths`` x ``--depths`` samples (essay haystack, kvtrim.eval.tasks.passkey),
  full KV cache, greedy, 16 new tokens; each sample is answered with dense prefill and with each
  sparse prefill (``minference`` = the shipped or given per-head config, plus any single-pattern
  modes asked for). Sparse prefill is forced on every prompt (``min_length=1``), so short prompts
  are judged too. Decode is dense in every case (MInference is a prefill method).
- Perplexity: the first ``--ppl-tokens`` tokens of a package text, one prefill forward, dense vs
  sparse (the loss forms the logits in chunks of positions).

Output (:mod:`kvtrim.harness`): JSON (machine record, per-sample rows, summary). Example::

    python benchmarks/minference_quality.py --out results/minference_quality.json        # writes results/minference_quality.json
    python benchmarks/minference_quality.py --table benchmarks/results/minference_quality.json   # its table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
from tqdm import tqdm

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.cli.common import rope_scaling_arg
from kvtrim.data import pydoc_text
from kvtrim.eval.tasks import passkey
from kvtrim.generation import generate_ids
from kvtrim.integrations.hf import attach
from kvtrim.integrations.prefill import SparsePrefill, make_prefill
from kvtrim.models import build_prompt_ids, extend_context, load_model
from kvtrim.policies.full import Full
from kvtrim.rope import scaling_label


def table(d: dict) -> str:
    """The markdown table of a quality result (docs/minference.md)."""
    s = d["summary"]
    lengths = sorted({r["length"] for r in d["rows"] if r["kind"] == "passkey"})
    ppl_lengths = sorted({int(r["tokens"]) for r in d["rows"] if r["kind"] == "perplexity"})

    def k(n: int) -> str:
        return f"{n // 1024 if n % 1024 == 0 else round(n / 1000)}k"

    if not lengths:  # perplexity only
        lines = ["| prefill | " + " | ".join(f"ppl {k(n)} (vs dense)" for n in ppl_lengths) + " |",
                 "|---|" + "---:|" * len(ppl_lengths)]
        for name, v in s.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{v['perplexity'][str(n)]:.3f} ({v['perplexity_vs_dense'][str(n)] - 1:+.2%}, density {v['ppl_density'][str(n)]:.2f})"
                for n in ppl_lengths) + " |")
        return "\n".join(lines)
    head = "| " + " | ".join(["prefill", *(f"pass key {n}" for n in lengths), "pass key all", "vs dense",
                              *(f"ppl {k(n)} (vs dense)" for n in ppl_lengths), "mean density"]) + " |"
    lines = [head, "|---|" + "---:|" * (len(lengths) + 3 + len(ppl_lengths))]
    for name, v in s.items():
        cells = []
        for n in lengths:
            rr = [r for r in d["rows"] if r["kind"] == "passkey" and r["prefill"] == name and r["length"] == n]
            cells.append(f"{sum(r['correct'] for r in rr)}/{len(rr)}")
        ppl = []
        for n in map(str, ppl_lengths):
            if n in v["perplexity"]:
                ppl.append(f"{v['perplexity'][n]:.3f} ({v['perplexity_vs_dense'][n] - 1:+.2%}, density {v['ppl_density'][n]:.2f})")
            else:
                ppl.append("")
        lines.append("| " + " | ".join([name, *cells, f"{v['passkey_correct']}/{v['passkey_samples']}",
                                         f"{v['passkey_vs_dense']:.0%}", *ppl, f"{v['mean_density']:.2f}"]) + " |")
    # prefill time of the pass-key prompts: same process, configurations alternating per sample
    times = []
    for n in lengths:
        med = {name: statistics.median(r["prefill_seconds"] for r in d["rows"]
                                       if r["kind"] == "passkey" and r["prefill"] == name and r["length"] == n)
               for name in s}
        times.append(f"{n}: " + ", ".join(f"{name} {med[name]:.1f} s" + ("" if name == "dense" else f" ({med['dense'] / med[name]:.2f}x)")
                                          for name in s))
    dt = "" if d.get("dtype", "float32") == "float32" else f"{d['dtype']}, {d['machine'].get('torch_threads')} threads; "
    lines += ["", "Median prefill seconds of the pass-key prompts (" + dt + "each sample ran every configuration in turn, one "
              "process; a check, not the timing benchmark): " + "; ".join(times) + "."]
    return "\n".join(lines)


def _hooks(model, args) -> dict[str, SparsePrefill | None]:
    hooks: dict[str, SparsePrefill | None] = {"dense": None}
    hooks["minference"] = make_prefill(model, "minference", args.pattern_config, min_length=1)
    for spec in args.extra_config:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in hooks:
            raise SystemExit(f"--extra-config takes NAME=FILE with a new NAME; got {spec!r}")
        hooks[name] = make_prefill(model, "minference", path, min_length=1)
    for spec in args.single or []:
        name, _, rest = spec.partition(":")
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}
        hooks[spec] = SparsePrefill(name, sizes=sizes, min_length=1)
    return hooks


#: Prompt positions whose logits are formed at once when computing the perplexity loss.
LOSS_CHUNK = 1024


@torch.inference_mode()
def perplexity(model, ids: list[int], hook) -> tuple[float, dict | None]:
    """Perplexity of ``ids`` from one prefill forward (dense or sparse prefill).

    The forward returns the final hidden states (the output head is swapped for an identity while it
    runs); the loss then forms the logits ``LOSS_CHUNK`` positions at a time, so a 32k-token prompt
    never holds a ``[32k, vocab]`` float32 matrix (19.5 GB for Qwen's 152k vocabulary).
    """
    cache = KVTrimCache(model, "full")
    if hook is not None:
        hook.reset_stats()
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        with attach(model, prefill_attention=hook):
            hidden = decoding.run(model, decoding.prefill(cache, ids, all_logits=True))[:-1]
    finally:
        model.set_output_embeddings(head)
    target = torch.tensor(ids[1:], device=hidden.device)
    total = 0.0
    for i in range(0, len(target), LOSS_CHUNK):
        logits = head(hidden[i:i + LOSS_CHUNK].to(head.weight.dtype)).float()
        total += float(torch.nn.functional.cross_entropy(logits, target[i:i + LOSS_CHUNK], reduction="sum"))
    nll = total / len(target)
    return math.exp(nll), (hook.stats() if hook is not None else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    p.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 3072, 4096],
                   help="pass-key prompt lengths (none: perplexity only)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    p.add_argument("--pattern-config", default=None, help="default: the config shipped for the model")
    p.add_argument("--single", nargs="*", help="extra single-pattern modes, e.g. block_sparse:k_b=8")
    p.add_argument("--extra-config", nargs="*", default=[], metavar="NAME=FILE",
                   help="more per-head configs to compare, each under its NAME (e.g. a config searched at another length)")
    p.add_argument("--ppl-tokens", type=int, nargs="*", default=[4096, 8000], help="perplexity lengths (none: pass key only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model (default: the embedded one), e.g. qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight and KV dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--rope-scaling", type=rope_scaling_arg, default=None, metavar="KIND:FACTOR",
                   help="stretch the model's RoPE past its trained context (kvtrim.models.extend_context), e.g. yarn:2")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if harness.start(p, args, table=table):
        return 0
    machine = harness.machine_record()

    lm = load_model(args.model, dtype=args.dtype)
    model, tok = lm.model, lm.tokenizer
    if args.rope_scaling:
        kind, factor = args.rope_scaling
        extend_context(model, factor, kind)
    hooks = _hooks(model, args)
    rows = []
    jobs = [(n, d) for n in args.lengths for d in args.depths]
    for n, depth in tqdm(jobs, desc="pass key", unit="sample"):
        s = passkey(tok, n, depth=depth, seed=args.seed + int(depth * 100) + n)
        ids = build_prompt_ids(tok, s.prompt)
        for name, hook in hooks.items():
            r = generate_ids(model, tok, ids, Full(), max_new_tokens=16, prefill=hook)
            rows.append({
                "kind": "passkey", "length": n, "prompt_tokens": len(ids), "depth": depth, "prefill": name,
                "correct": s.answers[0] in r.answer, "answer": r.answer[:40], "prefill_seconds": r.prefill_seconds,
                "density": r.prefill["density"] if r.prefill else 1.0,
                "config_length": r.prefill.get("config_length") if r.prefill else None,
            })
    ppl = []
    text_ids = tok(pydoc_text())["input_ids"]
    for n in args.ppl_tokens:
        ids = text_ids[:n]
        for name, hook in hooks.items():
            val, st = perplexity(model, ids, hook)
            ppl.append({"kind": "perplexity", "text": "pydoc topics", "tokens": n, "prefill": name, "perplexity": val,
                        "density": st["density"] if st else 1.0})
            print(json.dumps(ppl[-1]), file=sys.stderr)
    summary = {}
    for name in hooks:
        pk = [r for r in rows if r["prefill"] == name]
        dense_ok = [r for r in rows if r["prefill"] == "dense"]
        summary[name] = {
            "passkey_correct": sum(r["correct"] for r in pk),
            "passkey_samples": len(pk),
            "passkey_vs_dense": (sum(r["correct"] for r in pk) / max(1, sum(r["correct"] for r in dense_ok))),
            "mean_density": sum(r["density"] for r in pk) / max(1, len(pk)),
            "perplexity": {str(r["tokens"]): r["perplexity"] for r in ppl if r["prefill"] == name},
            "perplexity_vs_dense": {
                str(r["tokens"]): r["perplexity"] / next(x["perplexity"] for x in ppl if x["prefill"] == "dense" and x["tokens"] == r["tokens"])
                for r in ppl if r["prefill"] == name
            },
            "ppl_density": {str(r["tokens"]): r["density"] for r in ppl if r["prefill"] == name},
        }
    out = {
        "benchmark": "minference_quality",
        "date": machine["date"],
        "machine": harness.finish_record(machine),
        "model": lm.source,
        "dtype": args.dtype,
        "rope_scaling": scaling_label(*args.rope_scaling) if args.rope_scaling else None,
        "context": int(model.config.max_position_embeddings),
        "pattern_config_search": hooks["minference"].config.search,
        "pattern_config_searches": [c.search for c in hooks["minference"].configs],  # one is picked per prompt length
        "summary": summary,
        "rows": rows + ppl,
    }
    harness.write_json(args.out, out)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
