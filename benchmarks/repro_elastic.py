"""Reproduce Elastic Cache's label-free protocol on the embedded model (resumable).

Protocol (METHODS.md §2, the paper's code): for each instruction prompt (a 1-3k-token passage
from package texts + "summarize / describe / answer about the passage"), the reference is the
full-cache greedy answer. For each configuration (method x budget, plus ablations at 0.5):

* perplexity: the reference is teacher-forced token by token through the *compressed* cache, so
  the cache is compressed at the prompt and keeps evicting during the answer exactly as during
  generation; NLLs are pooled over all answer tokens of all prompts;
* ROUGE-L F1 (``rouge-score``) of the compressed greedy answer against the reference.

Speed-ups that do not change any number (checked by ``--selfcheck``, on by default):

* the prompt's forward pass does not depend on the method (kvtrim compresses after each layer's
  attention, from that layer's q and k), so it runs once per prompt with a recording policy and
  each configuration *replays* its prefill hook on the recorded q/k/v;
* per-layer importance (Elastic) and prefill column sums (H2O) are computed once per prompt and
  shared by the configurations that need them;
* teacher forcing and greedy generation share their common prefix: while the compressed greedy
  token equals the reference token the two runs are identical; at the first difference the
  cache is copied and generation continues from the copy.

Results: one JSON line per (prompt, config) in ``benchmarks/results/elastic_repro/*.jsonl``;
finished lines are skipped on a rerun. ``--report`` aggregates them into
``benchmarks/results/elastic_repro_summary.json``, ``docs/elastic_repro.png`` and a markdown
table. Run it in the background, e.g.::

    nice -n 10 python benchmarks/repro_elastic.py --limit 100 --shard 0/2 &
    nice -n 10 python benchmarks/repro_elastic.py --limit 100 --shard 1/2 &
    python benchmarks/repro_elastic.py --report
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "elastic_repro"
SUMMARY = ROOT / "benchmarks" / "results" / "elastic_repro_summary.json"
PLOT = ROOT / "docs" / "elastic_repro.png"

from kvtrim.eval.longtext import LABELFREE_INSTRUCTIONS as INSTRUCTIONS  # noqa: E402 (one list for both protocols)

MAIN_METHODS = ("elastic", "h2o", "local", "snapkv")


def configs(budgets: list[float]) -> dict[str, tuple[str, dict]]:
    """Config name -> (registered method, parameters). ``local`` = streaming_llm (4 sinks + recent)."""
    out: dict[str, tuple[str, dict]] = {}
    for b in budgets:
        out[f"elastic@{b}"] = ("elastic", {"keep": b})
        out[f"h2o@{b}"] = ("h2o", {"keep": b})
        out[f"local@{b}"] = ("streaming_llm", {"keep": b})
        out[f"snapkv@{b}"] = ("snapkv", {"keep": b})
    ab = 0.5
    out[f"elastic-drop@{ab}"] = ("elastic", {"keep": ab, "combine": "drop"})
    out[f"elastic-compressed@{ab}"] = ("elastic", {"keep": ab, "position": "compressed"})
    out[f"elastic-mean@{ab}"] = ("elastic", {"keep": ab, "importance": "mean"})
    out[f"elastic-ema@{ab}"] = ("elastic", {"keep": ab, "importance": "ema"})
    out[f"elastic-recent@{ab}"] = ("elastic", {"keep": ab, "eviction": "recent"})
    out[f"elastic-frequency@{ab}"] = ("elastic", {"keep": ab, "eviction": "frequency"})
    out[f"elastic-mergeall@{ab}"] = ("elastic", {"keep": ab, "merge_protected": True})
    for b in (0.1, 0.5):  # investigation: also keep the instruction (the last 32 prompt tokens) exact
        out[f"elastic-window32@{b}"] = ("elastic", {"keep": b, "window": 32})
    # investigation: size-aware merging (a merged key weighs log(bucket size) in the softmax)
    out[f"elastic-prop@{ab}"] = ("elastic", {"keep": ab, "proportional": True})
    out[f"elastic-prop-mean@{ab}"] = ("elastic", {"keep": ab, "proportional": True, "importance": "mean"})
    out[f"elastic-drop-mean@{ab}"] = ("elastic", {"keep": ab, "combine": "drop", "importance": "mean"})
    return out


# --- prompts --------------------------------------------------------------------------------------
def build_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[dict]:
    """``n`` instruction prompts: passages of ``lo..hi`` tokens from the essays and the pydoc topics."""
    from kvtrim.data import essays_text, pydoc_text
    from kvtrim.models import build_prompt_ids

    rng = random.Random(seed)
    sources = [("essays", essays_text()), ("pydoc", pydoc_text())]
    sources = [(name, text) for name, text in sources if text]
    prompts = []
    for i in range(n):
        src, text = sources[i % len(sources)]
        target = rng.randint(lo, hi)
        start = text.find("\n\n", rng.randrange(0, len(text) - 8 * hi)) + 2
        toks = tokenizer.encode(text[start : start + 8 * hi], add_special_tokens=False)[:target]
        passage = tokenizer.decode(toks).strip()
        instruction = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        ids = build_prompt_ids(tokenizer, f"{passage}\n\n{instruction}")
        prompts.append({"id": i, "source": src, "instruction": instruction, "ids": ids})
    return prompts


# --- recording the prompt once and replaying it per configuration --------------------------------
# (kvtrim.eval.replay: the forward pass does not depend on the method, so it runs once per prompt)
from kvtrim.eval.replay import SharedElastic, make_policy, record_prefill, replay  # noqa: E402


def forward_step(model, cache, tok: int) -> torch.Tensor:
    """One decode step of token ``tok`` through ``cache``; last-position logits ``[V]`` (float32)."""
    from kvtrim.integrations.hf import cache_kwarg

    kw = {cache_kwarg(): cache, "use_cache": True, "logits_to_keep": 1}
    if cache.position_policy != "true":
        n = cache.compressed_layers[0].length
        kw["position_ids"] = torch.tensor([[n]])
    return model(input_ids=torch.tensor([[tok]]), **kw).logits[0, -1].float()


def record_prompt(model, ids: list[int]):
    """Full prefill with the recording policy: (cache, last logits, per-layer record)."""
    rec = record_prefill(model, ids, keep_cache=True)
    return rec.cache, rec.logits, rec.record


def greedy_reference(model, cache, logits, n_new: int, eos: int | None) -> list[int]:
    out = []
    for step in range(n_new):
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos or step == n_new - 1:
            break
        logits = forward_step(model, cache, tok)
    return out


def run_cell(model, cache, logits, ref: list[int], n_new: int, eos: int | None) -> dict:
    """Teacher-force ``ref`` through ``cache`` and generate greedily, sharing the common prefix."""
    nll = 0.0
    gen: list[int] = []
    fork = None  # (cache copy, logits) at the first divergence
    steps = 0
    same = True
    for i, r in enumerate(ref):
        lp = torch.log_softmax(logits, dim=-1)
        nll -= float(lp[r])
        g = int(logits.argmax())
        if same:
            gen.append(g)
            if g != r:
                same = False
                if g != eos and len(gen) < n_new:
                    fork = copy.deepcopy(cache)
        if i == len(ref) - 1:
            break
        logits = forward_step(model, cache, r)
        steps += 1
    stored_end = max(cache.stored_tokens())
    if fork is not None:
        gcache = fork
        glogits = forward_step(model, gcache, gen[-1])
        steps += 1
        while len(gen) < n_new:
            g = int(glogits.argmax())
            gen.append(g)
            if g == eos or len(gen) == n_new:
                break
            glogits = forward_step(model, gcache, g)
            steps += 1
    return {"nll_sum": nll, "n_tokens": len(ref), "gen_ids": gen, "steps": steps, "stored_end": stored_end}


# --- self-check: replay + sharing == the plain path -----------------------------------------------
def selfcheck(model, ids: list[int], cfgs: dict, steps: int = 3) -> None:
    from kvtrim.cache import KVTrimCache
    from kvtrim.integrations.hf import cache_kwarg
    from kvtrim.registry import create_policy

    _, base_logits, record = record_prompt(model, ids)
    memo: dict = {}
    for name, (method, params) in cfgs.items():
        real = KVTrimCache(model, create_policy(method, **params))
        out = model(input_ids=torch.tensor([ids]), **{cache_kwarg(): real, "use_cache": True, "logits_to_keep": 1})
        a_logits = out.logits[0, -1].float()
        rep = replay(model, make_policy(method, params, memo), record)
        b_logits = base_logits
        for _ in range(steps):
            torch.testing.assert_close(b_logits, a_logits, atol=1e-4, rtol=1e-4)
            tok = int(a_logits.argmax())
            a_logits = forward_step(model, real, tok)
            b_logits = forward_step(model, rep, tok)
        torch.testing.assert_close(b_logits, a_logits, atol=1e-4, rtol=1e-4)
        assert real.stored_tokens() == rep.stored_tokens(), name
    print(f"selfcheck ok: {len(cfgs)} configs, replay + shared scores == plain path", flush=True)


# --- main loop ------------------------------------------------------------------------------------
def done_keys(folder: Path) -> set[tuple[int, str]]:
    keys = set()
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                keys.add((d["prompt"], d["config"]))
    return keys


def load_refs(folder: Path) -> dict[int, dict]:
    refs = {}
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                if d["config"] == "full":
                    refs[d["prompt"]] = d
    return refs


def machine_info() -> dict:
    import transformers

    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": os.getloadavg(),
    }


def run(args) -> None:
    from rouge_score import rouge_scorer
    from tqdm import tqdm

    import kvtrim
    from kvtrim.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    budgets = [float(b) for b in args.budgets.split(",")]
    cfgs = configs(budgets)
    if args.configs:
        wanted = args.configs.split(",")
        cfgs = {k: v for k, v in cfgs.items() if k in wanted}
    prompts = build_prompts(tok, args.limit, args.min_tokens, args.max_tokens, args.seed)
    k, n = (int(x) for x in args.shard.split("/"))
    prompts = [p for p in prompts if p["id"] % n == k]
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    out_path = folder / f"shard{k}of{n}.jsonl"
    meta = {"args": vars(args), "start": machine_info(), "configs": {c: [m, p] for c, (m, p) in cfgs.items()}}
    stamp = meta["start"]["date"].replace("-", "").replace(":", "")
    meta_path = folder / f"meta_shard{k}of{n}_{stamp}.json"  # one file per run (a resumed run adds one)
    meta_path.write_text(json.dumps(meta, indent=1))
    done = done_keys(folder)
    refs = load_refs(folder)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    todo = sum(1 for p in prompts for c in ["full", *cfgs] if (p["id"], c) not in done)
    bar = tqdm(total=todo, desc=f"elastic repro shard {k}/{n}", unit="cell")
    with kvtrim.attach(model), torch.inference_mode(), out_path.open("a") as fh:
        if args.selfcheck:
            selfcheck(model, prompts[0]["ids"][-300:], cfgs)
        for p in prompts:
            pid = p["id"]
            missing = [c for c in cfgs if (pid, c) not in done]
            if (pid, "full") in done and not missing:
                continue
            t0 = time.perf_counter()
            full_cache, logits0, record = record_prompt(model, p["ids"])
            t_prefill = time.perf_counter() - t0
            if pid not in refs:
                t0 = time.perf_counter()
                ref_ids = greedy_reference(model, full_cache, logits0, args.max_new_tokens, eos)
                refs[pid] = {
                    "prompt": pid, "config": "full", "source": p["source"], "instruction": p["instruction"],
                    "prompt_tokens": len(p["ids"]), "ref_ids": ref_ids,
                    "answer": tok.decode(ref_ids, skip_special_tokens=True).strip(),
                    "prefill_seconds": t_prefill, "seconds": time.perf_counter() - t0,
                }
                fh.write(json.dumps(refs[pid]) + "\n")
                fh.flush()
                bar.update(1)
            del full_cache
            ref_ids = refs[pid]["ref_ids"]
            ref_text = refs[pid]["answer"]
            memo: dict = {}
            for c in missing:
                method, params = cfgs[c]
                t0 = time.perf_counter()
                cache = replay(model, make_policy(method, params, memo), record)
                res = run_cell(model, cache, logits0, ref_ids, args.max_new_tokens, eos)
                text = tok.decode(res["gen_ids"], skip_special_tokens=True).strip()
                rl = scorer.score(ref_text, text)["rougeL"].fmeasure if (ref_text or text) else 1.0
                row = {"prompt": pid, "config": c, "method": method, "params": params, "prompt_tokens": len(p["ids"]),
                       "rouge_l": rl, "answer": text, "seconds": time.perf_counter() - t0, **res}
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                bar.update(1)
            del record, memo
    bar.close()
    meta["end"] = machine_info()
    meta_path.write_text(json.dumps(meta, indent=1))


# --- where the anchors go ------------------------------------------------------------------------
def anchor_stats(args) -> None:
    """Share of anchors in the first 10% of the prompt and share of the instruction tail kept, per importance."""
    from kvtrim.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    prompts = build_prompts(lm.tokenizer, args.anchor_stats, args.min_tokens, args.max_tokens, args.seed)
    out = {"keep": 0.5, "tail_tokens": 32, "prompts": len(prompts), "by_importance": {}, "start": machine_info()}
    import kvtrim

    acc: dict[str, dict[str, list[float]]] = {}
    with kvtrim.attach(lm.model), torch.inference_mode():
        for p in prompts:
            _, _, record = record_prompt(lm.model, p["ids"])
            t = len(p["ids"])
            for how in ("sum", "mean", "ema"):
                pol = SharedElastic(keep=0.5, importance=how)
                for i in sorted(record):
                    q, k, _, scaling = record[i]
                    a = pol.select_anchors(pol.layer_importance(None, q, k, scaling), pol.budget(t))[0]
                    d = acc.setdefault(how, {"first10pct": [], "tail32_kept": []})
                    d["first10pct"].append(float((a < t // 10).float().mean()))
                    d["tail32_kept"].append(float((a >= t - 32).sum()) / 32)
    for how, d in acc.items():
        out["by_importance"][how] = {k: sum(v) / len(v) for k, v in d.items()}
    path = ROOT / "benchmarks" / "results" / "elastic_anchor_stats.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["by_importance"], indent=1))


# --- report ---------------------------------------------------------------------------------------
def report(args) -> None:
    rows = []
    folder = Path(args.out)
    for f in sorted(folder.glob("*.jsonl")):
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["prompt"]] = r
    budgets = [float(b) for b in args.budgets.split(",")]
    cfgs = configs(budgets)
    present = [c for c in cfgs if c in by]
    # paired: only prompts every present config (and the reference) has finished
    common = set(by.get("full", {}))
    for c in present:
        common &= set(by[c])
    common = sorted(common)
    summary = {"prompts": len(common), "answer_tokens": sum(by["full"][p]["n_tokens"] if "n_tokens" in by["full"][p] else len(by["full"][p]["ref_ids"]) for p in common) if common else 0, "configs": {}}
    for c in present:
        rs = [by[c][p] for p in common]
        if not rs:
            continue
        nll = sum(r["nll_sum"] for r in rs)
        ntok = sum(r["n_tokens"] for r in rs)
        rl = [r["rouge_l"] for r in rs]
        summary["configs"][c] = {
            "ppl": math.exp(nll / ntok), "rouge_l": sum(rl) / len(rl), "n_prompts": len(rs), "n_tokens": ntok,
            "rouge_l_exact": sum(1 for x in rl if x == 1.0) / len(rl),
        }
    # paired per-prompt comparisons: share of prompts where the first config has the lower NLL / higher ROUGE-L
    pairs = [(f"elastic@{b}", f"{m}@{b}") for b in budgets for m in MAIN_METHODS[1:]]
    pairs += [(f"elastic@{ab}", f"elastic-drop@{ab}") for ab in (0.5,)]
    pairs += [("elastic-prop@0.5", "elastic@0.5"), ("elastic-prop@0.5", "elastic-drop@0.5"),
              ("elastic-prop-mean@0.5", "elastic-mean@0.5"), ("elastic-mean@0.5", "elastic-drop-mean@0.5"),
              ("elastic-prop-mean@0.5", "elastic-drop-mean@0.5"), ("elastic-mean@0.5", "h2o@0.5")]
    summary["paired"] = {}
    for a, o in pairs:
        if a in by and o in by and common:
            summary["paired"][f"{a} vs {o}"] = {
                "nll_wins": sum(by[a][p]["nll_sum"] < by[o][p]["nll_sum"] for p in common) / len(common),
                "rouge_wins": sum(by[a][p]["rouge_l"] > by[o][p]["rouge_l"] for p in common) / len(common),
                "rouge_ties": sum(by[a][p]["rouge_l"] == by[o][p]["rouge_l"] for p in common) / len(common),
            }
    summary["all_finished"] = {c: len(by[c]) for c in by}
    metas = [json.loads(f.read_text()) for f in sorted(folder.glob("meta_*.json"))]
    summary["runs"] = metas
    SUMMARY.write_text(json.dumps(summary, indent=1))
    # table
    lines = ["| budget | " + " | ".join(f"{m} PPL | {m} ROUGE-L" for m in MAIN_METHODS) + " |",
             "|---:|" + "---:|---:|" * len(MAIN_METHODS)]
    for b in budgets:
        cells = []
        for m in MAIN_METHODS:
            s = summary["configs"].get(f"{m}@{b}")
            cells += [f"{s['ppl']:.3f}", f"{s['rouge_l']:.3f}"] if s else ["-", "-"]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "| ablation at 0.5 | PPL | ROUGE-L |", "|---|---:|---:|"]
    for c, s in summary["configs"].items():
        if c.startswith("elastic") and c.endswith("@0.5"):
            lines.append(f"| {c} | {s['ppl']:.3f} | {s['rouge_l']:.3f} |")
    lines += ["", "| paired, per prompt | first has lower NLL | first has higher ROUGE-L | ROUGE-L tie |", "|---|---:|---:|---:|"]
    for k2, v in summary["paired"].items():
        lines.append(f"| {k2} | {v['nll_wins']:.0%} | {v['rouge_wins']:.0%} | {v['rouge_ties']:.0%} |")
    print(f"{len(common)} prompts finished for every config ({summary['answer_tokens']} reference tokens)")
    print("\n".join(lines))
    # plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in MAIN_METHODS:
        xs = [b for b in budgets if f"{m}@{b}" in summary["configs"]]
        axes[0].plot(xs, [summary["configs"][f"{m}@{b}"]["ppl"] for b in xs], marker="o", label=m)
        axes[1].plot(xs, [summary["configs"][f"{m}@{b}"]["rouge_l"] for b in xs], marker="o", label=m)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("teacher-forced PPL of the full-cache answer")
    axes[1].set_ylabel("ROUGE-L F1 vs full-cache answer")
    for ax in axes:
        ax.set_xlabel("KV budget (keep)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, {len(common)} prompts, {summary['answer_tokens']} answer tokens")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    print(f"wrote {SUMMARY} and {PLOT}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--limit", type=int, default=100, help="number of prompts (default 100)")
    ap.add_argument("--budgets", default="0.1,0.3,0.5,0.7,0.9", help="comma-separated keep ratios")
    ap.add_argument("--configs", default="", help="only these config names (comma-separated)")
    ap.add_argument("--min-tokens", type=int, default=1000, help="shortest passage (tokens)")
    ap.add_argument("--max-tokens", type=int, default=1500, help="longest passage (tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="reference / generated answer length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shard", default="0/1", help="k/n: run prompts with id %% n == k")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the JSON-lines results")
    ap.add_argument("--no-selfcheck", dest="selfcheck", action="store_false")
    ap.add_argument("--report", action="store_true", help="aggregate finished results (no model runs)")
    ap.add_argument("--anchor-stats", type=int, default=0, metavar="N",
                    help="where the anchors go at keep 0.5 on the first N prompts, per importance (JSON)")
    args = ap.parse_args(argv)
    if args.report:
        report(args)
    elif args.anchor_stats:
        anchor_stats(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
