"""Quality proxy for DAP on the real text model: the document as a second modality.

No VLM weights exist offline, so HAE's prefill pruning is judged on a text proxy (documented as a
proxy, not a multimodal result): pass-key QA on the embedded SmolLM2-135M, where the haystack
document is tagged ``document`` (``kvtrim.spans``) and plays the image's role. DAP (first layer,
text rows = instruction + question + chat template, columns = document tokens) drops document
tokens by the r/alpha rule; the question comes after the document, so its rows see every
document token. Compared at the *same kept fraction*, per sample:

* ``fastv`` (K=2, last token's attention) with ``ratio`` = DAP's kept share of the document;
* ``snapkv`` with ``keep`` = DAP's stored tokens / prompt tokens (SnapKV may drop any token);
* ``full`` (reference). HAE runs in both DAP modes (prune hidden states / slice KV).

With the defaults (r=0.0015, alpha=0.0005) DAP keeps almost every document token on this model
(a ~60-row question gives most tokens a maximum attention above 0.0005), so the run also uses
two stricter operating points (``--points``).

``--ddes-keeps K1,K2`` adds DDES (HAE's decode eviction) at each cache budget ``keep``: ``hae``
with the default DAP point and ``keep`` (DAP at the prefill, then the recycle bin evicts down to
the budget from the first decoded token on), against ``h2o`` and ``snapkv`` at the same ``keep``.

Score: the 5-digit key contained in the greedy answer (16 new tokens). Samples: pass key at
several depths and seeds (``kvtrim.eval.tasks.passkey``), ``--length`` tokens. ``--model`` picks
the model (default the embedded SmolLM2; ``qwen2.5-0.5b`` for the reference model).

    python benchmarks/qa_proxy_dap.py --out results/qa_proxy_dap.json               # writes results/qa_proxy_dap.json
    python benchmarks/qa_proxy_dap.py --table benchmarks/results/qa_proxy_dap.json  # its table in docs/results.md
"""

from __future__ import annotations

import argparse
import json
import sys

from kvtrim import harness
from kvtrim.cache import KVTrimCache
from kvtrim.eval.tasks import passkey
from kvtrim.generation import generate_ids
from kvtrim.models import load_model, resolve_model
from kvtrim.registry import create_policy
from kvtrim.spans import Span, SpanSet


