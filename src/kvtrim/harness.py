"""The benchmark harness: one way to time, repeat, record and write what ``benchmarks/`` measures.

Every script in ``benchmarks/`` is built from these pieces, so warm-up, interleaving, medians, the
machine record and the output contract exist once:

* :func:`options` -- the standard command line (``--out``, ``--force``, ``--table FILE``,
  ``--reps``, ``--warmup``) as an ``argparse`` parent;
* :func:`start` -- validate ``--out`` *before* any work (an existing file is refused unless
  ``--force``) or, with ``--table FILE``, render a committed result as its markdown table and stop;
* :func:`interleave` -- warm-up rounds (discarded), then repetitions of several configurations in
  one round each, the order alternating (or rotating) between rounds so that load drift on a
  shared machine hits every configuration alike;
* :func:`stats` -- median, min, max and all samples;
* :func:`machine_record` / :func:`finish_record` -- :func:`kvtrim.machine.machine_info` at the
  start, the load average at the end;
* :func:`write_json` / :func:`append_jsonl` -- the output (a JSON file is replaced atomically, so a
  long run that rewrites its file after every step keeps what it measured);
* :func:`isolated` / :func:`child_result` -- one measurement in a fresh Python process (no allocator
  or order effects between configurations that hold gigabytes).

Example (a fake timed function; see ``tests/test_harness.py``)::

    ap = argparse.ArgumentParser(parents=[harness.options(reps=3, warmup=1)])
    args = ap.parse_args()
    if harness.start(ap, args, table=my_table):
        return 0                                   # --table FILE: printed, nothing run
    machine = harness.machine_record()
    samples = harness.interleave(["dense", "sparse"], lambda name, rep: run(name), reps=args.reps, warmup=args.warmup)
    result = {"machine": harness.finish_record(machine), "median_s": {n: harness.stats(s)["median"] for n, s in samples.items()}}
    harness.write_json(args.out, result)

Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrim.errors import KVTrimError
from kvtrim.files import append, check_output, decode_text, parse_json, read_bytes, write_atomic

#: The prefix of the line a child of :func:`isolated` prints its result on.
CHILD_TAG = "@@kvtrim-harness "


# ----------------------------------------------------------------------------- command line


def options(*, reps: int | None = 3, warmup: int | None = 1, out_help: str = "write the JSON result here",
            warmup_help: str = "warm-up rounds, discarded", threads: int | None = None,
            several_tables: bool = False) -> argparse.ArgumentParser:
    """The standard options, as a parent parser: ``ArgumentParser(parents=[harness.options()])``.

    ``--out PATH`` (required unless ``--table``), ``--force`` (replace an existing ``--out``),
    ``--table FILE`` (render a committed result as the markdown table, run nothing; with
    ``several_tables``, ``--table FILE [FILE ...]``: one table of several results, e.g. one per
    model); ``--reps`` and ``--warmup`` with the script's defaults (``None`` leaves the option out,
    for a script that has no repetitions); ``--threads`` (torch threads, set by :func:`start`) when
    ``threads`` is given.
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("harness")
    g.add_argument("--out", metavar="PATH", help=f"{out_help} (required unless --table; an existing file is refused unless --force)")
    g.add_argument("--force", action="store_true", help="replace an existing --out")
    if several_tables:
        g.add_argument("--table", metavar="FILE", nargs="+",
                       help="print the markdown table of result files (e.g. committed ones) and exit; runs nothing")
    else:
        g.add_argument("--table", metavar="FILE",
                       help="print the markdown table of a result file (e.g. a committed one) and exit; runs nothing")
    if reps is not None:
        g.add_argument("--reps", type=int, default=reps, help=f"measured repetitions (default {reps})")
    if warmup is not None:
        g.add_argument("--warmup", type=int, default=warmup, help=f"{warmup_help} (default {warmup})")
    if threads is not None:
        g.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    return p


