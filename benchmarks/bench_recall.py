"""Multi-turn recall: inf_mllm (attention bias swept) vs streaming_llm vs h2o at equal budgets, full cache as reference.

Each sample is a :func:`kvtrim.eval.recall.recall_sample` conversation (facts, unrelated package
prose, then questions), played on a :class:`kvtrim.session.Session` per configuration. Samples are
the outer loop and configurations the inner one, so a run stopped by ``--max-seconds`` has the same
samples for every configuration. Score: exact match of the first number in each answer.

    OMP_NUM_THREADS=1 python benchmarks/bench_recall.py --samples 20 --budgets 256,512 --biases 0,0.25,1,4,16 \
        --max-seconds 1800 --out results/recall.json   # as the committed run (stopped after 15 samples); writes results/recall.json
    python benchmarks/bench_recall.py --table benchmarks/results/recall.json   # its table in docs/results.md

The configurations of one sample run through :func:`kvtrim.harness.interleave` (one round, the
full cache first: the others are scored against its answers), which times each.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtrim import harness


def configs(budgets: list[int], biases: list[float], histories: tuple[float, ...] = (),
            baselines: tuple[str, ...] = ("streaming_llm", "h2o"),
            history_biases: tuple[float, ...] | None = None) -> list[tuple[str, str, dict]]:
    """(label, method, parameters): the full cache once, then every method at every budget.

    ``histories``: ``inf_mllm``'s saddle memory (``history``), each with every bias of
    ``history_biases`` (default: ``biases``), after the plain ``inf_mllm`` rows; ``baselines``: the
    other methods (``snapkv`` may be added).
    """
    hb = biases if history_biases is None else history_biases
    out = [("full", "full", {})]
    for budget in budgets:
        out += [(f"inf_mllm(bias={b:g})@{budget}", "inf_mllm", {"max_tokens": budget, "bias": b}) for b in biases]
        out += [(f"inf_mllm(bias={b:g},history={h:g})@{budget}", "inf_mllm", {"max_tokens": budget, "bias": b, "history": h})
                for h in histories for b in hb]
        for m in baselines:
            kw: dict = {"max_tokens": budget}
            if m == "h2o":
                kw["position"] = "reassigned"
            out.append((f"{m}@{budget}", m, kw))
    return out


def table(r: dict) -> str:
    """Markdown table of a recall result."""
    n = len(r["samples"])
    budgets = r.get("budgets", [r.get("budget")])
    lengths = [s["conversation_tokens"] for s in r["samples"]]
    lines = [f"Budgets {', '.join(str(b) for b in budgets)} tokens per layer and KV head (`@` in the config name); {n} conversations "
             f"of {min(lengths)}-{max(lengths)} tokens, {r['task']['n_facts']} questions each; exact match of the first number.", "",
             "| config | correct | of the questions the full cache answers | max stored tokens |", "|---|---:|---:|---:|"]
    for label, v in r["summary"].items():
        ref = f"{v['correct_where_full_correct']:.0f}/{v['full_correct']}"
        lines.append(f"| {label} | {v['correct']:.0f}/{v['questions']} | {ref} | {v['max_stored']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="256", help="comma-separated max_tokens budgets")
    ap.add_argument("--biases", default="0,1,8")
    ap.add_argument("--histories", default="", help="comma-separated inf_mllm saddle-memory values (history) to add")
    ap.add_argument("--history-biases", default=None, help="biases for the --histories rows (default: --biases)")
    ap.add_argument("--baselines", default="streaming_llm,h2o", help="comma-separated methods beside inf_mllm")
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2; e.g. qwen2.5-0.5b)")
    ap.add_argument("--n-facts", type=int, default=3)
    ap.add_argument("--context-turns", type=int, default=2)
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--max-seconds", type=float, default=None)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0

    from kvtrim.eval.recall import recall_sample, run_recall
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy
    from kvtrim.session import Session

    lm = load_model(args.model)
    budgets = [int(b) for b in args.budgets.split(",")]
    cfgs = configs(budgets, [float(b) for b in args.biases.split(",")],
                   tuple(float(h) for h in args.histories.split(",") if h),
                   tuple(m for m in args.baselines.split(",") if m),
                   None if args.history_biases is None else tuple(float(b) for b in args.history_biases.split(",")))
    by_label = {c[0]: c for c in cfgs}
    result = {"benchmark": "recall", "model": lm.source, "dtype": "float32", "info": harness.machine_record(),
              "task": {"n_facts": args.n_facts, "context_turns": args.context_turns, "context_tokens": args.context_tokens,
                       "max_new_tokens": args.max_new_tokens, "seed": args.seed, "metric": "exact match of the first number"},
              "budgets": budgets, "samples": [], "configs": {label: {"policy": create_policy(m, **kw).describe()}
                                                                for label, m, kw in cfgs}}
    t0 = time.perf_counter()

    def save(final):
        summary = {}
        for label, _, _ in cfgs:
            rows = [q for s in result["samples"] for q in s["results"].get(label, [])]
            full_ok = [q["full_correct"] for s in result["samples"] for q in s["results"].get(label, [])]
            summary[label] = {
                "questions": len(rows),
                "correct": sum(q["score"] for q in rows),
                "accuracy": sum(q["score"] for q in rows) / len(rows) if rows else None,
                "correct_where_full_correct": sum(q["score"] for q, f in zip(rows, full_ok) if f),
                "full_correct": sum(full_ok),
                "max_stored": max((q["stored"] for q in rows), default=None),
            }
        result["summary"] = summary
        result["complete"] = final
        result["wall_seconds"] = time.perf_counter() - t0
        harness.finish_record(result["info"])
        harness.write_json(args.out, result)

    for i in range(args.samples):
        seed = args.seed * 1000 + i
        smp = recall_sample(lm.tokenizer, n_facts=args.n_facts, context_turns=args.context_turns,
                            context_tokens=args.context_tokens, seed=seed)
        rec = {"seed": seed, "keys": smp.meta["keys"], "values": smp.meta["values"], "results": {}}
        full_scores: list = []

        def one(label: str, rep: int) -> list[dict]:
            _, m, kw = by_label[label]
            s = Session(lm.model, lm.tokenizer, create_policy(m, **kw))
            rows = run_recall(s, smp, max_new_tokens=args.max_new_tokens)
            if not full_scores:  # the first configuration is the full cache
                full_scores.extend(r["score"] for r in rows)
            for r, f in zip(rows, full_scores):
                r["full_correct"] = bool(f)
            rec["conversation_tokens"] = s.seen
            print(f"sample {i} {label}: {[r['score'] for r in rows]} {[r['reply'][:20] for r in rows]}", file=sys.stderr, flush=True)
            return rows

        got = harness.interleave(list(by_label), one, reps=1, how="fixed")
        rec["results"] = {label: ss[0].value for label, ss in got.items()}
        rec["seconds"] = {label: ss[0].seconds for label, ss in got.items()}
        result["samples"].append(rec)
        save(False)
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
            break
    save(True)
    for label, v in result["summary"].items():
        print(f"{label:<22} {v['correct']:.0f}/{v['questions']}  (of the {v['full_correct']} the full cache answers: "
              f"{v['correct_where_full_correct']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
