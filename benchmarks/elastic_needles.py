"""Why Elastic Cache loses the needle: named Elastic variants against SnapKV on needle tasks (resumable per run).

For each sample of the needle tasks (``kvtrim.eval`` generators, the chat template) the prompt's forward
pass runs once (``kvtrim.eval.replay``); every configuration replays its prefill on the recording and
decodes greedily (the configurations of a sample decode together, ``kvtrim.integrations.batched``),
scored like ``kvtrim eval``. Configurations are named variants of ``elastic`` (parameters other than
``keep``, which ``kvtrim eval`` cannot pass) plus ``full`` and ``snapkv``.

Diagnostics per Elastic variant (``--diagnose``), from the same recorded q/k, averaged over layers and
samples: the share of the answer's tokens (the needle value) that become anchors; the mean size of
the buckets the answer tokens end up in (1 = kept exact); the share of the last 32 prompt tokens
(question + chat template) kept as anchors; the share of anchors in the first 10% of the prompt.

    python benchmarks/elastic_needles.py --model qwen2.5-0.5b --tasks niah_single,passkey --length 2048 \\
        --samples 5 --keep 0.1,0.25 --variants elastic,elastic-window32,snapkv --diagnose --out FILE.json
    python benchmarks/elastic_needles.py --table FILE.json
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kvtrim import harness

#: variant name -> (registered method, parameters besides ``keep``)
VARIANTS: dict[str, tuple[str, dict]] = {
    "full": ("full", {}),
    "snapkv": ("snapkv", {}),
    "h2o": ("h2o", {}),
    "local": ("streaming_llm", {}),
    "elastic": ("elastic", {}),
    "elastic-drop": ("elastic", {"combine": "drop"}),
    "elastic-window32": ("elastic", {"window": 32}),
    "elastic-drop-window32": ("elastic", {"combine": "drop", "window": 32}),
    "elastic-mean": ("elastic", {"importance": "mean"}),
    "elastic-mean-window32": ("elastic", {"importance": "mean", "window": 32}),
    "elastic-drop-mean": ("elastic", {"combine": "drop", "importance": "mean"}),
    "elastic-prop": ("elastic", {"proportional": True}),
    "elastic-prop-window32": ("elastic", {"proportional": True, "window": 32}),
    "elastic-align-window32": ("elastic", {"align": True, "window": 32}),
    "elastic-compressed": ("elastic", {"position": "compressed"}),
    "elastic-recent": ("elastic", {"eviction": "recent"}),
    "elastic-noevict": ("elastic-noevict", {}),
    "elastic-drop-noevict": ("elastic-noevict", {"combine": "drop"}),
    "elastic-window32-noevict": ("elastic-noevict", {"window": 32}),
    "elastic-query-window32-pool7": ("elastic", {"importance": "query", "window": 32, "kernel": 7}),
    "elastic-window32-pool7": ("elastic", {"window": 32, "kernel": 7}),
    "elastic-query": ("elastic", {"importance": "query"}),
    "elastic-query-window32": ("elastic", {"importance": "query", "window": 32}),
    "elastic-drop-query-window32": ("elastic", {"importance": "query", "window": 32, "combine": "drop"}),
}


def no_evict_policy(params: dict, memo: dict):
    """Elastic's prefill merge with decode-time eviction switched off (investigation: merging vs eviction)."""
    from kvtrim.policies.elastic import Elastic

    class ElasticNoEvict(Elastic):
        def on_decode(self, layer, query, key, scaling) -> None:
            return None

    pol = ElasticNoEvict(**params)
    pol.share_prefill_scores(memo)
    return pol


