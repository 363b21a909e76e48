"""Method registry: name -> policy class, imported lazily.

The CLI's choices, the docs' method table and the test matrix are all read from here, so a
method is listed, documented and tested the day it is registered.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtrim.errors import KVTrimError

if TYPE_CHECKING:
    from kvtrim.policies.base import Policy


@dataclass(frozen=True)
class MethodInfo:
    name: str
    module: str
    cls: str

    def load(self):
        return getattr(importlib.import_module(self.module), self.cls)

    @property
    def description(self) -> str:
        return self.load().description


_METHODS: dict[str, MethodInfo] = {}


def register(name: str, module: str, cls: str) -> None:
    """Register a policy class by import path (imported only when used)."""
    _METHODS[name] = MethodInfo(name, module, cls)


register("full", "kvtrim.policies.full", "Full")
register("streaming_llm", "kvtrim.policies.streaming", "StreamingLLM")
register("h2o", "kvtrim.policies.h2o", "H2O")
register("snapkv", "kvtrim.policies.snapkv", "SnapKV")
register("fastv", "kvtrim.policies.fastv", "FastV")
register("hae", "kvtrim.policies.hae", "HAE")
register("inf_mllm", "kvtrim.policies.inf_mllm", "InfMLLM")
register("elastic", "kvtrim.policies.elastic", "Elastic")


def method_names() -> list[str]:
    return list(_METHODS)


def methods() -> list[MethodInfo]:
    return list(_METHODS.values())


def get_policy_class(name: str) -> type[Policy]:
    if name not in _METHODS:
        raise KVTrimError(f"unknown method {name!r}; known methods: {', '.join(_METHODS)}")
    return _METHODS[name].load()


def create_policy(name: str, **kwargs) -> Policy:
    """Build a policy by name: ``create_policy("snapkv", keep=0.2)``."""
    cls = get_policy_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        import dataclasses

        allowed = [f.name for f in dataclasses.fields(cls)]
        raise KVTrimError(f"{name}: {e}; allowed parameters: {', '.join(allowed)}") from None