def check_out(path: str | os.PathLike, *, force: bool = False, directory: bool = False) -> Path:
    """Validate an output path before the work starts; create its parent folder; return it.

    A file that exists is refused unless ``force`` (a result is never overwritten by accident), a
    symbolic link always (the result is written atomically, never through a link:
    :func:`kvtrim.files.check_output`); with ``directory=True`` the path is a folder of results (created; an existing one is reused,
    which is how resumable scripts continue).
    """
    p = Path(path)
    try:
        if directory:
            if p.exists() and not p.is_dir():
                raise KVTrimError(f"--out {p} exists and is not a directory; name a directory for the results")
            p.mkdir(parents=True, exist_ok=True)
            return p
        if p.is_dir() and not p.is_symlink():
            raise KVTrimError(f"--out {p} is a directory; name a file (e.g. {p / 'result.json'})")
        if p.exists() and not p.is_symlink() and not force:
            raise KVTrimError(f"--out {p} exists; name a new file, or pass --force to replace it")
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTrimError(f"--out {p}: cannot create it ({e.strerror or e})") from None
    if not os.access(p.parent, os.W_OK):
        raise KVTrimError(f"--out {p}: cannot write into {p.parent}")
    return check_output(p, "--out", force=force)


def read_result(path: str | os.PathLike) -> Any:
    """A result file: JSON lines (``*.jsonl``: a list of their objects) or a JSON document. Read
    through :func:`kvtrim.files.read_bytes` (a regular file within the results size limit); a
    file that is neither is one ``KVTrimError`` line naming it (and the line, for JSON lines)."""
    data = read_bytes(path, "result file", kind="results")
    if Path(path).suffix != ".jsonl":
        try:
            return parse_json(data, "result file", path)
        except KVTrimError:
            pass
    text = decode_text(data, "result file", path)
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise KVTrimError(f"result file {str(path)!r}, line {no}: not valid JSON ({e})") from None
    return rows


def start(parser: argparse.ArgumentParser, args: argparse.Namespace, *, table: Callable[[Any], str] | None = None,
          directory: bool = False) -> bool:
    """Handle the standard options before any work; True when the script should stop (table printed).

    ``--table FILE``: print ``table(read_result(FILE))`` and return True (``--table FILE ...`` of
    ``options(several_tables=True)``: ``table([read_result(FILE), ...])``). Otherwise ``--out`` is
    required and validated (:func:`check_out`); a bad ``--out`` ends the script with a usage error
    before anything is loaded or timed.
    """
    if getattr(args, "table", None):
        if table is None:
            parser.error("this script has no --table")
        if isinstance(args.table, list):
            print(table([read_result(p) for p in args.table]))
        else:
            print(table(read_result(args.table)))
        return True
    if not args.out:
        parser.error("--out is required (the result file to write; --table FILE renders an existing one)")
    try:
        args.out = str(check_out(args.out, force=getattr(args, "force", False), directory=directory))
    except KVTrimError as e:
        parser.error(str(e))
    for name, least in (("reps", 1), ("warmup", 0), ("threads", 1)):
        value = getattr(args, name, None)
        if isinstance(value, int) and value < least:
            parser.error(f"--{name} must be >= {least}, got {value}")
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    return False


# ----------------------------------------------------------------------------- timing


@dataclass
class Sample:
    """One measured call: the configuration, its repetition, the harness's wall seconds, its return value."""

    config: str
    rep: int
    seconds: float
    value: Any = None


def order(configs: Sequence[str], round_index: int, how: str = "alternate") -> list[str]:
    """The configurations in round ``round_index``: ``alternate`` (forward, then reversed, ...),
    ``rotate`` (each round starts one later) or ``fixed``."""
    names = list(configs)
    if how == "alternate":
        return names if round_index % 2 == 0 else names[::-1]
    if how == "rotate":
        k = round_index % len(names) if names else 0
        return names[k:] + names[:k]
    if how == "fixed":
        return names
    raise KVTrimError(f"order must be 'alternate', 'rotate' or 'fixed', got {how!r}")


def interleave(configs: Sequence[str], run: Callable[[str, int], Any], *, reps: int, warmup: int = 0,
               how: str = "alternate", on_sample: Callable[[Sample], None] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, list[Sample]]:
    """Warm-up rounds, then ``reps`` rounds, each calling ``run(config, rep)`` once per configuration.

    ``warmup`` rounds come first (``rep`` = -warmup .. -1) and are discarded; the measured rounds
    have ``rep`` = 0 .. reps-1. Within a round the configurations follow :func:`order` (by default
    the order alternates between rounds), so a machine that slows down during the run slows every
    configuration alike. ``run`` may return anything (its own finer timings, statistics); the
    harness times the whole call with ``clock``. ``on_sample`` sees every measured sample as it
    comes (progress, partial saves). Returns the measured samples per configuration.
    """
    if reps < 1 or warmup < 0:
        raise KVTrimError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    out: dict[str, list[Sample]] = {c: [] for c in configs}
    for r in range(-warmup, reps):
        for name in order(configs, r + warmup, how):
            t0 = clock()
            value = run(name, r)
            dt = clock() - t0
            if r < 0:
                continue
            s = Sample(name, r, dt, value)
            out[name].append(s)
            if on_sample is not None:
                on_sample(s)
    return out


