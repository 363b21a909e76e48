"""Prefill time and KV bytes on a VLM: full vs HAE's DAP (hidden-state pruning vs KV slicing) vs FastV.

Model: ``LlavaForConditionalGeneration`` whose language model is the embedded SmolLM2-135M (real
weights, fp32, CPU) behind a random tiny CLIP tower (``kvtrim.vlm.llava_from_text_model``): 576
image tokens per 336x336 image, so 1 image = 576 visual tokens (LLaVA-1.5) and 5 images = 2,880
(LLaVA-NeXT's 5 x 576). Images are scikit-image photos. The image features are noise (random
tower), so *which* tokens DAP keeps is not meaningful here; the timings and bytes are.

For a fair prune-vs-slice comparison both HAE modes must drop the same tokens. DAP's thresholds
act on the attention shares; with noise features the default r=0.0015, alpha=0.0005 may keep or
drop anything, so the run records the kept share for the defaults and also runs a threshold
pair (``--r``/``--alpha``) and reports what it kept. FastV keeps 50% by construction.

Configurations are interleaved per repetition; medians of ``--reps`` (2 at 1 image after one
warm-up pass, 1 at 5 images: bounded by the run time on 2 shared cores; see the JSON).

    .venv/bin/python benchmarks/bench_hae_prefill.py --out benchmarks/results/hae_prefill.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import transformers

from kvtrim.cache import KVTrimCache
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy
from kvtrim.vlm import llava_from_text_model, prepare, sample_images


def configs(r: float, alpha: float) -> dict:
    return {
        "full": ("full", {}),
        "hae_prune(defaults)": ("hae", {}),
        "hae_prune(matched)": ("hae", {"r": r, "alpha": alpha}),
        "hae_kv(matched)": ("hae", {"r": r, "alpha": alpha, "dap_mode": "kv"}),
        "fastv_prune": ("fastv", {}),
        "fastv_kv": ("fastv", {"mode": "kv"}),
    }


@torch.inference_mode()
def prefill(model, ids, extra, name, kw) -> dict:
    cache = KVTrimCache(model, create_policy(name, **kw))
    with attach(model):
        t0 = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
        dt = time.perf_counter() - t0
    st = cache.layers[cache.policy.decision_layer].state if hasattr(cache.policy, "decision_layer") else {}
    return {
        "seconds": dt,
        "kv_bytes": cache.kv_bytes(),
        "kv_bytes_stored": cache.kv_bytes_stored(),
        "kv_bytes_full": cache.kv_bytes_full(),
        "stored_tokens_per_layer": cache.stored_tokens(),
        "visual_tokens": st.get("targets", cache.spans.count(("image",)) if cache.spans else 0),
        "visual_kept": st.get("targets_kept", cache.spans.count(("image",)) if cache.spans else 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="1,5", help="images per prompt (576 visual tokens each)")
    ap.add_argument("--reps", default="2,1", help="repetitions per image count (a warm-up pass runs before the first count only)")
    ap.add_argument("--skip-at-5", default="fastv_kv", help="configs left out at 5 images to bound the run time on 2 shared cores")
    ap.add_argument("--alpha", type=float, default=1.0, help="DAP alpha of the matched pair (1.0: the local test never protects)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/hae_prefill.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None)
    v = llava_from_text_model(lm)
    photos = list(sample_images().values())
    rows = []
    reps = [int(x) for x in args.reps.split(",")]
    for ci, n_img in enumerate([int(x) for x in args.images.split(",")]):
        # matched pair: r = 1 / n_visual drops the visual tokens with below-average global relevance
        cfgs = configs(1.0 / (576 * n_img), args.alpha)
        if n_img >= 5:
            cfgs = {c: v for c, v in cfgs.items() if c not in args.skip_at_5.split(",")}
        n_reps, warm = reps[min(ci, len(reps) - 1)], 1 if ci == 0 else 0
        imgs = [photos[i % len(photos)] for i in range(n_img)]
        ids, extra = prepare(v.processor, "Describe the pictures in detail.", imgs)
        ids_t = torch.tensor([ids])
        times: dict[str, list[float]] = {c: [] for c in cfgs}
        last: dict[str, dict] = {}
        for rep in range(n_reps + warm):
            for cname, (name, kw) in cfgs.items():
                res = prefill(v.model, ids_t, extra, name, kw)
                if rep >= warm:
                    times[cname].append(res["seconds"])
                last[cname] = res
                print(f"{n_img} img rep {rep} {cname}: {res['seconds']:.2f}s", flush=True)
        full_s = statistics.median(times["full"])
        for cname in cfgs:
            res = last[cname]
            med = statistics.median(times[cname])
            rows.append({
                "images": n_img, "prompt_tokens": len(ids), "config": cname, "policy": cfgs[cname][1], "prefill_s_median": med,
                "prefill_s_all": times[cname], "speedup_vs_full": full_s / med,
                **{k: res[k] for k in ("kv_bytes", "kv_bytes_stored", "kv_bytes_full", "visual_tokens", "visual_kept")},
                "kv_share_of_full": res["kv_bytes_stored"] / res["kv_bytes_full"],
                "stored_tokens_first_last_layer": [res["stored_tokens_per_layer"][0], res["stored_tokens_per_layer"][-1]],
                "reps": n_reps,
            })
        dump(args, rows)


def dump(args, rows) -> None:
    out = {
        "benchmark": "hae_prefill",
        "model": "LlavaForConditionalGeneration(text=SmolLM2-135M-Instruct real weights, vision=random tiny CLIP 336/14)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "loadavg_end": os.getloadavg(), "torch": torch.__version__, "transformers": transformers.__version__,
        "dtype": "float32", "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(rows[-1], indent=1), flush=True)


if __name__ == "__main__":
    main()
