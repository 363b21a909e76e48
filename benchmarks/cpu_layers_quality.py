"""What fusing a CPU model's layers (:mod:`kvtrim.cpu_layers`) changes in its outputs.

The model (default Qwen2.5-0.5B) is loaded in float32 and in bfloat16, each read once with its
layers fused (the default) and once after :func:`kvtrim.cpu_layers.unfuse_layers`, over
``--windows`` windows of ``--tokens`` tokens of held-out prose (the pydoc topics, windows spread
over the text). Per variant: perplexity of the window's next tokens, and against the float32
unfused model's logits (the reference) the relative error of the logits (Frobenius norm of the
difference over the reference's) and the share of positions whose most likely next token is the
same. The question is whether fused bfloat16 is as close to float32 as plain bfloat16 is::

    python benchmarks/cpu_layers_quality.py --model qwen2.5-0.5b --tokens 2048 --windows 3 \\
        --threads 2 --out results/cpu_layers_quality.json
    python benchmarks/cpu_layers_quality.py --table benchmarks/results/cpu_layers_quality.json
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from tqdm import tqdm

from kvtrim import harness
from kvtrim.cpu_layers import fuse_layers, fused_count, unfuse_layers
from kvtrim.data import pydoc_text
from kvtrim.models import load_model

VARIANTS = ("float32 unfused", "float32 fused", "bfloat16 unfused", "bfloat16 fused")


@torch.inference_mode()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[0, :-1].float()


def run(args) -> dict:
    ref_lm = load_model(args.model, dtype="float32")
    tok = ref_lm.tokenizer
    all_ids = tok(pydoc_text())["input_ids"]
    n = args.tokens
    span = len(all_ids) - n
    if span < 0:
        raise SystemExit(f"--tokens {n} is longer than the text ({len(all_ids)} tokens)")
    starts = [round(i * span / max(1, args.windows - 1)) for i in range(args.windows)] if args.windows > 1 else [0]
    windows = [torch.tensor([all_ids[s : s + n]]) for s in starts]
    fused: dict[str, dict] = {}
    rows: list[dict] = []
    refs: list[torch.Tensor] = []

    def read(name: str, model) -> None:
        fused[name] = fused_count(model)
        for w, ids in enumerate(tqdm(windows, desc=name)):
            lg = logits_of(model, ids)
            if name == VARIANTS[0]:
                refs.append(lg)
            ref = refs[w]
            rows.append({"variant": name, "window": w, "start": starts[w],
                         "perplexity": math.exp(float(torch.nn.functional.cross_entropy(lg, ids[0, 1:]))),
                         "logit_rel_error": float((lg - ref).norm() / ref.norm()),
                         "top1_agreement": float((lg.argmax(-1) == ref.argmax(-1)).float().mean())})

    unfuse_layers(ref_lm.model)  # the reference first: float32, transformers' own layers
    read("float32 unfused", ref_lm.model)
    fuse_layers(ref_lm.model)
    read("float32 fused", ref_lm.model)
    del ref_lm
    lm = load_model(args.model, dtype="bfloat16")  # fused as load_model leaves it
    read("bfloat16 fused", lm.model)
    unfuse_layers(lm.model)
    read("bfloat16 unfused", lm.model)
    summary = []
    for name in VARIANTS:
        sel = [r for r in rows if r["variant"] == name]
        summary.append({"variant": name, "fused_modules": fused[name],
                        "perplexity": statistics.mean(r["perplexity"] for r in sel),
                        "logit_rel_error": statistics.mean(r["logit_rel_error"] for r in sel),
                        "top1_agreement": statistics.mean(r["top1_agreement"] for r in sel)})
    return {"benchmark": "cpu_layers_quality", "model": lm.source, "tokens": n, "windows": starts,
            "text": "pydoc topics", "rows": rows, "summary": summary}


def table(d: dict) -> str:
    m = d["machine"]
    lines = [f"{d['model']}, {len(d['windows'])} windows of {d['tokens']} tokens of the pydoc topics; "
             f"{harness.machine_line(m, m['torch_threads'])}, {m['date'][:10]}; means over the windows; "
             "reference = float32 unfused.", "",
             "| model as run | fused modules (MLPs, RMS norms) | perplexity | logits: relative error vs reference | same top token as reference |",
             "|---|---|---:|---:|---:|"]
    for s in d["summary"]:
        f = s["fused_modules"]
        lines.append(f"| {s['variant']} | {f['mlp']}, {f['rms_norm']} | {s['perplexity']:.4f} | {s['logit_rel_error']:.2e} | "
                     f"{100 * s['top1_agreement']:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                parents=[harness.options(reps=None, warmup=None, threads=2)])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args(argv)
    if harness.start(p, args, table=table):
        return 0
    record = harness.machine_record()
    harness.publish(args.out, run(args), record, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
