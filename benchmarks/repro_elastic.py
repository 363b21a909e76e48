"""Reproduce Elastic Cache's label-free protocol on the embedded model (resumable).

Protocol (docs/methods-spec.md, Elastic Cache; the paper's code): for each instruction prompt (a 1-3k-token passage
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

Why this is not ``kvtrim eval --tasks labelfree``: that task judges a method the way every eval
task does (a fixed-length generated sample, the reference teacher-forced in *one* forward after the
compressed prefill, (method, keep) configurations only). This protocol differs in three ways the
eval API cannot express: the reference is teacher-forced *token by token* (the cache keeps
compressing during the answer), the prompts are this script's 1-1.5k-token passages with the
instructions in turn (the committed 100-prompt results are on them), and the ablations pass
parameters other than ``keep``. What it shares with kvtrim eval is used from there: the recording
and replay of the prompt (``kvtrim.eval.replay``), the instructions (``kvtrim.eval.longtext``) and
ROUGE-L (``kvtrim.eval.metrics.rouge_l``); every forward goes through :mod:`kvtrim.decoding` (the
cell is a decoding program); timing, machine record and output through :mod:`kvtrim.harness`.

Results: one JSON line per (prompt, config) in ``DIR/shard{k}of{n}.jsonl`` under the folder ``--out
DIR`` names; finished lines are skipped on a rerun (resumable). ``--report`` aggregates a results
folder (``--results``, default the committed ``benchmarks/results/elastic_repro``) into the summary
JSON named by ``--out`` (a PNG plot beside it) and prints the markdown table; ``--table FILE``
prints the table of a summary. Run it in the background, e.g.::

    nice -n 10 python benchmarks/repro_elastic.py --limit 100 --shard 0/2 --out results/elastic_repro &
    nice -n 10 python benchmarks/repro_elastic.py --limit 100 --shard 1/2 --out results/elastic_repro &
    python benchmarks/repro_elastic.py --report --results results/elastic_repro --out results/elastic_repro_summary.json
    python benchmarks/repro_elastic.py --table benchmarks/results/elastic_repro_summary.json   # the committed table
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from pathlib import Path

import torch

from kvtrim import decoding, harness
from kvtrim.decoding import Step

# one list of instructions for both protocols
from kvtrim.eval.longtext import LABELFREE_INSTRUCTIONS as INSTRUCTIONS
from kvtrim.eval.replay import make_policy, record_prefill, replay
from kvtrim.policies.elastic import Elastic, attention_importance

#: the committed results folder (read by ``--report`` unless ``--results`` names another)
COMMITTED = Path(__file__).resolve().parent / "results" / "elastic_repro"

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


# --- one configuration on one prompt: a decoding program ------------------------------------------
def cell_program(cache, logits, ref: list[int], n_new: int, eos: int | None) -> decoding.Program:
    """Program: teacher-force ``ref`` token by token through ``cache`` and generate greedily, sharing
    the common prefix (at the first difference the cache is copied and generation continues from the
    copy with :func:`kvtrim.decoding.decode`); returns the cell's fields."""
    nll = 0.0
    gen: list[int] = []
    fork = None  # cache copy at the first divergence
    steps = 0
    same = True
    for i, r in enumerate(ref):
        nll -= float(torch.log_softmax(logits, dim=-1)[r])
        g = decoding.GREEDY.choose(logits)
        if same:
            gen.append(g)
            if g != r:
                same = False
                if g != eos and len(gen) < n_new:
                    fork = copy.deepcopy(cache)
        if i == len(ref) - 1:
            break
        logits = yield Step(cache, [r])
        steps += 1
    stored_end = max(cache.stored_tokens())
    if fork is not None:
        glogits = yield Step(fork, [gen[-1]])
        steps += 1
        more, s = yield from decoding.decode(fork, glogits, n_new - len(gen), stop_ids=() if eos is None else (eos,))
        gen += more
        steps += s
    return {"nll_sum": nll, "n_tokens": len(ref), "gen_ids": gen, "steps": steps, "stored_end": stored_end}


