"""kvtrim: KV-cache compression for long-context inference of Hugging Face models.

Importing kvtrim changes nothing: integration happens through explicit, reversible calls::

    import kvtrim
    with kvtrim.compress(model, "snapkv", keep=0.2) as cache:
        out = model.generate(**inputs, **cache.kwargs(), max_new_tokens=64)

The heavy modules (transformers integration, models) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrim.errors import KVTrimError
from kvtrim.registry import create_policy, method_names, methods

__version__ = "0.1.0"

__all__ = [
    "KVTrimCache",
    "KVTrimError",
    "attach",
    "compress",
    "create_policy",
    "generate_batch",
    "generate_ids",
    "load_model",
    "method_names",
    "methods",
]

_LAZY = {
    "KVTrimCache": ("kvtrim.cache", "KVTrimCache"),
    "attach": ("kvtrim.integrations.hf", "attach"),
    "compress": ("kvtrim.integrations.hf", "compress"),
    "generate_batch": ("kvtrim.generation", "generate_batch"),
    "generate_ids": ("kvtrim.generation", "generate_ids"),
    "load_model": ("kvtrim.models", "load_model"),
}

if TYPE_CHECKING:  # pragma: no cover
    from kvtrim.cache import KVTrimCache
    from kvtrim.generation import generate_batch, generate_ids
    from kvtrim.integrations.hf import attach, compress
    from kvtrim.models import load_model


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'kvtrim' has no attribute {name!r}")
