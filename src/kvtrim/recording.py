"""Run a prompt's forward pass once and replay any method's prefill compression on it.

kvtrim compresses a layer's cache *after* that layer's attention, from its own query and key
(``KVTrimCache.after_attention``), so the prefill forward pass -- hidden states, logits -- does
not depend on the method. An evaluation that compares many (method, budget) configurations on
one prompt therefore runs the forward pass once with :class:`Recorder` (keeps everything and
records each layer's query, key, value and scaling) and builds each configuration's cache with
:func:`replay`: a fresh :class:`~kvtrim.cache.KVTrimCache` whose prefill hook runs on the recorded
tensors. The result is the cache (and the last-position logits) the plain path
(:func:`kvtrim.generation.generate_ids`) would have produced; ``tests/test_eval_runner.py`` checks
that token for token for every text method.

``kvtrim eval`` replays every configuration of a sample this way; ``generate_ids`` replays a
method that scores the prompt by reconstructing it (``kvzip``: :mod:`kvtrim.reconstruction`).
This does not hold for methods that change the forward pass itself (``Policy.rewrites_forward``:
FastV's and HAE's hidden-state pruning): :func:`replayable` says which.

Per-prompt scores that several budgets of one method share (``Policy.shares_prefill_scores``:
H2O's prefill column sums, Elastic Cache's per-layer importance) can be computed once per prompt:
:func:`kvtrim.eval.replay.make_policy` with a ``memo`` dict hands it to them (``Policy.share_prefill_scores``). With
``record_prefill(..., column_sums=True)`` the recorded forward's own attention computes the column
sums as it runs (fused scoring, ``kvtrim.attach``), and :meth:`Recording.score_memo` seeds the memo
with them, so no replay recomputes them from the recorded queries and keys.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from kvtrim.cache import KVTrimCache
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest
from kvtrim.storage import CompressedLayer


def replayable(method: "str | Policy | type[Policy]") -> bool:
    """True when the method's prefill forward does not depend on it (``Policy.rewrites_forward``)."""
    from kvtrim.registry import get_policy_class, split_method

    cls = get_policy_class(split_method(method)[0]) if isinstance(method, str) else method
    return not cls.rewrites_forward


@dataclass
class Recorder(Policy):
    """Keeps every token and records each layer's prefill ``(query, key, value, scaling)``; with
    ``column_sums``, also the causal column sums the prefill attention computed (where kvtrim's
    attention function fused them; a layer whose attention did not is absent from ``column_sums``)."""

    name = "recorder"
    description = "keeps everything; records the prefill q/k/v of every layer (evaluation replay)"
    column_sums: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.record: dict[int, tuple] = {}
        self.sums: dict[int, torch.Tensor] = {}

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        return ScoreRequest(column_sums=True) if self.column_sums else None

    def on_prefill(self, layer, query, key, scaling) -> None:
        self.record[layer.layer_idx] = (query.clone(), key.clone(), layer.values.clone(), scaling)
        got = layer.attention_scores
        if self.column_sums and got is not None and got.column_sums is not None:
            self.sums[layer.layer_idx] = got.column_sums.clone()


@dataclass
class Recording:
    """A recorded prefill: per-layer tensors, the last-position logits and the forward time."""

    record: dict[int, tuple]
    logits: torch.Tensor  # [V] float32, last prompt position
    seconds: float
    n_tokens: int
    prefill_stats: dict | None = None
    cache: KVTrimCache | None = None  # the uncompressed cache itself, with ``keep_cache=True``
    column_sums: dict[int, torch.Tensor] | None = None  # per layer, with ``column_sums=True`` (fused)

    def score_memo(self) -> dict:
        """A fresh per-prompt memo for :func:`kvtrim.eval.replay.make_policy`, holding the column sums the recorded
        forward computed (the entries ``Policy.prefill_column_sums`` would otherwise compute)."""
        return {("column_sums", i): sums for i, sums in (self.column_sums or {}).items()}


@torch.inference_mode()
def record_prefill(model, ids: list[int], prefill=None, keep_cache: bool = False,
                   column_sums: bool = False) -> Recording:
    """One full prefill of ``ids`` with :class:`Recorder` (``prefill``: an optional sparse-prefill hook;
    ``keep_cache``: also return the full cache the forward filled; ``column_sums``: let the forward's
    attention compute each layer's causal column sums too, for :meth:`Recording.score_memo`)."""
    from kvtrim.decoding import forward
    from kvtrim.integrations.hf import attach

    rec = Recorder(column_sums=column_sums)
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
                     cache if keep_cache else None, rec.sums if column_sums else None)


def replay(model, policy: Policy, recording: "Recording | dict", *, block_size: int | None = None,
           kv_bits: int = 16) -> KVTrimCache:
    """A fresh cache for ``policy`` whose prefill hook ran on the recorded q/k/v of every layer
    (``recording``: a :class:`Recording` or its ``record`` dict; ``block_size`` and ``kv_bits``: the
    cache's, see :class:`~kvtrim.cache.KVTrimCache`). A low-bit cache (``kv_bits`` < 16) takes the
    recorded prompt into its full-precision residual, so the policy decides on the prompt in full
    precision and the kept tokens are quantized after the decision, as in a live prefill."""
    record = recording.record if isinstance(recording, Recording) else recording
    if not replayable(policy):
        raise KVTrimError(f"method {policy.name!r} prunes hidden states during the forward pass; it cannot be replayed")
    cache = KVTrimCache(model, policy, block_size=block_size, kv_bits=kv_bits)
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            q, k, v, scaling = record[i]
            layer.update(k.clone(), v.clone())
            if isinstance(layer, CompressedLayer):  # as live: sliding-window layers are not scored
                cache.after_attention(layer, q, k, scaling)
    return cache
