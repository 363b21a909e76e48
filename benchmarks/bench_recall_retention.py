"""How much of the early facts survives the unrelated turns: fact-token retention per method and bias.

Plays the fact and context turns of :func:`kvtrim.eval.recall.recall_sample` conversations (no
generation), then measures, for each fact turn, the fraction of its tokens still stored, averaged
over layers and KV heads. This isolates what the attention bias does to long-range retention, the
mechanism behind the recall scores of ``bench_recall.py``.

    nice -n 10 python benchmarks/bench_recall_retention.py --samples 10 --budget 512 --out results/recall_retention.json
    # writes results/recall_retention.json (the committed one is benchmarks/results/recall_retention.json)
"""

from __future__ import annotations

import argparse
import sys
import time

# the script's folder is on the path when it runs (python benchmarks/bench_recall_retention.py)
from bench_recall import configs

from kvtrim import harness


def fact_retention(session, sample) -> list[float]:
    spans = []
    for t in sample.turns:
        if t.kind == "question":
            break
        a = session.seen
        session.add_turn(t.user, t.reply)
        if t.kind == "fact":
            spans.append((a, session.seen))
    out = []
    for a, b in spans:
        fr = [((layer.positions >= a) & (layer.positions < b)).sum(-1).float().mean().item() / (b - a)
              for layer in session.cache.compressed_layers]
        out.append(sum(fr) / len(fr))
    return out


def table(r: dict) -> str:
    """Markdown table of a retention result: mean fraction of the fact turns' tokens still stored."""
    n = len(r["samples"])
    lengths = [s["conversation_tokens"] for s in r["samples"]]
    lines = [f"{r['model']}, budget {r['budget']} tokens per layer and KV head; {n} conversations of {min(lengths)}-{max(lengths)} "
             f"tokens before the questions; fraction of the fact turns' tokens still stored (mean over facts, layers and KV heads).", "",
             "| config | facts kept |", "|---|---:|"]
    lines += [f"| {label} | {v:.1%} |" for label, v in r["mean_retention"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--biases", default="0,0.25,1,4,16")
    ap.add_argument("--histories", default="", help="comma-separated inf_mllm saddle-memory values (history) to add")
    ap.add_argument("--baselines", default="streaming_llm,h2o", help="comma-separated methods beside inf_mllm")
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2; e.g. qwen2.5-0.5b)")
    ap.add_argument("--context-turns", type=int, default=2)
    ap.add_argument("--context-tokens", type=int, default=300)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0

    from kvtrim.eval.recall import recall_sample
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy
    from kvtrim.session import Session

    lm = load_model(args.model)
    cfgs = [c for c in configs([args.budget], [float(b) for b in args.biases.split(",")],
                               tuple(float(h) for h in args.histories.split(",") if h),
                               tuple(m for m in args.baselines.split(",") if m)) if c[1] != "full"]
    res = {"benchmark": "recall_retention", "model": lm.source, "info": harness.machine_record(), "budget": args.budget,
           "task": {"n_facts": 3, "context_turns": args.context_turns, "context_tokens": args.context_tokens},
           "samples": []}
    t0 = time.perf_counter()
    for i in range(args.samples):
        smp = recall_sample(lm.tokenizer, n_facts=3, context_turns=args.context_turns,
                            context_tokens=args.context_tokens, seed=args.seed * 1000 + i)
        rec = {"seed": smp.seed, "retention": {}}
        for label, m, kw in cfgs:
            s = Session(lm.model, lm.tokenizer, create_policy(m, **kw))
            rec["retention"][label] = fact_retention(s, smp)
            rec["conversation_tokens"] = s.seen
            print(f"sample {i} {label}: {[round(x, 2) for x in rec['retention'][label]]}", file=sys.stderr, flush=True)
        res["samples"].append(rec)
        res["mean_retention"] = {label: sum(sum(s["retention"][label]) / len(s["retention"][label]) for s in res["samples"])
                                 / len(res["samples"]) for label, _, _ in cfgs}
        res["wall_seconds"] = time.perf_counter() - t0
        harness.finish_record(res["info"])
        harness.write_json(args.out, res)
    for label, v in res["mean_retention"].items():
        print(f"{label:<22} {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
