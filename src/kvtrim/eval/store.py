"""The result store of ``kvtrim eval``: one JSON line per (sample, method, keep, prefill).

Layout of an output directory::

    DIR/config.json                  what the sweep's results depend on besides each line's own key:
                                     the model, its weight digest and dtype, the prompt format, the
                                     sweep's seed, haystack and samples per cell (SWEEP_KEYS); a rerun
                                     that differs in any of them is refused, naming it
    DIR/runs/{task}-{length}.jsonl   one JSON line per (sample, method, keep, prefill) -- see LINE_FIELDS
    DIR/summary.json                 aggregated cells (kvtrim.eval.report.summarize), rewritten after each run

A line records everything that made it (:func:`line_key`): the task, length, sample index and the
sample's seed, the haystack, the samples per cell (which set each sample's depth), the weight
digest, the method, its budget and every other parameter of its policy, and the prefill. Lines
and directories written before these were recorded (``config.json`` format 1) are read as before;
resuming into one is refused, since nothing says what its lines were made with.

A line is written with one ``os.write`` on an ``O_APPEND`` descriptor, so processes sharing a
directory never interleave lines. A corrupted line (cut short by an interruption, overwritten,
missing a field, a field of the wrong type) is reported with its ``file:line`` when the lines are
read back and never used; a resumed ``kvtrim eval`` moves it into ``<file>.corrupt`` and recomputes
its configuration, ``kvtrim report`` refuses to report from a directory holding one.

Pooling directories (:func:`check_pool`, used by ``kvtrim report`` and ``kvtrim calibrate --extra``)
is refused where it would be silently wrong: one directory named twice, or two directories that
put lines into the same cell while they hold another model (name, weights, dtype) or another task
configuration (prompt format, seed, haystack, samples), or the same samples twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.files import append, probe_directory, read_bytes, read_json, write_atomic

logger = logging.getLogger(__name__)

#: the fields every result line has (task-specific extras follow them)
LINE_FIELDS = ("task", "length", "sample", "seed", "depth", "method", "keep", "prefill", "score", "correct", "answer",
               "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full", "kv_bytes_stored", "stored_tokens",
               "prefill_seconds", "record_seconds", "compress_seconds", "decode_seconds", "decode_steps")

#: config.json's format: 2 records SWEEP_KEYS (format 1, before them, named the model alone)
CONFIG_FORMAT = 2
#: what a directory's results depend on besides each line's own key, in config.json (format 2) and
#: on each line: the weight digest (:func:`kvtrim.session_file.weights_digest`), the sweep's seed,
#: the haystack (its resolved name) and the samples per cell (they set each sample's depth)
SWEEP_KEYS = ("weights", "sweep_seed", "haystack", "samples")
#: what a flag of ``kvtrim eval`` sets each of them with (in refusals)
_FLAGS = {"sweep_seed": "--seed", "haystack": "--haystack", "samples": "--samples", "plain_prompt": "--plain-prompt",
          "dtype": "--dtype"}


def _keep(v) -> float | None:
    return None if v is None else round(float(v), 6)


def line_key(d: dict) -> tuple:
    """What identifies a result line: (task, length, sample, the sample's seed, haystack, samples,
    weight digest, method, keep, prefill, the policy's parameters as sorted JSON), then the KV bit
    width where it is not 16 (:func:`line_bits`): a 16-bit line's key is the one it had before bit
    widths were recorded, so sweeps made then resume unchanged. A line written before the later
    fields were recorded has None in their places."""
    params = d.get("params")
    key = (d["task"], int(d["length"]), int(d["sample"]), d.get("seed"), d.get("haystack"), d.get("samples"),
           d.get("weights"), d["method"], _keep(d.get("keep")), d.get("prefill", "dense"),
           None if params is None else json.dumps(params, sort_keys=True))
    bits = line_bits(d)
    return key if bits == 16 else (*key, bits)


def line_bits(d: dict) -> int:
    """The bits per stored key and value element a line's cache held (``kv_bits``; 16, the model's
    dtype, for a line written before sweeps had bit widths)."""
    return int(d.get("kv_bits", 16))


def config_params(method: str, keep: float | None) -> dict:
    """Every parameter of a sweep configuration's policy, JSON-ready (``Policy.describe`` without the
    name): what a line records as ``params``, so a change of a method's defaults is never mistaken
    for the same configuration."""
    from kvtrim.registry import create_policy, split_method

    name, params = split_method(method)
    d = create_policy(name, **params, **({} if keep is None else {"keep": keep})).describe()
    d.pop("method", None)
    return json.loads(json.dumps(d))


def haystack_name(haystack: str | None) -> str:
    """The haystack a sweep's needles go into, as a line records it: the resolved name (``prose`` is
    the essays when installed, else the pydoc topics), or ``custom:<digest>`` for a given text."""
    from kvtrim.eval.common import haystack_text

    text, name = haystack_text(haystack)
    return f"custom:{hashlib.sha256(text.encode()).hexdigest()[:16]}" if name == "custom" else name


class SweepMismatch(KVTrimError):
    """An output directory that holds another sweep (another model, weights, dtype, prompt format,
    seed, haystack or samples per cell, a damaged ``config.json``, or lines that predate the keys):
    resuming into it would mix results. ``reason`` is the difference alone (the message adds what to do)."""

    def __init__(self, reason: str, advice: str):
        super().__init__(f"{reason}; {advice}")
        self.reason = reason


def _read_config(path: Path) -> dict | None:
    """The directory's config.json (None when there is none); a damaged one is refused: nothing else
    says which model and settings the directory's lines belong to."""
    cfg = path / "config.json"
    if not os.path.lexists(cfg):
        return None
    try:
        d = read_json(cfg, "eval config")
    except KVTrimError as e:
        raise SweepMismatch(f"{e}", f"it says which model and settings the results in {str(path)!r} belong to: "
                                    "restore it, or use another directory") from None
    if not isinstance(d, dict) or not isinstance(d.get("model"), str):
        raise SweepMismatch(f"eval config {str(cfg)!r} is damaged (not an object naming the model)",
                            f"it says which model and settings the results in {str(path)!r} belong to: restore it, "
                            "or use another directory")
    return d