def table(d: dict) -> str:
    """The docs/results.md table of a DAP proxy result."""
    s = d["summary"]
    n = s["n"]
    out = [
        f"Proxy ({d['proxy']}): {d['model']}, pass key in ~{d['length']} tokens, {n} samples; full cache "
        f"{s['full']}/{n}.",
        "",
        "| DAP point | document kept | prompt kept | hae (prune) | hae (kv) | fastv (same share) | snapkv (same share) | compared |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, v in s.items():
        if not k.startswith("r="):
            continue
        c = v["compared_samples"]
        cmp = (lambda m: f"{v[m]}/{c}") if c else (lambda m: "-")
        out.append(
            f"| {k} | {v['mean_doc_kept_fraction']:.1%} | {v['mean_prompt_kept_fraction']:.1%} | {v['hae_prune']}/{n} | "
            f"{cmp('hae_kv')} | {cmp('fastv')} | {cmp('snapkv')} | {c} |"
        )
    ddes = {k[5:]: v for k, v in s.items() if k.startswith("ddes@")}
    if ddes:
        out += ["", "DDES: `hae` (default DAP point) with a cache budget, evicting while decoding, against `h2o` and "
                "`snapkv` at the same keep:", "", "| keep | hae (DAP + DDES) | h2o | snapkv |", "|---:|---:|---:|---:|"]
        out += [f"| {k} | {v['hae']}/{n} | {v['h2o']}/{n} | {v['snapkv']}/{n} |" for k, v in ddes.items()]
    return "\n".join(out)


def prompt_with_document_span(tok, sample) -> tuple[list[int], SpanSet]:
    chat = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True, tokenize=False)
    enc = tok(chat, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    a = chat.index(sample.context)
    b = a + len(sample.context)
    inside = [i for i, (s, e) in enumerate(offs) if s >= a and e <= b and e > s]
    return ids, SpanSet([Span(inside[0], inside[-1] + 1, "document")], len(ids))


def run(lm, ids, spans, policy, max_new=16):
    cache = KVTrimCache(lm.model, policy, spans=spans)
    res = generate_ids(lm.model, lm.tokenizer, ids, policy, max_new_tokens=max_new, cache=cache)
    st = cache.layers[0].state
    return res, cache, st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None, threads=2)])
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--depths", default="0.2,0.5,0.8")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2; e.g. qwen2.5-0.5b)")
    ap.add_argument("--ddes-keeps", default="", help="comma-separated cache budgets (keep) for the DDES comparison")
    ap.add_argument("--rows-from", metavar="LOG",
                    help="run nothing: build the result from the per-sample rows a stopped run printed to stderr "
                         "(same --points/--ddes-keeps/--length/--model as that run)")
    ap.add_argument("--points", default="0.0015:0.0005,0.0015:0.01,0.005:0.05",
                    help="DAP operating points r:alpha (the first is the default pair)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
    ddes_keeps = [float(k) for k in args.ddes_keeps.split(",") if k]
    rows: list[dict] = []
    if args.rows_from:
        with open(args.rows_from, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.startswith('{"seed"')]
        if not rows:
            ap.error(f"--rows-from: no sample rows in {args.rows_from}")
        source = resolve_model(args.model)[1]
    else:
        rows, source = run_samples(args, ddes_keeps)
    out = summarise(args, ddes_keeps, rows, source, machine)
    out["stopped_early"] = bool(args.rows_from)
    harness.write_json(args.out, out)
    print(table(out))
    return 0


def run_samples(args, ddes_keeps: list[float]) -> tuple[list[dict], str]:
    """Run every sample (printing each row to stderr as it completes); returns the rows and the model's name."""
    lm = load_model(args.model)
    tok = lm.tokenizer
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for depth in [float(d) for d in args.depths.split(",")]:
            sample = passkey(tok, args.length, depth=depth, seed=seed)
            key = sample.answers[0]
            ids, spans = prompt_with_document_span(tok, sample)
            n_doc = spans.count(("document",))
            full, _, _ = run(lm, ids, spans, create_policy("full"))
            row = {"seed": seed, "depth": depth, "prompt_tokens": len(ids), "document_tokens": n_doc, "key": key,
                   "full": {"correct": key in full.answer, "answer": full.answer}}
            for point in args.points.split(","):
                r, alpha = (float(x) for x in point.split(":"))
                res, _cache, st = run(lm, ids, spans, create_policy("hae", r=r, alpha=alpha, targets=("document",)))
                doc_kept = st.get("targets_kept", n_doc) / max(1, st.get("targets", n_doc))
                prompt_frac = (len(st["kept_stream"]) if "kept_stream" in st else len(ids)) / len(ids)
                cell = {"doc_kept_fraction": doc_kept, "prompt_kept_fraction": prompt_frac,
                        "hae_prune": {"correct": key in res.answer, "answer": res.answer}}
                if doc_kept > 0.99:  # DAP pruned (almost) nothing: the comparisons would all be the full cache
                    row[f"r={r},alpha={alpha}"] = cell
                    continue
                res_kv, _, _ = run(lm, ids, spans, create_policy("hae", r=r, alpha=alpha, targets=("document",), dap_mode="kv"))
                cell["hae_kv"] = {"correct": key in res_kv.answer, "answer": res_kv.answer}
                res_f, _, _ = run(lm, ids, spans, create_policy("fastv", ratio=doc_kept, targets=("document",)))
                cell["fastv"] = {"correct": key in res_f.answer, "answer": res_f.answer}
                keep = min(1.0, max(prompt_frac, 33 / len(ids)))
                res_s, _, _ = run(lm, ids, spans, create_policy("snapkv", keep=keep))
                cell["snapkv"] = {"correct": key in res_s.answer, "answer": res_s.answer, "keep": keep}
                row[f"r={r},alpha={alpha}"] = cell
            for keep in ddes_keeps:
                cell = {}
                for name, m, kw in (("hae", "hae", {"keep": keep, "targets": ("document",)}),
                                    ("h2o", "h2o", {"keep": keep}), ("snapkv", "snapkv", {"keep": keep})):
                    res_d, _, _ = run(lm, ids, spans, create_policy(m, **kw))
                    cell[name] = {"correct": key in res_d.answer, "answer": res_d.answer}
                row[f"ddes@{keep:g}"] = cell
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows, lm.source


def summarise(args, ddes_keeps: list[float], rows: list[dict], source: str, machine: dict) -> dict:
    """The result record: per-point and per-budget counts over ``rows``."""
    summary = {"full": sum(r["full"]["correct"] for r in rows), "n": len(rows)}
    for point in args.points.split(","):
        r, alpha = (float(x) for x in point.split(":"))
        k = f"r={r},alpha={alpha}"
        summary[k] = {m: sum(row[k][m]["correct"] for row in rows if m in row[k]) for m in ("hae_prune", "hae_kv", "fastv", "snapkv")}
        summary[k]["compared_samples"] = sum("fastv" in row[k] for row in rows)
        summary[k]["mean_doc_kept_fraction"] = sum(row[k]["doc_kept_fraction"] for row in rows) / len(rows)
        summary[k]["mean_prompt_kept_fraction"] = sum(row[k]["prompt_kept_fraction"] for row in rows) / len(rows)
    for keep in ddes_keeps:
        k = f"ddes@{keep:g}"
        summary[k] = {m: sum(row[k][m]["correct"] for row in rows) for m in ("hae", "h2o", "snapkv")}
    out = {
        "benchmark": "qa_proxy_dap", "proxy": "text model; document tagged as a second modality (not a VLM result)",
        "model": source, "length": args.length, "date": machine["date"],
        "machine": harness.finish_record(machine), "summary": summary, "rows": rows,
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