# --- self-check: replay + sharing == the plain path -----------------------------------------------
def selfcheck(model, ids: list[int], cfgs: dict, steps: int = 3) -> None:
    from kvtrim.cache import KVTrimCache
    from kvtrim.registry import create_policy

    rec = record_prefill(model, ids)
    memo: dict = {}
    for name, (method, params) in cfgs.items():
        real = KVTrimCache(model, create_policy(method, **params))
        a_logits = decoding.forward(model, real, ids)
        rep = replay(model, make_policy(method, params, memo), rec)
        b_logits = rec.logits
        for _ in range(steps):
            torch.testing.assert_close(b_logits, a_logits, atol=1e-4, rtol=1e-4)
            tok = decoding.GREEDY.choose(a_logits)
            a_logits = decoding.forward(model, real, [tok])
            b_logits = decoding.forward(model, rep, [tok])
        torch.testing.assert_close(b_logits, a_logits, atol=1e-4, rtol=1e-4)
        if real.stored_tokens() != rep.stored_tokens():
            raise RuntimeError(f"selfcheck: {name} stores {rep.stored_tokens()} after replay, {real.stored_tokens()} when run")
    print(f"selfcheck ok: {len(cfgs)} configs, replay + shared scores == plain path", file=sys.stderr, flush=True)


# --- main loop ------------------------------------------------------------------------------------
def read_rows(folder: Path) -> list[dict]:
    """Every finished line of the results folder."""
    return [d for f in sorted(folder.glob("*.jsonl")) for d in harness.read_result(f)]


def run(args) -> None:
    from tqdm import tqdm

    import kvtrim
    from kvtrim.eval.metrics import rouge_l
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
    out_path = folder / f"shard{k}of{n}.jsonl"
    meta = {"args": {a: v for a, v in vars(args).items() if a not in ("table", "force")}, "start": harness.machine_record(),
            "configs": {c: [m, p] for c, (m, p) in cfgs.items()}}
    stamp = meta["start"]["date"][:19].replace("-", "").replace(":", "") + "Z"
    meta_path = folder / f"meta_shard{k}of{n}_{stamp}.json"  # one file per run (a resumed run adds one)
    harness.write_json(meta_path, meta)
    rows = read_rows(folder)
    done = {(d["prompt"], d["config"]) for d in rows}
    refs = {d["prompt"]: d for d in rows if d["config"] == "full"}
    todo = sum(1 for p in prompts for c in ["full", *cfgs] if (p["id"], c) not in done)
    bar = tqdm(total=todo, desc=f"elastic repro shard {k}/{n}", unit="cell")
    with kvtrim.attach(model), torch.inference_mode():
        if args.selfcheck:
            selfcheck(model, prompts[0]["ids"][-300:], cfgs)
        for p in prompts:
            pid = p["id"]
            missing = [c for c in cfgs if (pid, c) not in done]
            if (pid, "full") in done and not missing:
                continue
            rec = record_prefill(model, p["ids"], keep_cache=True)
            if pid not in refs:
                t0 = time.perf_counter()
                ref_ids, _ = decoding.run(model, decoding.decode(rec.cache, rec.logits, args.max_new_tokens,
                                                                 stop_ids=() if eos is None else (eos,)))
                refs[pid] = {
                    "prompt": pid, "config": "full", "source": p["source"], "instruction": p["instruction"],
                    "prompt_tokens": len(p["ids"]), "ref_ids": ref_ids,
                    "answer": tok.decode(ref_ids, skip_special_tokens=True).strip(),
                    "prefill_seconds": rec.seconds, "seconds": time.perf_counter() - t0,
                }
                harness.append_jsonl(out_path, refs[pid])
                bar.update(1)
            rec.cache = None
            ref_ids = refs[pid]["ref_ids"]
            ref_text = refs[pid]["answer"]
            memo: dict = {}

            def cell(c: str, rep: int, rec=rec, memo=memo, ref_ids=ref_ids) -> dict:
                method, params = cfgs[c]
                cache = replay(model, make_policy(method, params, memo), rec)
                return decoding.run(model, cell_program(cache, rec.logits, ref_ids, args.max_new_tokens, eos))

            def write(s: harness.Sample, p=p, pid=pid, ref_text=ref_text) -> None:
                method, params = cfgs[s.config]
                text = tok.decode(s.value["gen_ids"], skip_special_tokens=True).strip()
                rl = rouge_l(text, ref_text) if (ref_text or text) else 1.0
                harness.append_jsonl(out_path, {"prompt": pid, "config": s.config, "method": method, "params": params,
                                                "prompt_tokens": len(p["ids"]), "rouge_l": rl, "answer": text,
                                                "seconds": s.seconds, **s.value})
                bar.update(1)

            harness.interleave(missing, cell, reps=1, how="fixed", on_sample=write)
            del cell, write, rec, memo  # free this prompt's recording before the next one is made
    bar.close()
    meta["end"] = harness.finish_record(harness.machine_record())
    harness.write_json(meta_path, meta)


