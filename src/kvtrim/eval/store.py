"""The result store of ``kvtrim eval``: one JSON line per (sample, method, keep, prefill).

Layout of an output directory::

    DIR/config.json                  the model the sweep belongs to (a rerun with another model is refused)
    DIR/runs/{task}-{length}.jsonl   one JSON line per (sample, method, keep, prefill) -- see LINE_FIELDS
    DIR/summary.json                 aggregated cells (kvtrim.eval.report.summarize), rewritten after each run

A line is written with one ``os.write`` on an ``O_APPEND`` descriptor, so processes sharing a
directory never interleave lines; a line cut short by an interruption is dropped (and, with
``repair``, cut from its file) when the lines are read back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from kvtrim.errors import KVTrimError

#: the fields every result line has (task-specific extras follow them)
LINE_FIELDS = ("task", "length", "sample", "seed", "depth", "method", "keep", "prefill", "score", "correct", "answer",
               "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full", "kv_bytes_stored", "stored_tokens",
               "prefill_seconds", "record_seconds", "compress_seconds", "decode_seconds", "decode_steps")


def line_key(d: dict) -> tuple:
    """What identifies a result line: (task, length, sample, method, keep, prefill)."""
    keep = d.get("keep")
    return (d["task"], int(d["length"]), int(d["sample"]), d["method"], None if keep is None else round(float(keep), 6),
            d.get("prefill", "dense"))


def check_out_dir(out: str | os.PathLike, model_source: str | None = None, *, plain: bool = False) -> Path:
    """Create ``out`` (and ``out/runs``), check it is writable and belongs to this model and prompt format
    (``plain``: ``--plain-prompt``; a directory holds one format, its lines do not record it)."""
    path = Path(out)
    try:
        (path / "runs").mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"  # per process: shards start together
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise KVTrimError(f"cannot write to the output directory {str(path)!r}: {e.strerror or e}") from None
    cfg = path / "config.json"
    if model_source is not None:
        held_plain = False
        if cfg.is_file():
            try:
                d = json.loads(cfg.read_text())
                held, held_plain = d.get("model"), bool(d.get("plain_prompt", False))
            except (OSError, json.JSONDecodeError, AttributeError):
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
        cfg.write_text(json.dumps({"model": model_source, "format": 1} | ({"plain_prompt": True} if plain else {}),
                                  indent=2) + "\n")
    return path


def runs_file(out: Path, task: str, length: int) -> Path:
    return out / "runs" / f"{task}-{length}.jsonl"


def read_lines(paths: Iterable[Path], repair: bool = False) -> list[dict]:
    """Every complete JSON line of ``paths``; with ``repair`` a cut-off last line is removed from its file."""
    rows: list[dict] = []
    for p in paths:
        if not p.is_file():
            continue
        data = p.read_bytes()
        if repair and data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(p, "r+b") as f:
                f.truncate(cut)
            data = data[:cut]
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
    return rows


def result_files(out: str | os.PathLike) -> list[Path]:
    return sorted((Path(out) / "runs").glob("*.jsonl"))


def append_line(path: Path, row: dict) -> None:
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def machine() -> dict:
    """The machine record of ``summary.json`` and ``kvtrim bench`` results, with the keys the committed
    result files use (``kvtrim.machine.machine_info`` renamed: cpu, cores, threads, day date, loadavg now)."""
    from kvtrim.machine import load_average, machine_info

    info = machine_info()
    return {"python": info["python"], "torch": info["torch"], "transformers": info["transformers"],
            "kvtrim": info["kvtrim"], "cpu": info["processor"], "cores": info["cpus"], "threads": info["torch_threads"],
            "date": time.strftime("%Y-%m-%d"), "loadavg": load_average()}
