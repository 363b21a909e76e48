"""Run a prompt's forward pass once and replay every method's prefill compression on it.

kvtrim compresses a layer's cache *after* that layer's attention, from its own query and key
(``KVTrimCache.after_attention``), so the prefill forward pass -- hidden states, logits -- does
not depend on the method. An evaluation that compares many (method, budget) configurations on
one prompt therefore runs the forward pass once with :class:`Recorder` (keeps everything and
records each layer's query, key, value and scaling) and builds each configuration's cache with
:func:`replay`: a fresh :class:`~kvtrim.cache.KVTrimCache` whose prefill hook runs on the recorded
tensors. The result is the cache (and the last-position logits) the plain path
(:func:`kvtrim.generation.generate_ids`) would have produced; ``tests/test_eval_runner.py`` checks
that token for token for every text method.

This does not hold for methods that prune hidden states during the forward pass (FastV's and
HAE's visual-token pruning, ``NOT_REPLAYABLE``): :func:`replayable` says which.

Per-prompt scores that several budgets of one method share (H2O's prefill column sums, Elastic
Cache's per-layer importance) can be computed once per prompt: :func:`make_policy` with a
``memo`` dict returns policies that store and reuse them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from kvtrim.cache import CompressedLayer, KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.policies.elastic import Elastic
from kvtrim.policies.h2o import H2O
from kvtrim.scores import causal_column_sums, group_reduce

#: methods whose prefill changes the forward pass itself (hidden-state pruning): no replay
NOT_REPLAYABLE = ("fastv", "hae")


def replayable(method: str) -> bool:
    return method not in NOT_REPLAYABLE


@dataclass
class Recorder(Policy):
    """Keeps every token and records each layer's prefill ``(query, key, value, scaling)``."""

    name = "recorder"
    description = "keeps everything; records the prefill q/k/v of every layer (evaluation replay)"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.record: dict[int, tuple] = {}

    def on_prefill(self, layer, query, key, scaling) -> None:
        self.record[layer.layer_idx] = (query.clone(), key.clone(), layer.values.clone(), scaling)


@dataclass
class SharedElastic(Elastic):
    """Elastic Cache whose per-layer prefill importance is shared through ``memo``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.memo: dict | None = None

    def layer_importance(self, layer, query, key, scaling):
        if self.memo is None or layer.phase != "prefill":
            return super().layer_importance(layer, query, key, scaling)
        if self.importance == "sum":  # the head mean of the column sums H2O also uses: computed once
            return _column_sums(self.memo, layer.layer_idx, query, key, scaling).mean(dim=(1, 2))
        k = ("elastic", layer.layer_idx, self.importance, self.ema_decay)
        if k not in self.memo:
            self.memo[k] = super().layer_importance(layer, query, key, scaling)
        return self.memo[k]


@dataclass
class SharedH2O(H2O):
    """H2O whose prefill column sums are shared through ``memo`` (same arithmetic as ``H2O._accumulate``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.memo: dict | None = None

    def _accumulate(self, layer, query, key, scaling) -> None:
        if self.memo is None or layer.phase != "prefill":
            return super()._accumulate(layer, query, key, scaling)
        k = ("h2o", layer.layer_idx)
        if k not in self.memo:
            self.memo[k] = group_reduce(_column_sums(self.memo, layer.layer_idx, query, key, scaling), "sum")
        layer.new_token_state("h2o_acc")[:, :, : layer.length] += self.memo[k]


def _column_sums(memo: dict, layer_idx: int, query, key, scaling) -> torch.Tensor:
    """Causal softmax column sums ``[B, Hkv, G, S]`` of a layer's prefill, computed once per ``memo``."""
    k = ("colsums", layer_idx)
    if k not in memo:
        memo[k] = causal_column_sums(query, key, scaling)
    return memo[k]


def make_policy(method: str, params: dict, memo: dict | None = None) -> Policy:
    """``create_policy(method, **params)``, sharing per-prompt scores through ``memo`` where possible."""
    from kvtrim.registry import create_policy

    if memo is not None and method in ("elastic", "h2o"):
        cls = SharedElastic if method == "elastic" else SharedH2O
        try:
            pol = cls(**params)
        except TypeError as e:
            raise KVTrimError(f"{method}: {e}") from None
        pol.memo = memo
        return pol
    return create_policy(method, **params)


@dataclass
class Recording:
    """A recorded prefill: per-layer tensors, the last-position logits and the forward time."""

    record: dict[int, tuple]
    logits: torch.Tensor  # [V] float32, last prompt position
    seconds: float
    n_tokens: int
    prefill_stats: dict | None = None
    cache: KVTrimCache | None = None  # the uncompressed cache itself, with ``keep_cache=True``


@torch.inference_mode()
def record_prefill(model, ids: list[int], prefill=None, keep_cache: bool = False) -> Recording:
    """One full prefill of ``ids`` with :class:`Recorder` (``prefill``: an optional sparse-prefill hook;
    ``keep_cache``: also return the full cache the forward filled)."""
    from kvtrim.decoding import forward
    from kvtrim.integrations.hf import attach

    rec = Recorder()
    cache = KVTrimCache(model, rec)
    if prefill is not None:
        prefill.reset_stats()
    from kvtrim.integrations.hf import ATTN_NAME

    # inside a caller's attach(model) already (e.g. benchmarks/repro_elastic.py): do not attach twice
    attached = getattr(model.config, "_attn_implementation", None) == ATTN_NAME
    ctx = contextlib.nullcontext() if attached and prefill is None else attach(model, prefill_attention=prefill)
    with ctx:
        t0 = time.perf_counter()
        logits = forward(model, cache, ids)
        seconds = time.perf_counter() - t0
    return Recording(rec.record, logits, seconds, len(ids), prefill.stats() if prefill is not None else None,
                     cache if keep_cache else None)


def replay(model, policy: Policy, recording: "Recording | dict") -> KVTrimCache:
    """A fresh cache for ``policy`` whose prefill hook ran on the recorded q/k/v of every layer
    (``recording``: a :class:`Recording` or its ``record`` dict)."""
    record = recording.record if isinstance(recording, Recording) else recording
    if not replayable(policy.name):
        raise KVTrimError(f"method {policy.name!r} prunes hidden states during the forward pass; it cannot be replayed")
    cache = KVTrimCache(model, policy)
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            q, k, v, scaling = record[i]
            layer.update(k.clone(), v.clone())
            if isinstance(layer, CompressedLayer):  # as live: sliding-window layers are not scored
                cache.after_attention(layer, q, k, scaling)
    return cache