def check_out_dir(out: str | os.PathLike, model_source: str | None = None, *, plain: bool = False,
                  dtype: str = "float32", sweep: dict | None = None, force: bool = False) -> Path:
    """Create ``out`` (and ``out/runs``), check it is writable and belongs to this model, weight dtype and
    prompt format (``plain``: ``--plain-prompt``; a directory holds one format and one dtype;
    ``config.json`` names a dtype other than float32), and, with ``sweep`` (:data:`SWEEP_KEYS` ->
    value), to this weight digest, seed, haystack and samples per cell. A difference is one
    :class:`SweepMismatch` line naming it; so is a damaged ``config.json``, and resuming into a
    directory whose config predates :data:`SWEEP_KEYS` while it holds result lines.

    With ``force`` such a directory is left as it is and the sweep goes to a new one beside it: the
    first of ``OUT-2``, ``OUT-3``, ... that does not exist or holds this very sweep (so a rerun with
    ``force``, or the other shards of the run, resume there), said in one warning line. Returns the
    directory the results go to."""
    path = Path(out)
    try:
        return _check_one_dir(path, model_source, plain, dtype, sweep)
    except SweepMismatch as e:
        if not force:
            raise
        reason = e.reason
    base = path if path.name else Path(os.path.abspath(path))
    n = 2
    while True:
        new = base.with_name(f"{base.name}-{n}")
        n += 1
        if os.path.lexists(new) and (os.path.islink(new) or not new.is_dir()):
            continue  # a file or a link there: never written into
        resumed = (new / "config.json").exists()
        try:
            _check_one_dir(new, model_source, plain, dtype, sweep)
        except SweepMismatch:
            continue  # another sweep again (an earlier --force run with other settings)
        logger.warning("%s; --force: %s the new directory %r instead (%r is left as it is)", reason,
                       "resuming in" if resumed else "writing to", str(new), str(path))
        return new


