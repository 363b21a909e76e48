"""``kvtrim bench``: speed and memory of KV methods behind one command.

For each prompt length (a pass-key prompt of that many tokens) and each method it measures, with
``kvtrim.generation.generate_ids`` (greedy, ``new_tokens`` decode steps, EOS ignored):

- prefill seconds and decode milliseconds per token: one warm-up run per length, then ``reps``
  timed repetitions with the methods *interleaved* (rep 1 of every method, then rep 2, ...) so load
  drifts hit all of them; medians reported, every repetition kept in the JSON;
- resident KV bytes at the end (``KVTrimCache.kv_bytes``) and what an uncompressed cache holds;
- peak RSS of a whole run: each (method, length) once more in a fresh subprocess
  (``python -m kvtrim.eval.bench --one ...``), reading its ``ru_maxrss`` (``--no-rss`` skips it).

The JSON records the machine, versions, thread count, date and the load average before and after.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

from kvtrim import harness, validate
from kvtrim.errors import KVTrimError
from kvtrim.eval.plan import REFERENCE
from kvtrim.validate import comma_list


@dataclass
class BenchPlan:
    methods: list[str]
    keep: float
    lengths: list[int]
    reps: int = 3
    new_tokens: int = 32
    prefill: str = "dense"
    threads: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_bits: int = 16


def make_bench_plan(methods, keep, lengths, reps=3, new_tokens=32, prefill="dense", threads=None, *,
                    dtype="float32", device="cpu", kv_bits: int = 16) -> BenchPlan:
    from kvtrim.cache import check_kv_bits
    from kvtrim.integrations.prefill import PREFILL_MODES
    from kvtrim.models import check_dtype, resolve_device
    from kvtrim.registry import check_text_prompt, get_policy_class

    names = comma_list(methods, "--methods")
    for m in names:
        get_policy_class(m)  # raises on an unknown name
    keep = validate.fraction(keep, "--keep")
    for m in names:  # the bench prompt is text: a method that needs image spans would run as full
        check_text_prompt(_policy(m, keep))
    try:
        lens = [int(x) for x in comma_list(lengths, "--lengths")]
    except ValueError:
        raise KVTrimError(f"--lengths takes comma-separated token counts; got {lengths!r}") from None
    if any(n < 128 for n in lens):
        raise KVTrimError(f"--lengths must be >= 128 tokens; got {lengths}")
    reps = validate.integer(reps, "--reps", minimum=1)
    new_tokens = validate.integer(new_tokens, "--new-tokens", minimum=2)
    threads = validate.optional_integer(threads, "--threads", minimum=1)
    if prefill not in PREFILL_MODES:
        raise KVTrimError(f"unknown --prefill {prefill!r}; choose one of: {', '.join(PREFILL_MODES)}")
    dtype_name = str(check_dtype(dtype)).removeprefix("torch.")  # "auto" stays "auto": resolved on load (result["dtypes"])
    device_name = str(resolve_device(device))
    return BenchPlan(list(dict.fromkeys(names)), float(keep), lens, reps, new_tokens, prefill, threads, dtype_name, device_name,
                     check_kv_bits(kv_bits))


def _policy(method: str, keep: float):
    from kvtrim.registry import create_policy, get_policy_class

    return create_policy(method, **({"keep": keep} if get_policy_class(method).takes_budget else {}))


def _prompt(lm, length: int) -> list[int]:
    from kvtrim.eval.tasks import passkey
    from kvtrim.models import build_prompt_ids

    return build_prompt_ids(lm.tokenizer, passkey(lm.tokenizer, length, depth=0.5, seed=0).prompt)


def _one_run(lm, ids, method, plan: BenchPlan, prefill_hook) -> dict:
    from kvtrim.generation import generate_ids

    r = generate_ids(lm.model, lm.tokenizer, ids, _policy(method, plan.keep), max_new_tokens=plan.new_tokens,
                     stop_at_eos=False, prefill=prefill_hook, kv_bits=plan.kv_bits)
    return {"prefill_s": r.prefill_seconds, "decode_ms": 1000 * r.decode_seconds / max(1, r.decode_steps),
            "kv_bytes": r.kv_bytes, "kv_bytes_full": r.kv_bytes_full, "stored_tokens": r.stored_tokens}


def _peak_rss(model: str | None, method: str, length: int, plan: BenchPlan) -> int | None:
    cmd = [sys.executable, "-m", "kvtrim.eval.bench", "--one", json.dumps(
        {"model": model, "method": method, "length": length, "plan": asdict(plan)})]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise KVTrimError(f"peak-RSS run of {method} at {length} tokens failed: {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def run_bench(model: str | None, plan: BenchPlan, rss: bool = True, progress: bool = True) -> dict:
    import torch
    from tqdm import tqdm

    from kvtrim.eval.store import machine
    from kvtrim.models import load_model

    if plan.threads:
        torch.set_num_threads(plan.threads)
    lm = load_model(model, dtype=plan.dtype, device=plan.device)
    hook = None
    if plan.prefill != "dense":
        from kvtrim.integrations.prefill import make_prefill

        hook = make_prefill(lm.model, plan.prefill)
    too_long = [n for n in plan.lengths if lm.max_context and n + plan.new_tokens + 64 > lm.max_context]
    if too_long:
        raise KVTrimError(f"--lengths {too_long} exceed the model's context of {lm.max_context} with the answer; "
                          "use shorter lengths")
    load_before = list(os.getloadavg())
    rows = []
    total = len(plan.lengths) * (len(plan.methods) * (plan.reps + 1) + (len(plan.methods) if rss else 0))
    bar = tqdm(total=total, desc="kvtrim bench", unit="run", disable=not progress)
    for n in plan.lengths:
        ids = _prompt(lm, n)

        def one(m: str, rep: int, ids=ids, n=n) -> dict:
            bar.set_postfix_str(f"{m}@{n} " + ("warm-up" if rep < 0 else f"rep {rep + 1}"))
            r = _one_run(lm, ids, m, plan, hook)
            bar.update(1)
            return r

        # one warm-up round, then plan.reps rounds with the methods' order alternating (kvtrim.harness)
        samples = harness.interleave(plan.methods, one, reps=plan.reps, warmup=1)
        runs = {m: [smp.value for smp in samples[m]] for m in plan.methods}
        for m in plan.methods:
            rs = runs[m]
            row = {"method": m, "keep": plan.keep if _policy(m, plan.keep).takes_budget else None, "length": n,
                   "prompt_tokens": len(ids), "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                   "decode_ms": statistics.median(r["decode_ms"] for r in rs), "kv_bytes": rs[-1]["kv_bytes"],
                   "kv_bytes_full": rs[-1]["kv_bytes_full"], "stored_tokens": rs[-1]["stored_tokens"], "reps": rs}
            if rss:
                bar.set_postfix_str(f"{m}@{n} peak RSS")
                row["peak_rss_bytes"] = _peak_rss(model, m, n, plan)
                bar.update(1)
            rows.append(row)
    bar.close()
    info = machine()
    info["loadavg_before"] = load_before
    return {"what": "kvtrim bench: prefill and decode time (medians after a warm-up, methods interleaved), resident "
                    "KV bytes, peak RSS per run (fresh subprocess)",
            "model": lm.source, "plan": asdict(plan), "dtypes": lm.dtypes.names() if lm.dtypes else None,
            "machine": info, "rows": rows}


def table(result: dict) -> str:
    rows = result["rows"]
    full = {r["length"]: r for r in rows if r["method"] == REFERENCE}
    out = ["| length | method | prefill s | decode ms/tok | KV MiB | KV of full | peak RSS MiB |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = full.get(r["length"])
        label = r["method"] if r["keep"] is None else f"{r['method']} @{r['keep']:g}"
        frac = f"{r['kv_bytes'] / f['kv_bytes']:.0%}" if f else "—"
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r.get("peak_rss_bytes") else "—"
        out.append(f"| {r['length']} | {label} | {r['prefill_s']:.2f} | {r['decode_ms']:.1f} | {r['kv_bytes'] / 2**20:.1f} "
                   f"| {frac} | {rss} |")
    m = result["machine"]
    bits = result["plan"].get("kv_bits", 16)
    dts = result.get("dtypes")
    if dts and (result["plan"].get("dtype") == "auto" or len({dts["storage"], dts["prefill"], dts["decode"]}) > 1):
        out.append(f"\ndtype {result['plan'].get('dtype')}: storage {dts['storage']}, prefill {dts['prefill']}, "
                   f"decode {dts['decode']} ({dts['reason']}).")
    out.append(f"\n{f'kv_bits {bits}; ' if bits != 16 else ''}{m['cores']} cores, {m['threads']} threads, torch {m['torch']}, {m['date']}; load "
               f"{m['loadavg_before'][0]:.1f} before, {m['loadavg'][0]:.1f} after.")
    return "\n".join(out)


def _one(spec: str) -> None:
    """Subprocess entry: one run of a configuration; prints its peak RSS."""
    import resource

    import torch

    from kvtrim.models import load_model

    d = json.loads(spec)
    plan = BenchPlan(**d["plan"])
    if plan.threads:
        torch.set_num_threads(plan.threads)
    lm = load_model(d["model"], dtype=plan.dtype, device=plan.device)
    hook = None
    if plan.prefill != "dense":
        from kvtrim.integrations.prefill import make_prefill

        hook = make_prefill(lm.model, plan.prefill)
    _one_run(lm, _prompt(lm, d["length"]), d["method"], plan, hook)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_bytes": kib * 1024}))


if __name__ == "__main__":  # pragma: no cover - exercised by run_bench
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        _one(sys.argv[2])
    else:
        sys.exit("usage: python -m kvtrim.eval.bench --one SPEC (internal); use `kvtrim bench`")
