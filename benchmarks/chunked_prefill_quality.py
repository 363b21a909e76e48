"""Needle answers after chunked prefill vs one forward: what compressing between chunks changes.

``kvtrim eval`` runs every prompt in one forward and replays it for each method
(``kvtrim.eval.replay``); chunked prefill cannot be replayed (each later chunk attends to the
cache the earlier chunks left), so this script runs it. For each needle sample (``kvtrim.eval``'s
``passkey`` and ``niah_single`` generators, depths spread evenly, the eval's seeds), the prompt's
forward runs once and is replayed for ``full`` and for each (method, keep) -- the one-forward
compression, exactly what ``kvtrim eval`` measures -- and then each (method, keep) prefills the
prompt again in chunks of ``--chunk`` tokens, compressing after every chunk
(:func:`kvtrim.decoding.prefill` with ``chunk``). Both decode greedily with the eval's stopping rule
and are scored with the eval's metric.

    python benchmarks/chunked_prefill_quality.py --model qwen2.5-0.5b --length 2048 --samples 5 \\
        --methods snapkv inf_mllm --keeps 0.1 0.25 --chunk 512 --out results/prefill_memory/quality_qwen.json
    python benchmarks/chunked_prefill_quality.py --table benchmarks/results/prefill_memory/quality_qwen.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.eval.metrics import score
from kvtrim.eval.plan import MAX_NEW_TOKENS
from kvtrim.eval.programs import answer_complete, prompt_ids
from kvtrim.eval.replay import record_prefill, replay
from kvtrim.eval.tasks import make_samples
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy


def answer(lm, cache, logits, sample) -> tuple[str, float]:
    """Greedy answer from a prefilled cache (the eval's stopping rule), and its score."""
    tok = lm.tokenizer
    eos = getattr(tok, "eos_token_id", None)

    def done(ids):
        return answer_complete(tok, sample.metric, ids, sample.answers, eos)

    out, _ = decoding.run(lm.model, decoding.decode(cache, logits, MAX_NEW_TOKENS[sample.task],
                                                    stop_ids=() if eos is None else (eos,), finished=done))
    text = tok.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
    return text, score(sample, text)


def configs(d: dict) -> list[tuple[str, float | None, int | None]]:
    seen: dict = {}
    for r in d["rows"]:
        seen.setdefault((r["method"], r["keep"], r["chunk"]), None)
    return list(seen)


def table(d: dict) -> str:
    """Correct answers per configuration and task (docs/memory.md)."""
    tasks = list(dict.fromkeys(r["task"] for r in d["rows"]))
    m = d["machine"]
    lines = [
        f"{d['model']}, float32, torch {m['torch']}, {d['date'][:10]}; {d['length']}-token prompts, {d['samples']} samples per "
        f"task (depths spread evenly); chunked = chunks of {d['chunk']} tokens, compressing after each.",
        "",
        "| method | keep | prefill | " + " | ".join(tasks) + " | all | same answer as one forward |",
        "|---|---:|---|" + "---:|" * (len(tasks) + 2),
    ]
    for method, keep, chunk in configs(d):
        rows = [r for r in d["rows"] if (r["method"], r["keep"], r["chunk"]) == (method, keep, chunk)]
        cells = []
        for t in tasks:
            rr = [r for r in rows if r["task"] == t]
            cells.append(f"{sum(r['score'] >= 1.0 for r in rr)}/{len(rr)}")
        same = ""
        if chunk:
            one = {(r["task"], r["sample"]): r["answer"] for r in d["rows"]
                   if (r["method"], r["keep"], r["chunk"]) == (method, keep, None)}
            same = f"{sum(one.get((r['task'], r['sample'])) == r['answer'] for r in rows)}/{len(rows)}"
        lines.append(f"| {method} | {'' if keep is None else keep} | {f'chunks of {chunk}' if chunk else 'one forward'} | "
                     + " | ".join(cells) + f" | {sum(r['score'] >= 1.0 for r in rows)}/{len(rows)} | {same} |")
    return "\n".join(lines)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None, threads=1)])
    p.add_argument("--model", default=None, help="model (default: the embedded one), e.g. qwen2.5-0.5b")
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah_single"])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=["snapkv", "inf_mllm"])
    p.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.25])
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    machine = harness.machine_record()
    lm = load_model(args.model)
    result: dict = {"benchmark": "chunked_prefill_quality", "date": machine["date"], "machine": machine,
                    "model": lm.source, "length": args.length, "samples": args.samples, "chunk": args.chunk,
                    "seed": args.seed, "rows": []}
    for task in args.tasks:
        for i, sample in enumerate(make_samples(task, lm.tokenizer, args.length, args.samples, seed=args.seed)):
            ids = prompt_ids(lm.tokenizer, sample)
            rec = record_prefill(lm.model, ids)
            runs = [("full", None, None)] + [(m, k, c) for m in args.methods for k in args.keeps for c in (None, args.chunk)]
            with attach(lm.model):
                for method, keep, chunk in runs:
                    policy = create_policy(method) if keep is None else create_policy(method, keep=keep)
                    t0 = time.perf_counter()
                    if chunk is None:
                        cache, logits = replay(lm.model, policy, rec), rec.logits
                    else:
                        cache = KVTrimCache(lm.model, policy)
                        logits = decoding.run(lm.model, decoding.prefill(cache, ids, chunk=decoding.check_prefill_chunk(policy, chunk)))
                    prefill_s = time.perf_counter() - t0 + (rec.seconds if chunk is None else 0.0)
                    stored = max(cache.stored_tokens())
                    text, value = answer(lm, cache, logits, sample)
                    row = {"task": task, "sample": i, "depth": sample.depth, "tokens": len(ids), "method": method,
                           "keep": keep, "chunk": chunk, "answer": text, "score": value, "expected": list(sample.answers),
                           "stored_tokens": stored, "prefill_seconds": prefill_s}
                    result["rows"].append(row)
                    print(f"{task} {i} {method} keep={keep} chunk={chunk}: {value:.0f} {text[:50]!r} ({prefill_s:.1f}s)",
                          file=sys.stderr, flush=True)
            harness.write_json(args.out, result)
    harness.publish(args.out, result, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