def stats(values: Iterable[float] | Iterable[Sample], key: str | Callable[[Any], float] | None = None) -> dict:
    """``{"median", "min", "max", "n", "all"}`` of numbers, or of samples' ``seconds`` (or of
    ``key`` of their values: a dict key or a function of the value)."""
    xs: list[float] = []
    for v in values:
        if isinstance(v, Sample):
            if key is None:
                xs.append(v.seconds)
            elif callable(key):
                xs.append(float(key(v.value)))
            else:
                xs.append(float(v.value[key]))
        else:
            xs.append(float(v))
    if not xs:
        raise KVTrimError("no samples to summarise")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "all": xs}


def median(values: Iterable[float] | Iterable[Sample], key: str | Callable[[Any], float] | None = None) -> float:
    """The median of :func:`stats`."""
    return stats(values, key)["median"]


def per_call(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``fn``: one untimed call, then ``calls`` calls timed together (for calls
    too short to time one at a time; repetitions and their order are :func:`interleave`'s)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


# ----------------------------------------------------------------------------- machine record


def git_commit(path: str | os.PathLike) -> str | None:
    """The commit checked out where ``path`` lies (None outside a git checkout): which code a result
    came from, when two checkouts are compared."""
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_record() -> dict:
    """What the measurement runs on, at its start (:func:`kvtrim.machine.machine_info`: date,
    machine, versions, torch threads, ``loadavg_start``)."""
    from kvtrim.machine import machine_info

    return machine_info()


def finish_record(record: dict) -> dict:
    """Add the load average at the end (``loadavg_end``) to a :func:`machine_record`; returns it."""
    from kvtrim.machine import load_average

    record["loadavg_end"] = load_average()
    return record


def machine_line(record: dict, threads: int) -> str:
    """``torch V, N thread(s), CPU (matrix flags), load average A -> B`` for a table's first line,
    from a finished :func:`machine_record`."""
    flags = ", ".join(record.get("cpu_matrix_flags") or []) or "flags not recorded"
    return (f"torch {record['torch']}, {threads} thread(s), {record.get('cpu_model') or record['machine']} ({flags}), "
            f"load average {record['loadavg_start'][0]:.1f} -> {record['loadavg_end'][0]:.1f}")


# ----------------------------------------------------------------------------- output


def publish(path: str | os.PathLike, result: dict, record: dict, table: Callable[[Any], str] | None = None) -> None:
    """The end of a benchmark: ``result["machine"]`` = the finished :func:`machine_record` ``record``,
    ``result`` written to ``path`` (:func:`write_json`), and its table printed."""
    result["machine"] = finish_record(record)
    write_json(path, result)
    if table is not None:
        print(table(result))


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON, atomically (:func:`kvtrim.files.write_atomic`: a reader, or a run that
    dies while writing, sees the previous file or the new one, never a part)."""
    text = json.dumps(obj, indent=indent) if indent is not None else json.dumps(obj, separators=(",", ":"))
    write_atomic(path, text + "\n")


def append_jsonl(path: str | os.PathLike, obj: Any) -> None:
    """Append ``obj`` as one JSON line (:func:`kvtrim.files.append`: one write, never through a
    symbolic link; a resumable run loses at most the line being written)."""
    append(path, json.dumps(obj) + "\n")


# ----------------------------------------------------------------------------- isolated mode


def isolated(script: str | os.PathLike, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> Any:
    """Run ``python script *argv`` in a fresh process and return what it reported with :func:`child_result`.

    Use it when measurements would disturb each other inside one process (a 32k-token forward
    holds ~10 GB; the allocator state it leaves slows whatever runs next). The child's stderr
    passes through; a child that fails raises ``KVTrimError`` with its exit code.
    """
    cmd = [sys.executable, str(script), *map(str, argv)]
    res = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True, env=None if env is None else dict(env))
    if res.returncode != 0:
        raise KVTrimError(f"isolated run failed with exit code {res.returncode}: {' '.join(cmd)}")
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    raise KVTrimError(f"isolated run printed no result line: {' '.join(cmd)}")


def child_result(obj: Any) -> None:
    """In a child of :func:`isolated`: report ``obj`` (one tagged JSON line on stdout)."""
    sys.stdout.write(CHILD_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()
