"""Prefill time of every method relative to the full cache, scores recomputed vs fused into attention.

One prompt of ``--tokens`` tokens (essays, the embedded model), one configuration per method at
``--keep``; a method that scores the prompt by its attention (``Policy.wants_prefill_scores``: H2O,
Elastic Cache, SnapKV, Inf-MLLM) runs twice: ``recompute`` (``attach(model, fused_scores="never")``:
the model's SDPA, then the policy computes ``q @ K`` and the softmax again from q and k) and
``fused`` (``fused_scores="always"``: kvtrim's kernel computes the attention and the scores in one
pass, ``kvtrim.attention.fused``). The default, ``"auto"``, is ``fused`` for the column-sum
methods (H2O, Elastic Cache) and ``recompute`` for the last-window ones (SnapKV, Inf-MLLM). The
other methods run once. ``--modes`` picks the paths; ``auto`` adds a third, each method's default
as a user gets it (``fused_scores="auto"``), labelled as such rather than as one of the other two.
Each configuration is one prefill through
:mod:`kvtrim.decoding` (the timed step includes the policy's hook: scoring, selection, eviction),
after one warm-up round on a short prompt; repetitions interleaved by :mod:`kvtrim.harness`
(order alternating), medians of wall and of CPU seconds, the load average at the start and the end. Ratios within one run
share the machine's load, so they stay meaningful on a busy machine; absolute seconds do not.

Where the time goes: each prefill also records the seconds spent inside kvtrim's attention function
(the attention itself, SDPA or the fused kernel, plus the policy's hook: scoring, selection,
eviction), the hook alone, the rest of the forward (projections, MLPs, norms: the same work in
every configuration) and the process's minor page faults. A second table sets each method's attention
seconds against the full cache's: the method's own added work, apart from how the shared rest of
the forward drifted between the rounds.

    nice -n 10 python benchmarks/bench_fused_scoring.py --tokens 4096 --reps 3 --out results/fused_scoring/prefill_4k.json
    python benchmarks/bench_fused_scoring.py --table results/fused_scoring/prefill_4k.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time

import torch

from kvtrim import decoding, harness

# every text method (fastv and hae prune image/video tokens: a text prompt is refused)
METHODS = ("streaming_llm", "h2o", "snapkv", "inf_mllm", "elastic")
TARGET = 1.05  # every method's prefill at most 5% above the full cache's
# the scoring paths a method that scores the prompt can be timed on: the path -> attach(fused_scores=...)
MODES = {"recompute": "never", "fused": "always", "auto": "auto"}


def table(res: dict) -> str:
    """Markdown: per method, median prefill seconds and the ratio to the full cache's, both ways."""
    med, ratio, cpu = res["median_seconds"], res["ratio_to_full"], res["cpu_ratio_to_full"]
    auto = any(c.endswith(":auto") for c in med)  # --modes auto: each method's default path, timed as such
    la = res["machine"].get("loadavg_start"), res["machine"].get("loadavg_end")
    lines = [
        f"Prefill of {res['prompt_tokens']} tokens ({res['model']}, {res['threads']} thread, {res['dtype']}, "
        f"keep {res['keep']}), medians of {res['reps']} interleaved repetition(s); full cache "
        f"{med['full']:.2f} s; load average {la[0][0]:.1f} at the start, {la[1][0]:.1f} at the end.",
        "",
        "| method | recompute: s | x full | x full (CPU time) | fused: s | x full | x full (CPU time) |"
        + (" default (auto): s | x full | x full (CPU time) |" if auto else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if auto else ""),
    ]
    modes = [mode for mode in MODES if mode != "auto" or auto]
    for m in res["methods"]:
        names = [f"{m}:{mode}" for mode in modes]
        if any(c in med for c in names):
            cells = [f"{med[c]:.2f} | {ratio[c]:.3f} | {cpu[c]:.3f}" if c in med else "(not run) | |" for c in names]
        else:  # no prompt scores: one configuration, shown in the first column
            cells = [f"{med[m]:.2f} | {ratio[m]:.3f} | {cpu[m]:.3f}"] + ["(no prompt scores) | |"] * (len(modes) - 1)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nx full: median wall seconds / the full cache's; CPU time: the process's CPU seconds (one thread: "
        f"the work done, less sensitive than wall time to other jobs on the machine). Target: at most {res['target_ratio']}. "
        f"kvtrim's default (`fused_scores=\"auto\"`) is the fused column for h2o and elastic (column sums) and the "
        f"recompute column for snapkv and inf_mllm (last-window rows only)."
    ) + ("\n\nWhere the time goes (medians per configuration):\n\n" + own_work_table(res)
         if "median_attention_seconds" in res else "")


