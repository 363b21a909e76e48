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

Configurations are interleaved per repetition by :mod:`kvtrim.harness` (order alternating);
medians of ``--reps`` (2 at 1 image after one warm-up round, 1 at 5 images: bounded by the run
time on 2 shared cores; see the JSON).

    python benchmarks/bench_hae_prefill.py --out results/hae_prefill.json          # writes results/hae_prefill.json
    python benchmarks/bench_hae_prefill.py --table benchmarks/results/hae_prefill.json   # its table in docs/results.md
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvtrim import decoding, harness
from kvtrim.cache import KVTrimCache
from kvtrim.integrations.hf import attach
from kvtrim.models import load_model
from kvtrim.registry import create_policy
from kvtrim.vlm import llava_from_text_model, prepare, sample_images


def table(d: dict) -> str:
    """The docs/results.md table of an HAE prefill result."""
    m = d["machine"] if isinstance(d.get("machine"), dict) else d
    out = [
        f"{d['model']}, {d['dtype']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"{m.get('torch_threads', m.get('threads'))} thread(s), {d['date'][:10]}, load average at the end "
        f"{m['loadavg_end'][0]:.1f} (shared machine).",
        "",
        "| visual tokens | prompt | config | visual kept | prefill s (median) | vs full | KV stored (of full) | tokens first/last layer |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {576 * r['images']} | {r['prompt_tokens']} | {r['config']} | {r['visual_kept']}/{r['visual_tokens']} | "
            f"{r['prefill_s_median']:.2f} (n={len(r['prefill_s_all'])}) | {r['speedup_vs_full']:.2f}x | "
            f"{r['kv_bytes_stored'] / 2**20:.1f} MiB ({r['kv_share_of_full']:.0%}) | "
            f"{r['stored_tokens_first_last_layer'][0]}/{r['stored_tokens_first_last_layer'][1]} |"
        )
    return "\n".join(out)


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
def prefill(model, ids: list[int], extra: dict, name: str, kw: dict) -> dict:
    """One prefill forward (:func:`kvtrim.decoding.prefill`); ``seconds`` is the forward alone."""
    cache = KVTrimCache(model, create_policy(name, **kw))
    times: list[float] = []
    with attach(model):
        decoding.run(model, decoding.prefill(cache, ids, extra=extra), on_step=lambda step, seconds: times.append(seconds))
    dt = sum(times)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=1, threads=2)])
    ap.add_argument("--images", default="1,5", help="images per prompt (576 visual tokens each)")
    ap.add_argument("--reps", default="2,1", help="repetitions per image count (the --warmup rounds run before the first count only)")
    ap.add_argument("--skip-at-5", default="fastv_kv", help="configs left out at 5 images to bound the run time on 2 shared cores")
    ap.add_argument("--alpha", type=float, default=1.0, help="DAP alpha of the matched pair (1.0: the local test never protects)")
    args = ap.parse_args(argv)
    if harness.start(ap, args, table=table):
        return 0
    machine = harness.machine_record()
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
        n_reps, warm = reps[min(ci, len(reps) - 1)], args.warmup if ci == 0 else 0
        imgs = [photos[i % len(photos)] for i in range(n_img)]
        ids, extra = prepare(v.processor, "Describe the pictures in detail.", imgs)
        last: dict[str, dict] = {}

        def one(cname: str, rep: int) -> dict:
            res = prefill(v.model, ids, extra, *cfgs[cname])
            last[cname] = res
            print(f"{n_img} img rep {rep} {cname}: {res['seconds']:.2f}s", file=sys.stderr, flush=True)
            return res

        samples = harness.interleave(list(cfgs), one, reps=n_reps, warmup=warm)
        full_s = harness.median(samples["full"], "seconds")
        for cname in cfgs:
            res = last[cname]
            st = harness.stats(samples[cname], "seconds")
            rows.append({
                "images": n_img, "prompt_tokens": len(ids), "config": cname, "policy": cfgs[cname][1], "prefill_s_median": st["median"],
                "prefill_s_all": st["all"], "speedup_vs_full": full_s / st["median"],
                **{k: res[k] for k in ("kv_bytes", "kv_bytes_stored", "kv_bytes_full", "visual_tokens", "visual_kept")},
                "kv_share_of_full": res["kv_bytes_stored"] / res["kv_bytes_full"],
                "stored_tokens_first_last_layer": [res["stored_tokens_per_layer"][0], res["stored_tokens_per_layer"][-1]],
                "reps": n_reps,
            })
        out = {
            "benchmark": "hae_prefill",
            "model": "LlavaForConditionalGeneration(text=SmolLM2-135M-Instruct real weights, vision=random tiny CLIP 336/14)",
            "date": machine["date"], "machine": harness.finish_record(machine), "dtype": "float32", "rows": rows,
        }
        harness.write_json(args.out, out)  # rewritten after every image count: a long run keeps what it measured
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