# --- where the anchors go ------------------------------------------------------------------------
def anchor_stats(args) -> None:
    """Share of anchors in the first 10% of the prompt and share of the instruction tail kept, per importance."""
    import kvtrim
    from kvtrim.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    prompts = build_prompts(lm.tokenizer, args.anchor_stats, args.min_tokens, args.max_tokens, args.seed)
    out = {"keep": 0.5, "tail_tokens": 32, "prompts": len(prompts), "by_importance": {}, "start": harness.machine_record()}

    acc: dict[str, dict[str, list[float]]] = {}
    with kvtrim.attach(lm.model), torch.inference_mode():
        for p in prompts:
            record = record_prefill(lm.model, p["ids"]).record
            t = len(p["ids"])
            for how in ("sum", "mean", "ema"):
                pol = Elastic(keep=0.5, importance=how)
                for i in sorted(record):
                    q, k, _, scaling = record[i]
                    a = pol.select_anchors(attention_importance(q, k, scaling, how), pol.budget(t))[0]
                    d = acc.setdefault(how, {"first10pct": [], "tail32_kept": []})
                    d["first10pct"].append(float((a < t // 10).float().mean()))
                    d["tail32_kept"].append(float((a >= t - 32).sum()) / 32)
    for how, d in acc.items():
        out["by_importance"][how] = {k: sum(v) / len(v) for k, v in d.items()}
    harness.finish_record(out["start"])
    harness.write_json(args.out, out)
    print(out["by_importance"])


# --- report ---------------------------------------------------------------------------------------
def report(args) -> None:
    folder = Path(args.results)
    rows = read_rows(folder)
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
    summary["runs"] = [harness.read_result(f) for f in sorted(folder.glob("meta_*.json"))]
    summary["budgets"] = budgets
    harness.write_json(args.out, summary)
    print(f"{len(common)} prompts finished for every config ({summary['answer_tokens']} reference tokens)")
    print(table(summary))
    plot(summary, budgets, len(common), Path(args.out).with_suffix(".png"))


def table(summary: dict) -> str:
    """The markdown tables of a summary: main methods per budget, ablations at 0.5, paired comparisons."""
    budgets = summary.get("budgets") or sorted({float(c.rsplit("@", 1)[1]) for c in summary["configs"]
                                                if c.split("@")[0] in MAIN_METHODS})
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
    return "\n".join(lines)


def plot(summary: dict, budgets: list[float], n_prompts: int, path: Path) -> None:
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
    fig.suptitle(f"SmolLM2-135M-Instruct, {n_prompts} prompts, {summary['answer_tokens']} answer tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path.with_suffix('.json')} and {path}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[harness.options(reps=None, warmup=None, out_help=(
                                     "run: the results folder (an existing one is continued); --report: the summary "
                                     "JSON (a PNG plot beside it); --anchor-stats: the JSON"))])
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
    ap.add_argument("--no-selfcheck", dest="selfcheck", action="store_false")
    ap.add_argument("--report", action="store_true", help="aggregate finished results (no model runs) into --out")
    ap.add_argument("--results", default=str(COMMITTED), help="--report: the results folder to read (default: the committed one)")
    ap.add_argument("--anchor-stats", type=int, default=0, metavar="N",
                    help="where the anchors go at keep 0.5 on the first N prompts, per importance (JSON to --out)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table, directory=not (args.report or args.anchor_stats)):
        return 0
    if args.report:
        report(args)
    elif args.anchor_stats:
        anchor_stats(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
