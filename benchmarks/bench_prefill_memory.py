"""Peak memory of a long prefill: one forward vs chunked prefill that compresses after every chunk.

For each length, method and mode, one prefill (no decoding) of a prompt of essays on the embedded
model (default) runs in a fresh process (:func:`kvtrim.harness.isolated`, one torch thread). The
child loads the model, runs one 16-token forward, reads every weight once, resets the kernel's high-water mark of its
resident set (``/proc/self/clear_refs``, so the model load's own peak does not count), prefills
exactly as ``kvtrim generate`` does (:func:`kvtrim.generate_ids` with ``max_new_tokens=0``;
``prefill_chunk=None``: one forward; ``N``: pieces of N tokens, each later piece a policy "turn"
that evicts down to the budget, the heap trimmed between pieces) and reports:

* ``base_rss``: resident bytes after loading, one 16-token forward and reading every parameter and
  buffer once (the weights are memory-mapped and a page becomes resident when first read): all the
  weights plus the Python/torch runtime (``weights_read``: true; results made before this read only
  the weight pages the 16-token forward touched, so the embedding rows of a prompt's other tokens
  counted in their peaks);
* ``peak_rss``: the high-water mark during the prefill (``VmHWM``); ``rss_after``: the resident set after it;
* ``weights``: bytes of the parameters and buffers; ``kv``: the compressed cache's resident
  key/value buffers at the end (``KVTrimCache.kv_bytes``), ``kv_index``: its bookkeeping;
  ``kv_full``: what an uncompressed cache would hold;
* ``seconds``: the prefill's wall time (load recorded; timing is not this benchmark's claim).

The bound of issue P7 is ``loaded + 2 x kv + W``, with ``loaded`` the chunk-alone run's ``base_rss``
(one value for every row; a row's own varies when the kernel has dropped pages of the memory-mapped
weights under memory pressure, which then count again in its peak) and ``W`` one chunk's working set: the peak
increment (``peak_rss - base_rss``) of a full-cache prefill of one chunk alone (config
``chunk-alone``), i.e. what one chunk's activations, attention and its own KV cost when nothing
else is held. That increment varies from process to process by up to ~100 MiB on the reference
model (how glibc's heap happens to place the activations), so the chunk-alone prefill runs
``--alone-reps`` times (default 3) and the run with the median increment gives ``W`` and ``loaded``
(all of them are kept, ``chunk_alone_runs``). ``holds`` says whether a configuration's peak is within
it. Beyond the model's trained context (8k for the embedded model) the RoPE is scaled linearly
(``bench_minference_prefill.scale_rope``; memory and time do not depend on it, outputs are not judged).

    python benchmarks/bench_prefill_memory.py --lengths 8192 16384 32768 --out results/prefill_memory.json
    python benchmarks/bench_prefill_memory.py --table benchmarks/results/prefill_memory/smollm2.json

``--oneshot-at`` / ``--chunked-at LENGTH=METHOD,...`` limit which one-forward / chunked
configurations run at a length (a 32k one-forward prefill takes ~10 minutes on one thread);
``full`` runs chunked only up to ``--full-chunked-max`` (its cache grows to the whole prompt and
its attention costs as much as one forward's). ``--mmap-at`` adds chunked runs with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (see docs/memory.md, "The allocator"), and with
``--mmap-only`` those configurations run with the fixed threshold only (no run with glibc's
defaults: at 32k on the reference model each run takes 10-15 minutes on one thread); ``--reuse
FILE ...`` takes the records of earlier runs instead of measuring them again (several files: runs
made side by side, one process each, assembled into one result).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys

from kvtrim import harness
from kvtrim.machine import load_average

METHODS = ("full", "snapkv", "h2o", "streaming_llm", "inf_mllm", "elastic")
#: the fixed glibc mmap threshold of the ``--mmap-at`` runs (bytes)
MMAP_THRESHOLD = 1 << 20


def hwm_bytes() -> int:
    """The resident set's high-water mark (``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024  # type: ignore[union-attr]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024  # type: ignore[union-attr]