def own_work_table(res: dict) -> str:
    """Markdown: per configuration, the median seconds in kvtrim's attention function (attention +
    the policy's hook), the hook alone ("not timed" in results from before it was), the rest of the prefill, the minor page faults, and the prefill the method
    would take with the rest at the full cache's (the full cache's wall + the attention seconds
    the method adds)."""
    att, wall, faults = res["median_attention_seconds"], res["median_seconds"], res["median_minor_faults"]
    hook = res.get("median_hook_seconds", {})
    full_att = att["full"]
    lines = [
        "| configuration | attention + policy: s | of which the policy's hook: s | added vs full: s | "
        "rest of the forward: s | minor page faults | x full, own work only |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in wall:
        added = att[c] - full_att
        h = f"{hook[c]:.2f}" if c in hook else "(not timed)"
        lines.append(f"| {c} | {att[c]:.2f} | {h} | {added:+.2f} | {res['median_rest_seconds'][c]:.2f} | "
                     f"{faults[c]:,.0f} | {(wall['full'] + added) / wall['full']:.3f} |")
    return "\n".join(lines) + (
        "\n\nattention + policy: wall seconds inside kvtrim's attention function over all layers (SDPA or the "
        "fused kernel, and the policy's hook); the hook: scoring, selection and eviction alone; rest: the prefill's other seconds (the same work in every "
        "configuration; its spread between configurations is the machine's). x full, own work only: "
        "(full cache's prefill + added) / full cache's prefill, the ratio without that spread; the target is judged "
        "on the measured ratio above.")


def timed_call(fn, spent: list[float]):
    """``fn``, with the wall seconds of every call appended to ``spent``."""
    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t)

    return timed


@contextlib.contextmanager
def timed_attention(spent: list[float]):
    """While attached, time every call of kvtrim's attention function into ``spent`` (benchmark-only
    instrumentation: the registered function is wrapped, then put back)."""
    from transformers import AttentionInterface

    from kvtrim.integrations.hf import ATTN_NAME

    inner = AttentionInterface._global_mapping[ATTN_NAME]
    AttentionInterface._global_mapping[ATTN_NAME] = timed_call(inner, spent)
    try:
        yield
    finally:
        AttentionInterface._global_mapping[ATTN_NAME] = inner


