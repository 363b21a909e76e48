"""How far the pattern search's sampled error measurement agrees with the exhaustive one.

``kvtrim search-patterns`` measures each candidate's output error on ``--query-blocks`` 64-row
query blocks spread over the calibration prompt instead of on every row (the default, 32, is 1/16
of the rows at 32k). This benchmark runs the model on the same calibration prompt as the search,
and on the chosen ``--layers`` computes, for every head, every cost level and every candidate, the
sparse output on **every** row once; the error on all rows and the error on each sample size's
rows both come from that one output. It then makes each head's choice the way the search makes it
(the cheapest level whose best candidate's error is at most ``--max-error``, that candidate; dense
if none) once from the exhaustive errors and once from each sample's, and reports per sample size:

- how many heads get the same (pattern, level) and the same pattern as the exhaustive choice;
- the sampled choice's **true** error (on every row) and density, against the exhaustive choice's;
- how many sampled choices exceed the tolerance on every row (the failure that matters);
- the measured seconds of the sampled candidates' runs, against the exhaustive runs.

The forward stops after the last asked layer. Example::

    OMP_NUM_THREADS=1 python benchmarks/search_agreement.py --model qwen2.5-0.5b --length 32768 --layers 3 12 \\
        --max-error 0.02 0.05 --threads 1 --out results/search_agreement_qwen32k.json
    python benchmarks/search_agreement.py --table benchmarks/results/search_agreement_qwen32k.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvtrim import harness
from kvtrim.attention.cpu import sparse_attention_cpu
from kvtrim.cli.common import rope_scaling_arg
from kvtrim.errors import KVTrimError
from kvtrim.rope import scaling_label
from kvtrim.tools.search_patterns import DEFAULT_LEVELS, HeadCandidates, block_rows, calibration_ids, restrict, sampled_blocks


class _Done(Exception):
    """Raised after the last asked layer: the rest of the forward is not needed."""


class AgreementHook:
    """Prefill hook: dense output for the model; on ``layers``, every candidate of every level on every row."""

    def __init__(self, layers: list[int], levels: list[float], samples: list[int], progress=None):
        self.layers, self.levels, self.samples = sorted(layers), sorted(levels), samples
        self.heads: list[dict] = []
        self.progress = progress

    def __call__(self, module, query, key, value, attention_mask, scale, **kwargs):
        li = getattr(module, "layer_idx", 0)
        dense = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=True, scale=scale,
                                               enable_gqa=True)
        if li in self.layers:
            self._layer(li, query.float(), key.float(), value.float(), dense, scale)
            if li == self.layers[-1]:
                raise _Done
        return dense.to(query.dtype).transpose(1, 2).contiguous(), None

    def _layer(self, li, q, k, v, dense, scale) -> None:
        t = q.shape[2]
        g = q.shape[1] // k.shape[1]
        keeps = {m: sampled_blocks(math.ceil(t / 64), m) for m in self.samples}
        rows = {m: block_rows(keep, t) for m, keep in keeps.items()}
        for h in range(q.shape[1]):
            kv = h // g
            qh, kh, vh = q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1]
            ref = dense[:, h : h + 1]
            t0 = time.perf_counter()
            head = HeadCandidates(qh, kh, scale)
            build_s = time.perf_counter() - t0
            cands, full_s, sampled_s = [], 0.0, {m: 0.0 for m in self.samples}
            for level in self.levels:
                try:
                    found = head.candidates(level)
                except KVTrimError:
                    continue
                for name, sizes, lay in found:
                    t0 = time.perf_counter()
                    o = sparse_attention_cpu(qh, kh, vh, lay, scale)
                    full_s += time.perf_counter() - t0
                    errors = {"all": float((o - ref).norm() / ref.norm().clamp(min=1e-12))}
                    for m in self.samples:
                        t0 = time.perf_counter()
                        sparse_attention_cpu(qh, kh, vh, restrict(lay, keeps[m]), scale)  # timed only: the rows equal o's
                        sampled_s[m] += time.perf_counter() - t0
                        r = rows[m]
                        errors[str(m)] = float((o[:, :, r] - ref[:, :, r]).norm() / ref[:, :, r].norm().clamp(min=1e-12))
                    cands.append({"level": level, "pattern": name, "sizes": sizes, "density": round(lay.density(), 5),
                                  "errors": {a: round(b, 6) for a, b in errors.items()}})
            self.heads.append({"layer": li, "head": h, "candidates": cands, "build_seconds": round(build_s, 3),
                               "full_seconds": round(full_s, 3),
                               "sampled_seconds": {str(m): round(s, 3) for m, s in sampled_s.items()}})
            if self.progress is not None:
                self.progress.update(1)


def choose(cands: list[dict], key: str, max_error: float) -> dict | None:
    """The search's choice from the errors under ``key``: the cheapest level whose best candidate's
    error is at most ``max_error``, that candidate; ``None`` (dense) if no level meets it."""
    for level in sorted({c["level"] for c in cands}):
        at = [c for c in cands if c["level"] == level]
        best = min(at, key=lambda c: c["errors"][key])
        if best["errors"][key] <= max_error:
            return best
    return None


def summarise(heads: list[dict], samples: list[int], max_errors: list[float]) -> list[dict]:
    out = []
    for eps in max_errors:
        ref = [choose(h["candidates"], "all", eps) for h in heads]
        for m in samples:
            got = [choose(h["candidates"], str(m), eps) for h in heads]

            def label(c):
                return ("dense", None) if c is None else (c["pattern"], c["level"])

            def true_err(c):
                return 0.0 if c is None else c["errors"]["all"]

            def dens(c):
                return 1.0 if c is None else c["density"]

            n = len(heads)
            out.append({
                "max_error": eps, "query_blocks": m, "heads": n,
                "same_choice": sum(label(a) == label(b) for a, b in zip(ref, got)),
                "same_pattern": sum(label(a)[0] == label(b)[0] for a, b in zip(ref, got)),
                "over_tolerance": sum(true_err(c) > eps for c in got),
                "mean_true_error": sum(map(true_err, got)) / n,
                "mean_true_error_exhaustive": sum(map(true_err, ref)) / n,
                "worst_true_error": max(map(true_err, got)),
                "mean_density": sum(map(dens, got)) / n,
                "mean_density_exhaustive": sum(map(dens, ref)) / n,
                "sampled_seconds": sum(h["sampled_seconds"][str(m)] for h in heads),
                "exhaustive_seconds": sum(h["full_seconds"] for h in heads),
            })
    return out


def table(d: dict) -> str:
    """Markdown table of an agreement result (docs/minference.md)."""
    rope = f", RoPE {d['rope_scaling']}" if d.get("rope_scaling") else ""
    lines = [f"{d['model']}, calibration {d['length']} tokens{rope}, layers {', '.join(map(str, d['layers']))} "
             f"({d['summary'][0]['heads']} heads), every level of {', '.join(map(str, d['levels']))} evaluated; "
             f"{harness.machine_line(d['machine'], d['threads'])}.",
             "",
             "| max error | query blocks | rows measured | same choice | same pattern | over tolerance (all rows) | "
             "true error: sampled / exhaustive | density: sampled / exhaustive | candidate run time: sampled / exhaustive |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nb = math.ceil(d["length"] / 64)
    for r in d["summary"]:
        n = r["heads"]
        lines.append(
            f"| {r['max_error']} | {r['query_blocks']} | 1/{nb / r['query_blocks']:.0f} | {r['same_choice']}/{n} | "
            f"{r['same_pattern']}/{n} | {r['over_tolerance']}/{n} (worst {r['worst_true_error']:.3f}) | "
            f"{r['mean_true_error']:.4f} / {r['mean_true_error_exhaustive']:.4f} | "
            f"{r['mean_density']:.3f} / {r['mean_density_exhaustive']:.3f} | "
            f"{r['sampled_seconds']:.1f} s / {r['exhaustive_seconds']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None, threads=1)])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--layers", type=int, nargs="+", default=[3, 12])
    p.add_argument("--levels", type=float, nargs="+", default=list(DEFAULT_LEVELS))
    p.add_argument("--query-blocks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--max-error", type=float, nargs="+", default=[0.02, 0.05])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rope-scaling", type=rope_scaling_arg, default=None, metavar="KIND:FACTOR",
                   help="run the model under this RoPE scaling (e.g. yarn:2, as the 64k search ran)")
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    from kvtrim.cache import KVTrimCache, cache_keyword
    from kvtrim.integrations.hf import attach
    from kvtrim.models import extend_context, load_model

    record = harness.machine_record()
    lm = load_model(args.model)
    if args.rope_scaling:
        extend_context(lm.model, args.rope_scaling[1], args.rope_scaling[0])
    n_layers = lm.model.config.num_hidden_layers
    if any(not 0 <= li < n_layers for li in args.layers):
        p.error(f"--layers must lie in [0, {n_layers})")
    ids, desc = calibration_ids(lm.tokenizer, args.length, args.seed)
    bar = tqdm(total=len(args.layers) * lm.model.config.num_attention_heads, desc="agreement", unit="head", file=sys.stderr)
    hook = AgreementHook(args.layers, args.levels, args.query_blocks, bar)
    t0 = time.perf_counter()
    with torch.inference_mode(), attach(lm.model, prefill_attention=hook):
        try:
            lm.model(input_ids=torch.tensor([ids]), **{cache_keyword(): KVTrimCache(lm.model, "full")}, logits_to_keep=1)
        except _Done:
            pass
    bar.close()
    result = {"benchmark": "search_agreement", "model": Path(lm.source).name, "calibration": desc, "length": len(ids),
              "rope_scaling": scaling_label(*args.rope_scaling) if args.rope_scaling else None,
              "layers": sorted(args.layers), "levels": sorted(args.levels), "threads": torch.get_num_threads(),
              "seconds": round(time.perf_counter() - t0, 1),
              "summary": summarise(hook.heads, args.query_blocks, args.max_error), "heads": hook.heads}
    harness.publish(args.out, result, record, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
