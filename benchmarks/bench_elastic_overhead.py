"""Elastic Cache overhead at the prompt: merge step and importance vs prefill time (4k tokens).

Per repetition, interleaved by :mod:`kvtrim.harness` (order alternating): (1) a plain prefill with
kvtrim's ``full`` policy; (2) a prefill with ``elastic`` at ``--keep`` (both through
:mod:`kvtrim.decoding`, after one short warm-up forward). Then, ``--reps`` times on the recorded
q/k/v of the prompt (``kvtrim.eval.replay.record_prefill``), per layer, the importance computation
(``attention_importance``) and the merge step (anchor selection + nearest-anchor assignment +
averaging + the physical gather of ``CompressedLayer.replace``), each summed over layers. Medians
over ``--reps``; JSON with the machine record (load average at the start and the end).

    nice -n 10 python benchmarks/bench_elastic_overhead.py --tokens 4096 --reps 3 --out results/elastic_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvtrim import decoding, harness


def main(argv=None) -> int:
    import kvtrim
    from kvtrim.cache import KVTrimCache
    from kvtrim.data import prose_haystack
    from kvtrim.eval.replay import record_prefill
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.policies.elastic import Elastic
    from kvtrim.registry import create_policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=3, warmup=0, threads=2)])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--keep", type=float, default=0.5)
    args = ap.parse_args(argv)
    harness.start(ap, args)
    info = harness.machine_record()
    lm = load_model(None)
    model, tok = lm.model, lm.tokenizer
    text = tok.decode(tok.encode(prose_haystack()[: 8 * args.tokens], add_special_tokens=False)[: args.tokens - 40])
    ids = build_prompt_ids(tok, text + "\n\nSummarize the passage above.")
    policies = {"prefill_full": lambda: create_policy("full"), "prefill_elastic": lambda: Elastic(keep=args.keep)}

    def prefill(name: str, rep: int) -> float:
        times: list[float] = []
        decoding.run(model, decoding.prefill(KVTrimCache(model, policies[name]()), ids), on_step=lambda s, dt: times.append(dt))
        print(f"rep {rep}: {name} {times[0]:.2f}s", file=sys.stderr, flush=True)
        return times[0]

    def merge(name: str, rep: int) -> dict:
        pol = Elastic(keep=args.keep)
        cache = KVTrimCache(model, create_policy("full"))
        t_imp = t_merge = 0.0
        for i, layer in enumerate(cache.layers):  # the two phases of each layer, timed apart
            q, k, v, scaling = record[i]
            layer.update(k.clone(), v.clone())
            layer.awaiting_attention = False
            t0 = time.perf_counter()
            imp = pol.layer_importance(layer.view, q, k, scaling)
            t1 = time.perf_counter()
            anchors = pol.select_anchors(imp, pol.budget(layer.seen))
            layer.apply(pol.merge(layer.view, anchors))
            t_imp += t1 - t0
            t_merge += time.perf_counter() - t1
        print(f"rep {rep}: importance {t_imp:.2f}s merge {t_merge:.3f}s", file=sys.stderr, flush=True)
        return {"importance": t_imp, "merge": t_merge}

    with kvtrim.attach(model), torch.inference_mode():
        decoding.run(model, decoding.prefill(KVTrimCache(model, Elastic(keep=args.keep)), ids[:256]))  # warm-up, short prompt
        pre = harness.interleave(list(policies), prefill, reps=args.reps, warmup=args.warmup)
        record = record_prefill(model, ids).record  # the prompt's q/k/v per layer
        mer = harness.interleave(["merge"], merge, reps=args.reps)["merge"]
    runs = {name: [s.value for s in ss] for name, ss in pre.items()}
    runs.update(importance=[s.value["importance"] for s in mer], merge=[s.value["merge"] for s in mer])
    med = {k: harness.median(v) for k, v in runs.items()}
    result = {
        "benchmark": "elastic_overhead",
        "prompt_tokens": len(ids),
        "keep": args.keep,
        "reps": args.reps,
        "seconds": runs,
        "median_seconds": med,
        "merge_share_of_prefill": med["merge"] / med["prefill_full"],
        "importance_share_of_prefill": med["importance"] / med["prefill_full"],
        "elastic_prefill_overhead": med["prefill_elastic"] / med["prefill_full"] - 1.0,
        "target_merge_share": 0.05,
        "machine": harness.finish_record(info),
    }
    harness.write_json(args.out, result)
    print({k: result[k] for k in ("prompt_tokens", "median_seconds", "merge_share_of_prefill",
                                  "importance_share_of_prefill", "elastic_prefill_overhead")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