def answer_positions(tokenizer, ids: list[int], answer: str) -> list[int]:
    """Token indices of ``ids`` that overlap the last occurrence of ``answer`` in the decoded prompt."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text, starts = "", []
    for p in pieces:
        starts.append(len(text))
        text += p
    at = text.rfind(answer)
    if at < 0:
        return []
    end = at + len(answer)
    return [i for i, s in enumerate(starts) if s < end and s + len(pieces[i]) > at]


def diagnose(policy, record: dict, n: int, ans: list[int], memo: dict) -> dict:
    """Where the anchors of ``policy`` (an Elastic) go on one recorded prompt, averaged over layers
    (``memo``: importances already computed for this prompt, by importance kind and layer)."""
    from kvtrim.policies.elastic import nearest_anchor

    out = {"answer_anchored": [], "answer_bucket": [], "tail32_kept": [], "first10pct": []}
    budget = policy.budget(n)
    for i in sorted(record):
        q, k, _, scaling = record[i]
        key = (policy.importance, i)
        if key not in memo:
            memo[key] = policy.layer_importance(None, q, k, scaling)
        a = policy.select_anchors(memo[key], budget)[0]
        pos = torch.arange(n)
        is_anchor = torch.zeros(n, dtype=torch.bool)
        is_anchor[a] = True
        mergeable = a[(a >= policy.n_sinks) & (a < n - policy.n_last)]
        owner = torch.arange(n)
        if mergeable.numel():
            members = (~is_anchor).nonzero().squeeze(-1)
            owner[members] = mergeable[nearest_anchor(pos[members], mergeable)]
        size = torch.bincount(owner, minlength=n)
        if ans:
            at = torch.tensor(ans)
            out["answer_anchored"].append(float(is_anchor[at].float().mean()))
            out["answer_bucket"].append(float(size[owner[at]].float().mean()))
        out["tail32_kept"].append(float(is_anchor[-32:].float().mean()))
        out["first10pct"].append(float((a < n // 10).float().mean()))
    return {k: sum(v) / len(v) for k, v in out.items() if v}


def run(args, out_path: str | None = None) -> dict:
    from kvtrim.decoding import Wait, decode, teacher_forced_nll
    from kvtrim.eval.metrics import rouge_l
    from kvtrim.eval.metrics import score as score_text
    from kvtrim.eval.plan import MAX_NEW_TOKENS, build_sample, make_plan
    from kvtrim.eval.programs import answer_complete, prompt_ids
    from kvtrim.eval.replay import make_policy, record_prefill, replay
    from kvtrim.integrations.batched import drive
    from kvtrim.integrations.hf import attach
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    stop = () if eos is None else (eos,)
    keeps = [float(x) for x in args.keep.split(",")]
    names = ["full", *[v for v in args.variants.split(",") if v != "full"]]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    configs = [("full", None)] + [(v, k) for v in names if v != "full" for k in keeps]
    result = {"command": " ".join(["python", "benchmarks/elastic_needles.py", *sys.argv[1:]]),
              "model": args.model, "length": args.length, "samples": args.samples, "keeps": keeps,
              "variants": {v: VARIANTS[v] for v in names}, "start": harness.machine_record(), "rows": [], "diagnostics": []}
    for task in args.tasks.split(","):
        plan = make_plan(task, [args.length], "full", [0.5], samples=args.samples, seed=args.seed)
        for s in (build_sample(plan, tok, task, args.length, i) for i in range(args.samples)):  # kvtrim eval's samples
            ids = prompt_ids(tok, s)
            ans = answer_positions(tok, ids, s.answers[0]) if s.answers else []
            with attach(model), torch.inference_mode():
                rec = record_prefill(model, ids)
                memo: dict = {}

                def make(v, k, memo=memo):
                    method, params = VARIANTS[v]
                    p = dict(params) if k is None else {**params, "keep": k}
                    return no_evict_policy(p, memo) if method == "elastic-noevict" else make_policy(method, p, memo)

                def program(v, k, rec=rec, s=s, task=task):
                    cache = replay(model, make(v, k), rec)
                    if task == "labelfree":  # as kvtrim eval: ROUGE-L against the full answer + its NLL here
                        out, _ = yield from decode(cache, rec.logits, MAX_NEW_TOKENS[task], stop_ids=stop)
                        text = tok.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
                        if v == "full":
                            return {"score": 1.0, "answer": text, "answer_ids": out}
                        ref = (yield Wait(("full", None)))["answer_ids"]
                        ref_text = tok.decode([t for t in ref if t != eos], skip_special_tokens=True).strip()
                        nll = yield from teacher_forced_nll(replay(model, make(v, k), rec), rec.logits, list(ref))
                        return {"score": rouge_l(text, ref_text) if ref_text else float(text == ref_text),
                                "answer": text, "ref_nll_sum": nll, "ref_tokens": len(ref)}

                    def done(out, s=s):
                        return answer_complete(tok, s.metric, out, s.answers, eos)

                    out, _ = yield from decode(cache, rec.logits, MAX_NEW_TOKENS[task], stop_ids=stop, finished=done)
                    text = tok.decode([t for t in out if t != eos], skip_special_tokens=True).strip()
                    return {"score": score_text(s, text), "answer": text}

                res = drive(model, {c: program(*c) for c in configs})
                if args.diagnose:
                    imp_memo: dict = {}
                    for v in names:
                        method, params = VARIANTS[v]
                        if method != "elastic":  # (the noevict variants select exactly as their elastic twin)
                            continue
                        for k in keeps:
                            d = diagnose(create_policy("elastic", keep=k, **params), rec.record, len(ids), ans, imp_memo)
                            result["diagnostics"].append({"task": task, "sample": s.seed, "depth": s.depth,
                                                          "variant": v, "keep": k, **d})
            for (v, k), r in res.items():
                result["rows"].append({"task": task, "sample": s.seed, "depth": s.depth, "variant": v, "keep": k,
                                       "prompt_tokens": len(ids), "answer_tokens": len(ans), "expected": s.answers, **r})
            print(task, s.depth, {f"{v}@{k}": (round(r["score"], 2), r["answer"][:60]) for (v, k), r in res.items()},
                  flush=True)
            del rec, memo, res
            if out_path is not None:  # partial results survive an interruption
                result["summary"] = summarize(result)
                harness.write_json(out_path, result)
    result["end"] = harness.finish_record(harness.machine_record())
    result["summary"] = summarize(result)
    return result


def summarize(result: dict) -> dict:
    """Mean score per task / variant / keep, and mean diagnostics per variant / keep."""
    acc: dict = {}
    for r in result["rows"]:
        acc.setdefault(r["task"], {}).setdefault(r["variant"], {}).setdefault(str(r["keep"]), []).append(r["score"])
    out = {"scores": {t: {v: {k: sum(x) / len(x) for k, x in ks.items()} for v, ks in vs.items()} for t, vs in acc.items()}}
    nll: dict = {}
    for r in result["rows"]:
        if r.get("ref_nll_sum") is not None:
            c = nll.setdefault(r["task"], {}).setdefault(r["variant"], {}).setdefault(str(r["keep"]), [0.0, 0])
            c[0] += r["ref_nll_sum"]
            c[1] += r["ref_tokens"]
    if nll:  # labelfree: perplexity of the full cache's answers, pooled over all their tokens
        out["ref_ppl"] = {t: {v: {k: math.exp(a / n) for k, (a, n) in ks.items()} for v, ks in vs.items()} for t, vs in nll.items()}
    dg: dict = {}
    for d in result["diagnostics"]:
        cell = dg.setdefault(d["variant"], {}).setdefault(str(d["keep"]), {})
        for f in ("answer_anchored", "answer_bucket", "tail32_kept", "first10pct"):
            if f in d:
                cell.setdefault(f, []).append(d[f])
    out["diagnostics"] = {v: {k: {f: sum(x) / len(x) for f, x in c.items()} for k, c in ks.items()} for v, ks in dg.items()}
    return out


def table(result: dict) -> str:
    s = result["summary"]
    keeps = [str(k) for k in result["keeps"]]
    lines = [f"| task | variant | {' | '.join('keep ' + k for k in keeps)} |", "|---|---|" + "---:|" * len(keeps)]
    for t, vs in s["scores"].items():
        for v, ks in vs.items():
            cells = [f"{ks['None']:.2f}"] * len(keeps) if v == "full" else [f"{ks[k]:.2f}" if k in ks else "" for k in keeps]
            lines.append(f"| {t} | {v} | {' | '.join(cells)} |")
    for t, vs in s.get("ref_ppl", {}).items():
        lines += ["", f"{t}: perplexity of the full cache's answer (pooled; lower is better)", "",
                  f"| variant | {' | '.join('keep ' + k for k in keeps)} |", "|---|" + "---:|" * len(keeps)]
        for v, ks in vs.items():
            lines.append(f"| {v} | {' | '.join(f'{ks[k]:.3f}' if k in ks else '' for k in keeps)} |")
    if s["diagnostics"]:
        lines += ["", "| variant | keep | answer anchored | answer bucket size | last 32 kept | anchors in first 10% |",
                  "|---|---:|---:|---:|---:|---:|"]
        for v, ks in s["diagnostics"].items():
            for k, c in ks.items():
                lines.append(f"| {v} | {k} | {c.get('answer_anchored', float('nan')):.2f} | {c.get('answer_bucket', float('nan')):.1f} "
                             f"| {c['tail32_kept']:.2f} | {c['first10pct']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tasks", default="niah_single,passkey")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default="0.1,0.25")
    ap.add_argument("--variants", default="snapkv,elastic,elastic-window32")
    ap.add_argument("--diagnose", action="store_true", help="also record where the anchors go (per Elastic variant)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    result = run(args, args.out)
    harness.write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
