"""The result store of ``kvtrim eval``: one JSON line per (sample, method, keep, prefill).

Layout of an output directory::

    DIR/config.json                  the model the sweep belongs to (a rerun with another model is refused)
    DIR/runs/{task}-{length}.jsonl   one JSON line per (sample, method, keep, prefill) -- see LINE_FIELDS
    DIR/summary.json                 aggregated cells (kvtrim.eval.report.summarize), rewritten after each run

A line is written with one ``os.write`` on an ``O_APPEND`` descriptor, so processes sharing a
directory never interleave lines. A corrupted line (cut short by an interruption, overwritten,
missing a field, a field of the wrong type) is reported with its ``file:line`` when the lines are
read back and never used; a resumed ``kvtrim eval`` moves it into ``<file>.corrupt`` and recomputes
its configuration, ``kvtrim report`` refuses to report from a directory holding one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from kvtrim.errors import KVTrimError
from kvtrim.files import append, probe_directory, read_bytes, read_json, write_atomic

logger = logging.getLogger(__name__)

#: the fields every result line has (task-specific extras follow them)
LINE_FIELDS = ("task", "length", "sample", "seed", "depth", "method", "keep", "prefill", "score", "correct", "answer",
               "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full", "kv_bytes_stored", "stored_tokens",
               "prefill_seconds", "record_seconds", "compress_seconds", "decode_seconds", "decode_steps")


def line_key(d: dict) -> tuple:
    """What identifies a result line: (task, length, sample, method, keep, prefill)."""
    keep = d.get("keep")
    return (d["task"], int(d["length"]), int(d["sample"]), d["method"], None if keep is None else round(float(keep), 6),
            d.get("prefill", "dense"))


def check_out_dir(out: str | os.PathLike, model_source: str | None = None, *, plain: bool = False,
                  dtype: str = "float32") -> Path:
    """Create ``out`` (and ``out/runs``), check it is writable and belongs to this model, weight dtype and
    prompt format (``plain``: ``--plain-prompt``; a directory holds one format and one dtype, its lines
    do not record them; ``config.json`` names a dtype other than float32)."""
    path = Path(out)
    try:
        (path / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTrimError(f"cannot write to the output directory {str(path)!r}: {e.strerror or e}") from None
    probe_directory(path / "runs", "the output directory")  # a unique file per process: shards start together
    cfg = path / "config.json"
    if model_source is not None:
        held_plain, held_dtype = False, "float32"
        if cfg.is_file():
            try:
                d = read_json(cfg, "eval config")
                held, held_plain = d.get("model"), bool(d.get("plain_prompt", False))
                held_dtype = str(d.get("dtype", "float32"))
            except (KVTrimError, AttributeError):
                held = None
            if held is not None and held != model_source:
                raise KVTrimError(
                    f"{str(path)!r} holds a sweep of model {held!r}, not {model_source!r}; use another --out directory"
                )
            if held is not None and held_plain != plain:
                raise KVTrimError(
                    f"{str(path)!r} holds a sweep {'with' if held_plain else 'without'} --plain-prompt; its prompts "
                    "differ, so use another --out directory (or " + ("add" if held_plain else "drop") + " --plain-prompt)"
                )
            if held is not None and held_dtype != dtype:
                raise KVTrimError(f"{str(path)!r} holds a sweep of the model in {held_dtype}, not {dtype}; use another "
                                  f"--out directory (or --dtype {held_dtype})")
        write_atomic(cfg, json.dumps({"model": model_source, "format": 1} | ({"plain_prompt": True} if plain else {})
                                     | ({"dtype": dtype} if dtype != "float32" else {}), indent=2) + "\n")
    return path


def runs_file(out: Path, task: str, length: int) -> Path:
    return out / "runs" / f"{task}-{length}.jsonl"


#: field -> the JSON types it must have on every result line (``float`` accepts integers too)
_REQUIRED = {"task": (str,), "length": (int,), "sample": (int,), "method": (str,), "score": (float,),
             "kv_bytes": (float,), "prefill_seconds": (float,)}
#: fields that, when present, must have these types
_OPTIONAL = {"keep": (float, type(None)), "prefill": (str,), "decode_seconds": (float, type(None)),
             "decode_steps": (int, type(None)), "nll_sum": (float,), "n_target": (int,)}


def _has_type(v, types: tuple) -> bool:
    if isinstance(v, bool):
        return False
    return any(isinstance(v, int) if t is int else isinstance(v, (int, float)) if t is float else isinstance(v, t)
               for t in types)


def line_problem(raw: bytes) -> tuple[dict | None, str | None]:
    """Parse one result line: ``(row, None)``, or ``(None, what is wrong)`` for a corrupted line."""
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "not valid JSON"
    if not isinstance(d, dict):
        return None, f"a JSON {type(d).__name__}, not an object"
    missing = [k for k in _REQUIRED if k not in d]
    if d.get("task") == "ppl":
        missing += [k for k in ("nll_sum", "n_target") if k not in d]
    if missing:
        return None, f"no {', '.join(missing)}"
    for k, types in (*_REQUIRED.items(), *_OPTIONAL.items()):
        if k in d and not _has_type(d[k], types):
            return None, f"{k} is {d[k]!r}"
    return d, None


def scan_lines(paths: Iterable[Path]) -> tuple[list[dict], list[tuple[Path, int, str, bytes]]]:
    """Every result line of ``paths``, and the corrupted ones as ``(file, line number, problem, raw bytes)``.

    A line is corrupted when it is not a JSON object with the fields a result line has (see
    :data:`LINE_FIELDS`; ``task``, ``length``, ``sample``, ``method``, ``score``, ``kv_bytes`` and
    ``prefill_seconds`` are required) of the right types. (A complete last line without its
    newline is a valid line; ``read_lines(repair=True)`` adds the newline.)"""
    rows: list[dict] = []
    bad: list[tuple[Path, int, str, bytes]] = []
    for p in paths:
        if not os.path.lexists(p):
            continue
        data = read_bytes(p, "result file", kind="results")  # a FIFO, a device or a directory is one line
        lines = data.split(b"\n")
        for no, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            row, problem = line_problem(raw)
            if problem is not None and no == len(lines):
                problem = f"the last line, cut short: {problem}"
            if problem is not None:
                bad.append((p, no, problem, raw))
            else:
                rows.append(row)  # type: ignore[arg-type]
    return rows, bad


def describe_bad(bad: list[tuple[Path, int, str, bytes]], limit: int = 3) -> str:
    """``a.jsonl:3 (not valid JSON), a.jsonl:9 (score is 'abc') and 4 more`` -- for one-line messages."""
    shown = ", ".join(f"{p}:{no} ({problem})" for p, no, problem, _ in bad[:limit])
    return shown + (f" and {len(bad) - limit} more" if len(bad) > limit else "")


def read_lines(paths: Iterable[Path], repair: bool = False) -> list[dict]:
    """Every valid result line of ``paths``; a corrupted line (see :func:`scan_lines`) is logged as a
    warning with its ``file:line`` and left out. With ``repair`` (one process owns the directory, as
    a resumed ``kvtrim eval`` does) each corrupted line is also moved out of its file into
    ``<file>.corrupt`` (``line N: <the bytes>``), so its configuration is recomputed and nothing is lost."""
    paths = list(paths)
    rows, bad = scan_lines(paths)
    for p, no, problem, _ in bad:
        logger.warning("%s:%d: corrupted result line (%s); %s", p, no, problem,
                       f"moved to {p}.corrupt, it will be recomputed" if repair else "left out")
    if repair and bad:
        for p in dict.fromkeys(b[0] for b in bad):
            _move_out(p, {no: raw for q, no, _, raw in bad if q == p})
    if repair:
        for p in paths:  # a complete line whose newline was not written: the next append must not glue onto it
            if p.is_file() and p.stat().st_size and not read_bytes(p, "result file", kind="results").endswith(b"\n"):
                append(p, b"\n")
    return rows


def _move_out(path: Path, bad: dict[int, bytes]) -> None:
    """Append the lines ``bad`` (line number -> bytes) of ``path`` to ``path.corrupt``, then rewrite
    ``path`` without them (atomically: :func:`kvtrim.files.write_atomic`)."""
    append(f"{path}.corrupt", b"".join(f"line {no}: ".encode() + raw + b"\n" for no, raw in bad.items()))
    keep = [raw for no, raw in enumerate(read_bytes(path, "result file", kind="results").split(b"\n"), 1)
            if no not in bad and raw.strip()]
    write_atomic(path, b"".join(raw + b"\n" for raw in keep))


def result_files(out: str | os.PathLike) -> list[Path]:
    return sorted((Path(out) / "runs").glob("*.jsonl"))


def append_line(path: Path, row: dict) -> None:
    """Append one result line (:func:`kvtrim.files.append`: one write on an ``O_APPEND`` descriptor)."""
    append(path, json.dumps(row) + "\n")


def machine() -> dict:
    """The machine record of ``summary.json`` and ``kvtrim bench`` results, with the keys the committed
    result files use (``kvtrim.machine.machine_info`` renamed: cpu, cores, threads, day date, loadavg now)."""
    from kvtrim.machine import load_average, machine_info

    info = machine_info()
    return {"python": info["python"], "torch": info["torch"], "transformers": info["transformers"],
            "kvtrim": info["kvtrim"], "cpu": info["processor"], "cores": info["cpus"], "threads": info["torch_threads"],
            "date": time.strftime("%Y-%m-%d"), "loadavg": load_average()}