def main(argv=None) -> int:
    import kvtrim
    from kvtrim.attention.fused import fused_backend
    from kvtrim.cache import KVTrimCache
    from kvtrim.data import prose_haystack
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.policies.base import Policy
    from kvtrim.registry import create_policy, get_policy_class

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=3, warmup=1, threads=1)])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["recompute", "fused"],
                    help="which scoring paths to time for the methods that score the prompt (default recompute and "
                         "fused; auto: kvtrim's default, fused_scores='auto')")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    info = harness.machine_record()
    lm = load_model(None)
    model, tok = lm.model, lm.tokenizer
    text = tok.decode(tok.encode(prose_haystack()[: 8 * args.tokens], add_special_tokens=False)[: args.tokens - 40])
    ids = build_prompt_ids(tok, text + "\n\nSummarize the passage above.")
    configs = ["full"]
    for m in args.methods:
        scores = get_policy_class(m).wants_prefill_scores is not Policy.wants_prefill_scores
        configs += [f"{m}:{mode}" for mode in MODES if mode in args.modes] if scores else [m]
    backend = fused_backend(torch.zeros(1, dtype=model.dtype))

    def prefill(config: str, rep: int, prompt=ids) -> dict:
        name, _, mode = config.partition(":")
        policy = create_policy(name) if name == "full" else create_policy(name, keep=args.keep)
        times: list[float] = []
        spent: list[float] = []
        hooks: list[float] = []
        cache = KVTrimCache(model, policy)
        cache.after_attention = timed_call(cache.after_attention, hooks)  # this cache only: the policy's hook
        with kvtrim.attach(model, fused_scores=MODES.get(mode, "auto")), timed_attention(spent):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu = time.process_time()
            decoding.run(model, decoding.prefill(cache, prompt), on_step=lambda s, dt: times.append(dt))
            cpu = time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        att, hook = sum(spent), sum(hooks)
        print(f"rep {rep}: {config} {times[0]:.2f}s (cpu {cpu:.2f}s, attention {att:.2f}s of which hook {hook:.2f}s, "
              f"{faults} faults) load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        return {"wall": times[0], "cpu": cpu, "attention": att, "hook": hook, "faults": faults}

    with torch.inference_mode():
        for c in configs:  # builds the native kernel, warms every path on a short prompt
            prefill(c, -1, ids[:512])
        done: dict[str, list] = {c: [] for c in configs}

        def keep(sample) -> None:  # every finished round is saved: a run stopped early keeps its rounds
            done[sample.config].append(sample)
            if all(len(v) == len(done["full"]) for v in done.values()):
                harness.write_json(args.out, summary(done, complete=False))

        def summary(runs: dict, complete: bool = True) -> dict:
            seconds = {c: [s.value["wall"] for s in ss] for c, ss in runs.items()}
            cpu = {c: [s.value["cpu"] for s in ss] for c, ss in runs.items()}
            med = {c: harness.median(v) for c, v in seconds.items()}
            med_cpu = {c: harness.median(v) for c, v in cpu.items()}
            att = {c: [s.value["attention"] for s in ss] for c, ss in runs.items()}
            rest = {c: [s.value["wall"] - s.value["attention"] for s in ss] for c, ss in runs.items()}
            hook = {c: [s.value["hook"] for s in ss] for c, ss in runs.items()}
            faults = {c: [s.value["faults"] for s in ss] for c, ss in runs.items()}
            return {
                "benchmark": "fused_scoring",
                "command": "python benchmarks/bench_fused_scoring.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "model": "SmolLM2-135M-Instruct (embedded)",
                "dtype": str(model.dtype).replace("torch.", ""),
                "threads": torch.get_num_threads(),
                "prompt_tokens": len(ids),
                "keep": args.keep,
                "reps": len(runs["full"]),
                "complete": complete,  # False: a partial save, rounds still to come
                "methods": args.methods,
                "fused_backend": backend,
                "target_ratio": TARGET,
                "seconds": seconds,
                "median_seconds": med,
                "ratio_to_full": {c: med[c] / med["full"] for c in configs},
                "cpu_seconds": cpu,
                "median_cpu_seconds": med_cpu,
                "cpu_ratio_to_full": {c: med_cpu[c] / med_cpu["full"] for c in configs},
                "attention_seconds": att,  # inside kvtrim's attention function: attention + the policy's hook
                "median_attention_seconds": {c: harness.median(v) for c, v in att.items()},
                "median_rest_seconds": {c: harness.median(v) for c, v in rest.items()},
                "hook_seconds": hook,  # the policy's hook alone (scoring, selection, eviction), inside the attention's
                "median_hook_seconds": {c: harness.median(v) for c, v in hook.items()},
                "minor_faults": faults,
                "median_minor_faults": {c: harness.median(v) for c, v in faults.items()},
                "machine": harness.finish_record(dict(info)),
            }

        runs = harness.interleave(configs, prefill, reps=args.reps, warmup=args.warmup, on_sample=keep)
    final = summary(runs)
    harness.write_json(args.out, final)
    print(table(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
