"""Elastic Cache overhead at the prompt: merge step and importance vs prefill time (4k tokens).

Per repetition, interleaved: (1) a plain prefill with kvtrim's ``full`` policy; (2) a prefill with
``elastic`` at ``--keep``. Then, ``--reps`` times on the recorded q/k/v of the prompt, per layer, the importance
computation (``attention_importance``) and the merge step (anchor selection + nearest-anchor
assignment + averaging + the physical gather of ``CompressedLayer.replace``), each summed over
layers. Medians over ``--reps``; JSON with machine, versions, date and load average.

    nice -n 10 python benchmarks/bench_elastic_overhead.py --tokens 4096 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repro_elastic import machine_info, record_prompt

OUT = Path(__file__).resolve().parent / "results" / "elastic_overhead.json"


def main(argv=None) -> int:
    import kvtrim
    from kvtrim.cache import KVTrimCache
    from kvtrim.data import prose_haystack
    from kvtrim.integrations.hf import cache_kwarg
    from kvtrim.models import build_prompt_ids, load_model
    from kvtrim.policies.elastic import Elastic
    from kvtrim.registry import create_policy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(None)
    model, tok = lm.model, lm.tokenizer
    text = tok.decode(tok.encode(prose_haystack()[: 8 * args.tokens], add_special_tokens=False)[: args.tokens - 40])
    ids = build_prompt_ids(tok, text + "\n\nSummarize the passage above.")
    x = torch.tensor([ids])
    info = machine_info()
    runs = {"prefill_full": [], "prefill_elastic": [], "importance": [], "merge": []}

    def prefill(policy):
        cache = KVTrimCache(model, policy)
        t0 = time.perf_counter()
        model(input_ids=x, **{cache_kwarg(): cache, "use_cache": True, "logits_to_keep": 1})
        return time.perf_counter() - t0

    with kvtrim.attach(model), torch.inference_mode():
        cache = KVTrimCache(model, Elastic(keep=args.keep))  # warm-up on a short prompt
        model(input_ids=x[:, :256], **{cache_kwarg(): cache, "use_cache": True, "logits_to_keep": 1})
        for rep in range(args.reps):
            runs["prefill_full"].append(prefill(create_policy("full")))
            runs["prefill_elastic"].append(prefill(Elastic(keep=args.keep)))
            print(f"rep {rep}: full {runs['prefill_full'][-1]:.2f}s elastic {runs['prefill_elastic'][-1]:.2f}s", flush=True)
        _, _, record = record_prompt(model, ids)  # the prompt's q/k/v per layer
        for rep in range(args.reps):
            pol = Elastic(keep=args.keep)
            cache = KVTrimCache(model, create_policy("full"))
            t_imp = t_merge = 0.0
            for i, layer in enumerate(cache.layers):
                q, k, v, scaling = record[i]
                layer.update(k.clone(), v.clone())
                layer.awaiting_attention = False
                t0 = time.perf_counter()
                imp = pol.layer_importance(layer, q, k, scaling)
                t1 = time.perf_counter()
                anchors = pol.select_anchors(imp, pol.budget(layer.seen))
                pol.merge(layer, anchors)
                t2 = time.perf_counter()
                t_imp += t1 - t0
                t_merge += t2 - t1
            runs["importance"].append(t_imp)
            runs["merge"].append(t_merge)
            print(f"rep {rep}: importance {t_imp:.2f}s merge {t_merge:.3f}s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
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
        "start": info,
        "end": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("prompt_tokens", "median_seconds", "merge_share_of_prefill",
                                              "importance_share_of_prefill", "elastic_prefill_overhead")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