def reset_hwm() -> None:
    """Reset ``VmHWM`` to the current resident set (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def prompt_ids(tokenizer, n: int) -> list[int]:
    from kvtrim.data import essays_text

    ids = tokenizer(essays_text())["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def run_one(n: int, method: str, chunk: int | None, keep: float, model_name: str | None) -> int:
    """A child: one prefill in this fresh process; reports its memory to the parent."""
    import torch
    from bench_minference_prefill import scale_rope

    from kvtrim.generation import generate_ids
    from kvtrim.models import load_model
    from kvtrim.registry import create_policy

    torch.set_num_threads(1)
    lm = load_model(model_name)
    model = lm.model
    scale_rope(model, n, int(model.config.max_position_embeddings))
    ids = prompt_ids(lm.tokenizer, n)
    policy = create_policy(method) if method == "full" else create_policy(method, keep=keep)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:16]]), logits_to_keep=1)
        # The weights are memory-mapped: a page becomes resident when first read, and a forward reads only
        # the embedding rows of its own tokens. Read every weight once, so `base_rss` holds all of them and
        # a prompt's new tokens do not count their embedding rows in the prefill's peak.
        for t in [*model.parameters(), *model.buffers()]:
            if t.layout == torch.strided:
                t.sum()
    gc.collect()
    base = rss_bytes()
    reset_hwm()
    load0 = load_average()
    # the prefill exactly as `kvtrim generate` runs it (trimming the heap between chunks), no new token
    res = generate_ids(model, lm.tokenizer, ids, policy, max_new_tokens=0, prefill_chunk=chunk)
    peak, after = hwm_bytes(), rss_bytes()
    harness.child_result({
        "length": n, "method": method, "chunk": chunk, "keep": None if method == "full" else keep,
        "allocator": os.environ.get("MALLOC_MMAP_THRESHOLD_") and f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}",
        "weights_read": True, "base_rss": base, "peak_rss": peak, "rss_after": after, "weights": weights, "kv": res.kv_bytes,
        "kv_stored": res.kv_bytes_stored, "kv_index": res.index_bytes, "kv_full": res.kv_bytes_full,
        "stored_tokens": res.stored_tokens, "seconds": res.prefill_seconds, "loadavg": [load0, load_average()],
    })
    return 0


def bound(rec: dict, loaded: int, w: int) -> dict:
    """The bound of a record and whether its peak is within it: ``loaded + 2 x kv + w``, with ``loaded``
    the resident set of the chunk-alone run after loading (one value for every row: a row's own
    after-load figure varies when the kernel has dropped some of the memory-mapped weights' pages)."""
    b = loaded + 2 * rec["kv"] + w
    return {"bound": b, "holds": rec["peak_rss"] <= b}


def alone_runs(d: dict) -> str:
    """How W was chosen, for the table's header: the median of several chunk-alone runs, or one."""
    runs = d.get("chunk_alone_runs") or []
    if len(runs) < 2:
        return ""
    ws = sorted((r["peak_rss"] - r["base_rss"]) / 2**20 for r in runs)
    return f"; the median of {len(runs)} runs, {ws[0]:.0f}-{ws[-1]:.0f}"


def table(d: dict) -> str:
    """The markdown table of a result (docs/memory.md)."""
    m = d["machine"]
    mib = 2**20
    w = d.get("chunk_working_set")
    loaded = ("resident after loading and reading every weight once (all the weights + runtime)"
              if d.get("chunk_alone", {}).get("weights_read") else
              "resident after loading and a 16-token forward (runtime + the weight pages read so far; the "
              "memory-mapped weights' other pages count in a row's peak when its prompt first reads them)")
    lines = [
        f"{d['model']}, float32, torch {m['torch']}, 1 thread, {d['date'][:10]}; keep {d['keep']}, chunks of "
        f"{d['chunk']} tokens; one prefill per process; MiB. Weights {d['weights'] / mib:.0f} MiB; {loaded} "
        f"{d['base_rss'] / mib:.0f} MiB; one chunk's working set W "
        + (f"{w / mib:.0f} MiB (a full-cache prefill of {d['chunk']} tokens alone{alone_runs(d)})." if w else "not measured."),
        "",
        "| length | method | prefill | peak RSS | peak - loaded | KV at end | KV full | bound (loaded + 2 KV + W) | holds | seconds |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in d["records"]:
        r = {**r, **bound(r, d["base_rss"], w)} if w else r
        mode = f"chunks of {r['chunk']}" if r["chunk"] else "one forward"
        if r.get("allocator"):
            mode += f", {r['allocator']}"
        bound_ = r.get("bound")
        lines.append(
            f"| {r['length']} | {r['method']} | {mode} | {r['peak_rss'] / mib:.0f} | {(r['peak_rss'] - d['base_rss']) / mib:.0f} | "
            f"{r['kv'] / mib:.1f} | {r['kv_full'] / mib:.0f} | {bound_ / mib:.0f} | {'yes' if r.get('holds') else 'no'} | "
            f"{r['seconds']:.0f} |" if bound_ else
            f"| {r['length']} | {r['method']} | {mode} | {r['peak_rss'] / mib:.0f} | {(r['peak_rss'] - d['base_rss']) / mib:.0f} | "
            f"{r['kv'] / mib:.1f} | {r['kv_full'] / mib:.0f} | | | {r['seconds']:.0f} |"
        )
    if d.get("skipped"):
        lines += ["", "Not measured: " + "; ".join(d["skipped"]) + "."]
    return "\n".join(lines)


def parse_oneshot(items: list[str] | None) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for item in items or []:
        n, _, names = item.partition("=")
        out[int(n)] = [x for x in names.split(",") if x]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--keep", type=float, default=0.1)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.add_argument("--oneshot-at", nargs="*", metavar="LENGTH=METHOD,...",
                   help="one-forward configurations at a length (default: every method at every length)")
    p.add_argument("--full-chunked-max", type=int, default=8192, help="longest length at which full runs chunked")
    p.add_argument("--mmap-at", nargs="*", metavar="LENGTH=METHOD,...",
                   help=f"chunked configurations also run with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (glibc then "
                        "returns every freed block of 1 MiB or more to the OS at once)")
    p.add_argument("--chunked-at", nargs="*", metavar="LENGTH=METHOD,...",
                   help="chunked configurations at a length (default: every method at every length)")
    p.add_argument("--mmap-only", action="store_true",
                   help="the --mmap-at configurations run with the fixed threshold only, not also with glibc's defaults")
    p.add_argument("--reuse", metavar="FILE", nargs="+",
                   help="take the records (and the chunk-alone runs, from the first file) of earlier "
                        "results of this script instead of measuring them again")
    p.add_argument("--alone-reps", type=int, default=3,
                   help="chunk-alone runs; the one with the median working set gives W and loaded (default 3)")
    p.add_argument("--one", nargs=3, metavar=("LENGTH", "METHOD", "CHUNK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        chunk = int(args.one[2]) or None
        return run_one(int(args.one[0]), args.one[1], chunk, args.keep, args.model)
    if harness.start(p, args, table=table):
        return 0

    def child(n: int, method: str, chunk: int | None, mmap: bool = False) -> dict:
        argv_ = ["--one", str(n), method, str(chunk or 0), "--keep", str(args.keep)]
        if args.model:
            argv_ += ["--model", args.model]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if mmap else None
        rec = harness.isolated(__file__, argv_, env=env)
        print(f"{n} {method} chunk={chunk} {rec['allocator'] or ''}: peak {rec['peak_rss'] / 2**20:.0f} MiB "
              f"(+{(rec['peak_rss'] - rec['base_rss']) / 2**20:.0f}), KV {rec['kv'] / 2**20:.1f} MiB, "
              f"{rec['seconds']:.0f} s", file=sys.stderr, flush=True)
        return rec

    if args.alone_reps < 1:
        p.error("--alone-reps must be at least 1")
    earlier: dict = {"records": []}
    for path in args.reuse or []:  # the first file's chunk-alone run and its records first
        try:
            d = harness.read_result(path)
        except (OSError, ValueError) as e:
            p.error(f"--reuse {path}: cannot read it ({e})")
        if d.get("model") != (args.model or "SmolLM2-135M-Instruct") or d.get("keep") != args.keep:
            p.error(f"--reuse {path}: its records are of model {d.get('model')!r} at keep {d.get('keep')}, "
                    f"not {args.model or 'SmolLM2-135M-Instruct'!r} at keep {args.keep}")
        if not d.get("chunk_alone", {}).get("weights_read"):
            p.error(f"--reuse {path}: measured before this benchmark read every weight before its base, so its "
                    "rows count weight pages in their peaks; measure them again")
        recs = [{**r, "reused_from": r.get("reused_from", path)} for r in d["records"]]
        d.setdefault("chunk_alone_runs", [d["chunk_alone"]])
        earlier = {**d, **earlier, "records": earlier["records"] + recs}
    reuse = earlier["records"]
    # Convert the model here, once, before any measured child: on a fresh machine the first child to load
    # a GGUF model would otherwise convert it in-process, and the conversion's heap would inflate that
    # child's resident set after loading and hide its prefill's own working set (the chunk-alone run's W).
    from kvtrim.errors import KVTrimError
    from kvtrim.models import resolve_model

    try:
        resolve_model(args.model)
    except KVTrimError as e:  # a model that cannot be loaded: one usage line, before anything runs
        p.error(str(e))
    machine = harness.machine_record()
    oneshot = parse_oneshot(args.oneshot_at)
    mmap_at = parse_oneshot(args.mmap_at)
    chunked_at = parse_oneshot(args.chunked_at)
    result: dict = {"benchmark": "prefill_memory", "date": machine["date"], "machine": machine,
                    "model": args.model or "SmolLM2-135M-Instruct", "keep": args.keep, "chunk": args.chunk,
                    "lengths": args.lengths, "records": [], "skipped": []}
    alone_runs = earlier.get("chunk_alone_runs", [])
    if earlier.get("chunk") != args.chunk or len(alone_runs) < args.alone_reps:
        alone_runs = [child(args.chunk, "full", None) for _ in range(args.alone_reps)]
    alone = sorted(alone_runs, key=lambda r: r["peak_rss"] - r["base_rss"])[(len(alone_runs) - 1) // 2]
    w = alone["peak_rss"] - alone["base_rss"]
    result.update(chunk_working_set=w, chunk_alone=alone, chunk_alone_runs=alone_runs, weights=alone["weights"],
                  base_rss=alone["base_rss"])
    for n in args.lengths:
        for chunk in (args.chunk, None):  # the chunked runs of a length first (the one-forward runs are the slow ones)
            for method in args.methods:
                if chunk is None and n in oneshot and method not in oneshot[n]:
                    result["skipped"].append(f"{method} one forward at {n}")
                    continue
                if chunk is not None and method == "full" and n > args.full_chunked_max:
                    result["skipped"].append(f"full chunked at {n}")
                    continue
                if chunk is not None and n in chunked_at and method not in chunked_at[n]:
                    result["skipped"].append(f"{method} chunked at {n}")
                    continue

                def measured(mmap: bool, n=n, method=method, chunk=chunk) -> dict:
                    old = [r for r in reuse if (r["length"], r["method"], r["chunk"], bool(r.get("allocator"))) == (n, method, chunk, mmap)]
                    if old:  # measured by an earlier run of this script (--reuse)
                        return old[0]
                    return child(n, method, chunk, mmap)

                fixed = chunk is not None and method in mmap_at.get(n, [])
                runs = [] if fixed and args.mmap_only else [measured(False)]
                if not runs:
                    result["skipped"].append(f"{method} chunked at {n} with glibc's defaults")
                if fixed:
                    runs.append(measured(True))
                for rec in runs:
                    result["records"].append({**rec, **bound(rec, alone["base_rss"], w)})
                harness.write_json(args.out, result)  # rewritten after every run: a long run keeps what it measured
    harness.publish(args.out, result, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
