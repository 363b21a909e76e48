"""Method registry: name -> policy class, imported lazily.

The CLI's choices, the docs' method table and the test matrix are all read from here, so a
method is listed, documented and tested the day it is registered.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtrim.errors import KVTrimError

if TYPE_CHECKING:
    from kvtrim.policies.base import Policy
    from kvtrim.spans import Span


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

#: the method that keeps every token (a cache given no method runs it)
NO_COMPRESSION = "full"
#: the method ``kvtrim.compress`` runs when given none (a one-shot question over a long prompt)
DEFAULT_METHOD = "snapkv"


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
register("expected_attention", "kvtrim.policies.expected_attention", "ExpectedAttention")
register("tova", "kvtrim.policies.tova", "TOVA")
register("kvzip", "kvtrim.policies.kvzip", "KVzip")


def method_names() -> list[str]:
    return list(_METHODS)


def methods() -> list[MethodInfo]:
    return list(_METHODS.values())


def get_policy_class(name: str) -> type[Policy]:
    if name not in _METHODS:
        raise KVTrimError(f"unknown method {name!r}; known methods: {', '.join(_METHODS)}")
    return _METHODS[name].load()


def split_method(spec: str) -> tuple[str, dict]:
    """A method with parameters, as ``kvtrim eval --methods`` takes it: ``"snapkv:layers=adaptive:kernel=5"``
    -> ``("snapkv", {"layers": "adaptive", "kernel": 5})`` (values read as integers, numbers, true/false,
    else strings); a plain name -> ``(name, {})``. The name is not checked here (``get_policy_class``)."""
    name, *parts = spec.split(":")
    params: dict = {}
    for part in parts:
        key, eq, raw = part.partition("=")
        if not eq or not key.strip() or not raw.strip():
            raise KVTrimError(f"method {spec!r}: parameters are written name:key=value[:key=value...]; got {part!r}")
        value: object = raw.strip()
        if raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        else:
            for convert in (int, float):
                try:
                    value = convert(raw)
                    break
                except ValueError:
                    pass
        params[key.strip()] = value
    return name.strip(), params


def create_policy(name: str, **kwargs) -> Policy:
    """Build a policy by name: ``create_policy("snapkv", keep=0.2)``."""
    cls = get_policy_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        import dataclasses

        allowed = [f.name for f in dataclasses.fields(cls)]
        raise KVTrimError(f"{name}: {e}; allowed parameters: {', '.join(allowed)}") from None


def spans_error(policy: Policy, spans: Iterable[Span] | None = None) -> str | None:
    """Why ``policy`` cannot run on a prompt whose modality spans are ``spans`` (None: a text prompt), or None.

    A method that acts only on tagged tokens (``Policy.needs_spans``: fastv, hae) would run as
    ``full`` on a prompt without its target modalities, a silent no-op; it is refused instead,
    unless it was given a budget of its own that acts on text too (hae's ``keep``/``max_tokens``:
    its decode eviction). The commands call this before the model loads, the cache at the prefill.
    """
    if not policy.needs_spans or policy.keep is not None or policy.max_tokens is not None:
        return None
    targets = tuple(getattr(policy, "targets", ("image", "video", "document")))
    if spans is not None and any(s.modality in targets for s in spans):
        return None
    budget = (" or a budget (--keep/--max-tokens; keep=/max_tokens= in Python) for its decode eviction on text"
              if policy.takes_budget else "")
    return (f"method {policy.name!r} prunes {'/'.join(targets)} tokens and this prompt has none, so it would run as "
            f"'full'. Give it images (kvtrim generate --image FILE with a vision-language --model), or in Python "
            f"tagged spans (KVTrimCache(model, policy, spans=[(start, end, 'document')]) with targets=('document',)){budget}")


def check_text_prompt(policy: Policy) -> Policy:
    """Refuse (``KVTrimError``) a policy that cannot run on a text-only prompt (:func:`spans_error`);
    returns it. The text-only commands call it before the model loads."""
    if problem := spans_error(policy):
        raise KVTrimError(problem)
    return policy
