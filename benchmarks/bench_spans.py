"""Selection that keeps whole spans: snapkv / inf_mllm selection variants on multi-token needles.

Each sample's prompt runs forward once (``kvtrim.eval.replay``); every configuration replays its
prefill compression on it and decodes greedily, all configurations of a sample together
(``kvtrim.integrations.batched.drive``), scored as ``kvtrim eval`` scores them. The variants are
policy parameters: snapkv's pooling ``kernel`` (symmetric max pooling, reaching ``kernel // 2``
tokens back and forward) and ``chunk`` (keep whole chunks of ``chunk`` consecutive tokens), and
inf_mllm's ``chunk``; ``--variants`` takes the labels of ``VARIANTS`` or any ``"method key=value ..."``
(``"snapkv kernel=11 window=16"``). A miss whose answer holds the start of the expected one (a code
without its last digit, "flower" for "flowerpot") is counted as ``cut``. ``--merge`` pools files
(other seeds, more variants on the same samples: a sample is told by its task, length, index, seed
and depth, and counts once per configuration).

    OMP_NUM_THREADS=1 python benchmarks/bench_spans.py --tasks niah_phrase,passkey,niah_single \\
        --lengths 1700,3200 --samples 8 --out benchmarks/results/spans/smollm2.json
    OMP_NUM_THREADS=1 python benchmarks/bench_spans.py --model qwen2.5-0.5b ... --out benchmarks/results/spans/qwen.json
    python benchmarks/bench_spans.py --table benchmarks/results/spans/smollm2.json
    python benchmarks/bench_spans.py --merge FILE ...   # the table in docs/methods.md (its files listed there)
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtrim import harness

#: (label, method, parameters besides keep)
VARIANTS = (
    ("snapkv", "snapkv", {}),
    ("snapkv kernel=11", "snapkv", {"kernel": 11}),
    ("snapkv kernel=15", "snapkv", {"kernel": 15}),
    ("snapkv chunk=4", "snapkv", {"chunk": 4}),
    ("snapkv chunk=8", "snapkv", {"chunk": 8}),
    ("snapkv chunk=16", "snapkv", {"chunk": 16}),
    ("snapkv chunk=8 kernel=11", "snapkv", {"chunk": 8, "kernel": 11}),
    ("snapkv chunk=8 kernel=3", "snapkv", {"chunk": 8, "kernel": 3}),
    ("snapkv kernel=21", "snapkv", {"kernel": 21}),
    ("snapkv kernel=11 layers=pyramid", "snapkv", {"kernel": 11, "layers": "pyramid"}),
    ("snapkv kernel=11 layers=adaptive", "snapkv", {"kernel": 11, "layers": "adaptive"}),
    ("snapkv window=64", "snapkv", {"window": 64}),
    ("snapkv window=64 chunk=8", "snapkv", {"window": 64, "chunk": 8}),
    ("inf_mllm", "inf_mllm", {}),
    ("inf_mllm chunk=8", "inf_mllm", {"chunk": 8}),
)


def variant(label: str) -> tuple[str, str, dict]:
    """A VARIANTS entry by its label, or one written ``"method key=value ..."`` (parameters read as
    ``kvtrim eval --methods`` reads them, :func:`kvtrim.registry.split_method`)."""
    from kvtrim.registry import split_method

    known = {lab: (lab, m, p) for lab, m, p in VARIANTS}
    if label in known:
        return known[label]
    method, params = split_method(":".join(label.split()))
    return label, method, params


def is_cut(prediction: str, answer: str) -> bool:
    """The prediction holds the answer's first two thirds (at least one character) but not the answer."""
    head = answer[: max(1, len(answer) * 2 // 3)]
    return head.lower() in prediction.lower()


def _sample_key(r: dict) -> tuple:
    """One prompt: its seed (``seed * 100003 + i``) and depth (spread over ``--samples``) tell apart
    runs with another ``--seed`` or sample count."""
    return r["task"], r["length"], r["sample"], r["seed"], r["depth"]


def summarize(rows: list[dict]) -> dict:
    """Per (task, length, keep, config): correct, n, correct where the full cache is correct, cut.
    A (sample, configuration) in several rows (two result files that ran the same samples, e.g. more
    variants added later) counts once: its first row."""
    first: dict = {}
    for r in rows:
        first.setdefault((*_sample_key(r), r["config"], r["keep"]), r)
    rows = list(first.values())
    full = {_sample_key(r): r["correct"] for r in rows if r["config"] == "full"}
    out: dict = {}
    for r in rows:
        key = f"{r['task']}@{r['length']}|{r['config']}" + ("" if r["keep"] is None else f"@{r['keep']:g}")
        c = out.setdefault(key, {"n": 0, "correct": 0, "where_full": 0, "full_correct": 0, "cut": 0,
                                 "cut_where_full": 0})
        c["n"] += 1
        c["correct"] += int(r["correct"])
        c["cut"] += int(r["cut"])
        if full.get(_sample_key(r)):
            c["full_correct"] += 1
            c["where_full"] += int(r["correct"])
            c["cut_where_full"] += int(r["cut"])
    return out


def table(r: dict) -> str:
    """Markdown: one row per configuration, one column per task@length (correct where full is correct)."""
    s = summarize(r["rows"]) if "rows" in r else r["summary"]  # files written before cut_where_full
    cols = list(dict.fromkeys(k.split("|")[0] for k in s))
    rank = {lab: i for i, (lab, _, _) in enumerate(VARIANTS)}
    cfgs = sorted(dict.fromkeys(k.split("|")[1] for k in s),
                  key=lambda c: (c != "full", c.rsplit("@", 1)[-1], rank.get(c.rsplit("@", 1)[0], len(rank)), c))
    lines = [f"{r['model']}; {r['samples']} samples per task and length; cells: correct / samples the full cache "
             "answers (of those, misses that kept the answer's start, 'cut', in brackets)", "",
             "| config | " + " | ".join(cols) + " | total |", "|---|" + "---:|" * (len(cols) + 1)]
    for cfg in cfgs:
        cells, tot, tot_n = [], 0, 0
        for col in cols:
            c = s.get(f"{col}|{cfg}")
            if c is None:
                cells.append("")
                continue
            if cfg == "full":
                cells.append(f"{c['correct']}/{c['n']}")
                tot, tot_n = tot + c["correct"], tot_n + c["n"]
            else:
                cut = f" ({c['cut_where_full']})" if c["cut_where_full"] else ""
                cells.append(f"{c['where_full']}/{c['full_correct']}{cut}")
                tot, tot_n = tot + c["where_full"], tot_n + c["full_correct"]
        lines.append(f"| {cfg} | " + " | ".join(cells) + f" | {tot}/{tot_n} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--model", default=None, help="model name or path (default: the embedded model)")
    ap.add_argument("--tasks", default="niah_phrase,passkey,niah_single")
    ap.add_argument("--lengths", default="1700,3200")
    ap.add_argument("--samples", type=int, default=8, help="per task and length (niah_phrase rotates its 4 families)")
    ap.add_argument("--keeps", default="0.2")
    ap.add_argument("--variants", default=None,
                    help='comma-separated labels of VARIANTS or "method key=value ..." (default: VARIANTS)')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, metavar="I,J",
                    help="run only these sample indices of each task and length (the same samples as without it)")
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="print one table of several result files and stop")
    args = ap.parse_args(argv)
    if args.merge:
        parts = [harness.read_result(f) for f in args.merge]
        for model in dict.fromkeys(p["model"] for p in parts):
            rows = [row for p in parts if p["model"] == model for row in p["rows"]]
            n = "/".join(sorted({str(p["samples"]) for p in parts if p["model"] == model}))
            print(table({"model": model, "samples": n, "summary": summarize(rows)}) + "\n")
        return 0
    if harness.start(ap, args, table=table):
        return 0
    import torch

    from kvtrim.eval.plan import MAX_NEW_TOKENS
    from kvtrim.eval.programs import config_program, prompt_ids
    from kvtrim.eval.replay import record_prefill
    from kvtrim.eval.tasks import make_samples
    from kvtrim.integrations.batched import drive
    from kvtrim.integrations.hf import attach
    from kvtrim.models import load_model

    torch.set_num_threads(1)
    variants = VARIANTS if args.variants is None else [variant(lab) for lab in args.variants.split(",")]
    keeps = [float(k) for k in args.keeps.split(",")]
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    lm = load_model(args.model)
    machine = harness.machine_record()
    result = {"command": "python benchmarks/bench_spans.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": lm.source, "samples": args.samples, "keeps": keeps, "variants": [list(v) for v in variants],
              "rows": []}
    t_start = time.time()
    for length in [int(x) for x in args.lengths.split(",")]:
        for task in args.tasks.split(","):
            for i, sample in enumerate(make_samples(task, lm.tokenizer, length, n=args.samples, seed=args.seed)):
                if only is not None and i not in only:
                    continue
                ids = prompt_ids(lm.tokenizer, sample)
                rec = record_prefill(lm.model, ids)
                memo: dict = {}
                configs = [("full", "full", None, {})] + [(lab, m, k, p) for k in keeps for lab, m, p in variants]
                programs = {(lab, k): config_program(lm.model, lm.tokenizer, sample, rec, m, k, memo, params=p)
                            for lab, m, k, p in configs}
                with attach(lm.model):
                    done = drive(lm.model, programs)
                for (lab, k), row in done.items():
                    result["rows"].append({
                        "task": task, "length": length, "sample": i, "seed": sample.seed, "depth": sample.depth,
                        "family": sample.meta.get("family"), "expected": sample.answers, "config": lab, "keep": k,
                        "prompt_tokens": len(ids), "correct": bool(row["correct"]), "answer": row["answer"],
                        "cut": (not row["correct"]) and any(is_cut(row["answer"], a) for a in sample.answers),
                        "stored_tokens": row["stored_tokens"], "max_new_tokens": MAX_NEW_TOKENS[task]})
                result["summary"] = summarize(result["rows"])
                result["seconds"] = round(time.time() - t_start, 1)
                result["machine"] = harness.finish_record(dict(machine))
                harness.write_json(args.out, result)
                print(f"{task}@{length} #{i} ({len(ids)} tokens) {time.time() - t_start:.0f}s", file=sys.stderr, flush=True)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