def _check_one_dir(path: Path, model_source: str | None, plain: bool, dtype: str, sweep: dict | None) -> Path:
    try:
        (path / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTrimError(f"cannot write to the output directory {str(path)!r}: {e.strerror or e}") from None
    probe_directory(path / "runs", "the output directory")  # a unique file per process: shards start together
    held = _read_config(path)
    if model_source is None:
        return path
    if held is not None:
        if held["model"] != model_source:
            raise SweepMismatch(f"{str(path)!r} holds a sweep of model {held['model']!r}, not {model_source!r}",
                                "use another --out directory")
        held_plain = bool(held.get("plain_prompt", False))
        if held_plain != plain:
            raise SweepMismatch(
                f"{str(path)!r} holds a sweep {'with' if held_plain else 'without'} --plain-prompt",
                "its prompts differ, so use another --out directory (or " + ("add" if held_plain else "drop")
                + " --plain-prompt)")
        held_dtype = str(held.get("dtype", "float32"))
        if held_dtype != dtype:
            raise SweepMismatch(f"{str(path)!r} holds a sweep of the model in {held_dtype}, not {dtype}",
                                f"use another --out directory (or --dtype {held_dtype})")
        if sweep is not None:
            _check_sweep(path, held, sweep)
    config = ({"model": model_source, "format": 1 if sweep is None else CONFIG_FORMAT}
              | ({"plain_prompt": True} if plain else {}) | ({"dtype": dtype} if dtype != "float32" else {})
              | (sweep or {}))
    if held is None or (sweep is not None and held != config):  # new, or a format 1 directory without lines
        write_atomic(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path


def _check_sweep(path: Path, held: dict, sweep: dict) -> None:
    if held.get("format", 1) < CONFIG_FORMAT:
        if result_files(path) and any(p.stat().st_size for p in result_files(path)):
            raise SweepMismatch(
                f"{str(path)!r} was written by an earlier kvtrim (config.json format {held.get('format', 1)}): its "
                "result lines do not record the weight digest, seed, haystack, samples or method parameters",
                "so a resume cannot tell whether they match this run; use another --out directory (kvtrim report "
                "reads this one as before)")
        return
    for key, now in sweep.items():
        if held.get(key) != now:
            if key == "weights":
                raise SweepMismatch(f"{str(path)!r} holds a sweep of other weights of {held['model']!r} (weight digest "
                                    f"{str(held.get(key))[:12]}, this model {str(now)[:12]}: another checkpoint, "
                                    "fine-tune or quantization)", "use another --out directory")
            flag = _FLAGS.get(key, key)
            raise SweepMismatch(f"{str(path)!r} holds a sweep with {flag} {held.get(key)!r}; this run has {flag} {now!r}",
                                f"resuming would mix results of both, so use another --out directory (or {flag} "
                                f"{held.get(key)})")


def dir_identity(path: str | os.PathLike) -> dict:
    """What the lines of an eval directory were made with, from its ``config.json``: the model,
    dtype and prompt format, and (format 2) :data:`SWEEP_KEYS`; ``{}`` for a directory without one
    (an anchor's lines)."""
    held = _read_config(Path(path))
    if held is None:
        return {}
    return ({"model": held["model"], "dtype": str(held.get("dtype", "float32")),
             "plain_prompt": bool(held.get("plain_prompt", False))} | {k: held[k] for k in SWEEP_KEYS if k in held})


def describe_identity(ident: dict) -> str:
    """``model X, float32, seed 0, haystack essays, 20 samples`` (what is known of it)."""
    if not ident:
        return "no config.json"
    parts = [f"model {ident['model']}", ident["dtype"]] + (["plain prompts"] if ident["plain_prompt"] else [])
    parts += [f"weights {ident['weights'][:12]}"] if "weights" in ident else []
    parts += [f"seed {ident['sweep_seed']}"] if "sweep_seed" in ident else []
    parts += [f"haystack {ident['haystack']}"] if "haystack" in ident else []
    parts += [f"{ident['samples']} samples per cell"] if "samples" in ident else []
    return ", ".join(parts)


_MODEL_KEYS = ("model", "weights", "dtype")
_TASK_KEYS = ("plain_prompt", "sweep_seed", "haystack", "samples")


def check_pool(dirs: Sequence[str | os.PathLike], rows: list[list[dict]], *, allow: bool = False) -> list[str]:
    """Refuse pooling the result lines ``rows`` (one list per directory of ``dirs``) where it would be
    silently wrong (see the module docstring); with ``allow`` each such case is a warning instead.
    Returns one description per directory (what is pooled: its identity and line count)."""
    problems: list[str] = []
    real = [os.path.realpath(d) for d in dirs]
    for j, rj in enumerate(real):
        if rj in real[:j]:
            i = real.index(rj)
            problems.append(f"{str(dirs[i])!r} and {str(dirs[j])!r} are the same directory: its lines would count twice; "
                            "name it once")
    idents = [dir_identity(d) for d in dirs]
    cells = [{(r["task"], int(r["length"]), r["method"], _keep(r.get("keep")), r.get("prefill", "dense"), line_bits(r)): r
              for r in rs} for rs in rows]
    for j in range(len(dirs)):
        for i in range(j):
            if real[i] == real[j]:
                continue
            shared = cells[i].keys() & cells[j].keys()
            if not shared:
                continue
            task, length, method, keep, _, _ = min(shared, key=str)
            where = f"{task} at {length} tokens, {method}" + ("" if keep is None else f" @{keep:g}")
            diff = [k for k in (*_MODEL_KEYS, *_TASK_KEYS) if k in idents[i] and k in idents[j]
                    and idents[i][k] != idents[j][k]]
            if diff:
                k = diff[0]
                kind = "different models" if k in _MODEL_KEYS else "different task configurations"
                problems.append(f"{str(dirs[i])!r} and {str(dirs[j])!r} both hold results for {where} but of {kind} "
                                f"({k} {idents[i][k]!r} vs {idents[j][k]!r}): pooling would mix both in one cell; "
                                "report them separately")
                continue
            keys_i = {line_key(r) for r in rows[i]}
            twice = [r for r in rows[j] if line_key(r) in keys_i]
            if twice:
                r = twice[0]
                problems.append(f"{str(dirs[i])!r} and {str(dirs[j])!r} hold the same samples ({len(twice)} lines, e.g. "
                                f"{r['task']} at {r['length']} tokens, sample {r['sample']}, {r['method']}): pooling "
                                "would count each twice; report one of them")
    if problems and not allow:
        raise KVTrimError(f"{problems[0]} (or pass --pool to pool anyway)"
                          + (f"; {len(problems) - 1} more such problem(s)" if len(problems) > 1 else ""))
    for problem in problems:
        logger.warning("pooled as asked (--pool): %s", problem)
    return [f"{d} ({describe_identity(ident)}; {len(rs)} lines)" for d, ident, rs in zip(dirs, idents, rows)]


def runs_file(out: Path, task: str, length: int) -> Path:
    return out / "runs" / f"{task}-{length}.jsonl"


#: field -> the JSON types it must have on every result line (``float`` accepts integers too)
_REQUIRED = {"task": (str,), "length": (int,), "sample": (int,), "method": (str,), "score": (float,),
             "kv_bytes": (float,), "prefill_seconds": (float,)}
#: fields that, when present, must have these types
_OPTIONAL = {"keep": (float, type(None)), "prefill": (str,), "decode_seconds": (float, type(None)),
             "decode_steps": (int, type(None)), "nll_sum": (float,), "n_target": (int,),
             "ref_nll_sum": (float, type(None)), "ref_tokens": (int, type(None)), "decode_rows": (float, type(None)),
             "kv_bytes_full": (float, type(None)), "kv_bits": (int,)}
#: numeric fields that cannot be negative (a count, a time, a size); ``n_target`` of a ppl line is >= 1
_NON_NEGATIVE = ("length", "sample", "kv_bytes", "prefill_seconds", "decode_seconds", "decode_steps", "nll_sum",
                 "n_target", "ref_nll_sum", "ref_tokens", "kv_bytes_full")


def _has_type(v, types: tuple) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, float) and not math.isfinite(v):  # NaN and infinities parse as JSON numbers
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
    for k in _NON_NEGATIVE:
        if isinstance(d.get(k), (int, float)) and d[k] < 0:
            return None, f"{k} is {d[k]!r}"
    if "kv_bits" in d and d["kv_bits"] not in validate.KV_BITS:
        return None, f"kv_bits is {d['kv_bits']!r}"
    if d.get("task") == "ppl" and d["n_target"] < 1:
        return None, f"n_target is {d['n_target']!r}"
    if d.get("decode_steps") and d.get("decode_seconds") is None:
        return None, f"decode_steps is {d['decode_steps']!r} without decode_seconds"
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
