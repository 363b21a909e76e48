"""Per-layer budgets for score-based methods: the same total memory, shared unevenly by the layers.

A method that mixes in :class:`LayerBudgets` and declares a ``layers`` field ("uniform" by default)
can hold a different number of tokens in each layer (per KV head; the heads of a layer keep the same
number, so the storage stays rectangular and the memory is really freed). The layers' budgets sum to
what ``uniform`` holds, ``n_layers * budget(seen)`` (the user's budget), give or take the tokens a
layer keeps by rule (sinks and window) or cannot evict (it stores fewer):

* ``uniform``: every layer keeps ``budget(seen)``, what every method does.
* ``pyramid`` (PyramidKV, Cai et al., 2024): the budget falls linearly with depth, from
  ``1 + PYRAMID_SLOPE`` times the uniform one in the first compressed layer to ``1 - PYRAMID_SLOPE``
  times it in the last, rounded so the layers sum to the total; a layer that would fall below the
  tokens its method always keeps (``min_tokens``) keeps those, and the others share the rest.
  Decided in each layer's own hook.
* ``adaptive`` (the idea of AdaKV, Feng et al., 2024, applied across layers instead of heads): each
  layer keeps ``LAYER_FLOOR`` of the uniform budget by its own ranking; the rest of the total goes to
  the layers whose next tokens hold the largest share of their heads' score. A token's share is its
  score over the sum of its head's scores (for attention-like scores: the share of that head's
  attention it holds, comparable across layers); the ``t``-th next token of a layer is worth the
  head mean of its heads' ``t``-th largest share, which does not grow with ``t``, so taking the best
  of all layers' next tokens one by one (what the top-k over the pooled values does) maximises the
  total share kept. The scores of every layer are needed, so each layer's hook records its scores
  and the hook of the last compressed layer decides for all (``Keep(idx, layer=j)``): until the
  prompt's forward reaches the last layer the earlier layers hold the whole prompt (the prefill's
  peak is the uncompressed cache, where ``uniform`` and ``pyramid`` compress each layer as soon as
  its attention ran).

Engines: a storage with independent layers (transformers, ``kvtrim.storage``) holds the uneven
lengths; a paged engine whose layers share one block table (vLLM) cannot, so a policy with
``layers != "uniform"`` reports ``uniform_layers = False`` and the vLLM plugin refuses it. The
integer rule ``eviction_target`` stays the uniform one (what the layers sum to); a layer's own count
is decided in its hooks.
"""

from __future__ import annotations

import math

import torch

from kvtrim import validate
from kvtrim.decisions import Decisions, Keep, LayerView
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy

LAYER_MODES = ("uniform", "pyramid", "adaptive")
#: pyramid: the first compressed layer keeps 1.5x the uniform budget, the last 0.5x (PyramidKV's
#: shape; the paper's own schedule is arithmetic with a tuned top/bottom ratio)
PYRAMID_SLOPE = 0.5
#: adaptive: the share of the uniform budget every layer keeps whatever the others' scores (AdaKV's
#: "safeguard": a layer whose scores are flat would otherwise be left with its sinks and window only)
LAYER_FLOOR = 0.5
#: the per-layer state that holds a layer's scores until the last layer decides (adaptive)
PENDING = "layer_budgets_pending"


def spread(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` as integers that sum to it exactly (largest
    remainders; ties go to the earlier entry)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def spread_at_least(total: int, weights: list[float], least: int) -> list[int]:
    """:func:`spread`, with every share at least ``least``: the shares that would fall below it get it,
    and the rest of ``total`` is spread over the others by their weights (the sum stays ``total``
    unless ``least`` times the count exceeds it)."""
    fixed: set[int] = set()
    while True:
        rest = [i for i in range(len(weights)) if i not in fixed]
        left = total - least * len(fixed)
        shares = spread(left, [weights[i] for i in rest]) if rest and left > 0 else [0] * len(rest)
        low = {i for i, v in zip(rest, shares) if v < least}
        if not low:
            out = dict(zip(rest, shares)) | {i: least for i in fixed}
            return [out[i] for i in range(len(weights))]
        fixed |= low


def compressed_layers(layer: LayerView) -> list[int]:
    """Indices of the compressed layers of ``layer``'s sequence (sliding-window layers are not)."""
    if layer.n_layers <= 0:
        raise KVTrimError("per-layer budgets need an engine that shows the policy every layer of a sequence; "
                          "this one does not (use layers='uniform')")
    return [j for j in range(layer.n_layers) if j == layer.layer_idx or layer.other(j) is not None]


def adaptive_counts(scores: list[torch.Tensor], protected: list[torch.Tensor | None], floors: list[int],
                    total: int) -> list[int]:
    """Tokens per layer for ``adaptive``: each layer's floor, then the free ``total - sum(floors)``
    given to the best next tokens of all layers (module docstring).

    ``scores[j]`` ``[B, H, S_j]`` (non-negative), ``protected[j]`` boolean like it (or None),
    ``floors[j]`` at least the protected tokens of every head and at most ``S_j``."""
    free = total - sum(floors)
    if free <= 0:
        return list(floors)
    values, owner = [], []
    for j, (s, p, f) in enumerate(zip(scores, protected, floors)):
        s = s.float().clamp_min(0)
        share = s / s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if p is not None:
            share = share.masked_fill(p, float("inf"))
        ranked = torch.sort(share, dim=-1, descending=True).values  # [B, H, S]: protected first
        v = ranked[..., f:].mean(dim=(0, 1))  # the t-th token after the floor: finite (floor >= protected)
        values.append(v)
        owner.append(torch.full(v.shape, j, dtype=torch.long))
    pooled = torch.cat(values)
    take = torch.topk(pooled, min(free, pooled.numel()), sorted=False).indices
    extra = torch.bincount(torch.cat(owner)[take], minlength=len(scores)).tolist()
    return [f + e for f, e in zip(floors, extra)]


class LayerBudgets(Policy):
    """Mixin for a score-based :class:`Policy` whose dataclass declares ``layers`` (one of
    ``LAYER_MODES``, "uniform" by default): its prompt hooks keep per-layer budgets (module docstring)."""

    layers: str

    def check_layers(self) -> None:
        """Validate ``layers`` (call from ``__post_init__``)."""
        validate.choice(self.layers, f"{self.name}: layers", LAYER_MODES)

    @property
    def uniform_layers(self) -> bool:
        return self.layers == "uniform"

    def wants_scores(self, layer: LayerView) -> bool:
        """True when this prompt hook scores the layer (it may evict, or the last layer may decide to)."""
        if self.uniform_layers:
            return self.kept_target(layer) is not None
        return layer.phase != "decode" and self.budget(layer.seen) < layer.seen

    def on_prefill(self, layer, query, key, scaling) -> Decisions:
        if self.layers == "pyramid":
            return self.pyramid_keep(layer, query, key, scaling)
        if self.layers == "adaptive":
            return self.adaptive_keep(layer, query, key, scaling)
        return self.evict_by_score(layer, query, key, scaling)

    def pyramid_budget(self, layer: LayerView) -> int:
        """This layer's share of ``n_layers * budget(seen)`` under ``pyramid`` (at least ``min_tokens``)."""
        order = compressed_layers(layer)
        n, rank = len(order), order.index(layer.layer_idx)
        weights = [1.0 + PYRAMID_SLOPE * (1 - 2 * r / (n - 1)) if n > 1 else 1.0 for r in range(n)]
        return spread_at_least(n * self.budget(layer.seen), weights, self.min_tokens)[rank]

    def pyramid_keep(self, layer, query, key, scaling) -> Decisions:
        if not self.wants_scores(layer):
            return None
        budget = layer.round_budget(self.pyramid_budget(layer))
        if budget >= layer.length:
            return None
        scores = self.shared(self.score(layer, query, key, scaling), layer)
        return Keep(self.select(scores, self.protected(layer, budget), budget))

    def adaptive_keep(self, layer, query, key, scaling) -> Decisions:
        if not self.wants_scores(layer):
            layer.state.pop(PENDING, None)
            return None
        budget = self.budget(layer.seen)
        own = self.score(layer, query, key, scaling).float()  # first: a method's protected() may read what it noted
        layer.state[PENDING] = (own, self.protected(layer, budget))
        order = compressed_layers(layer)
        if layer.layer_idx != order[-1]:
            return None  # the last compressed layer decides for all
        views: list[LayerView] = []
        for j in order:
            v = layer if j == layer.layer_idx else layer.other(j)
            if v is None or PENDING not in v.state:
                raise KVTrimError(f"{self.name}: layers='adaptive' found layer {j} without scores at this prompt "
                                  "(a forward that skipped layers?)")
            views.append(v)
        pending = [v.state.pop(PENDING) for v in views]
        scores: list[torch.Tensor] = [p[0] for p in pending]
        prot: list[torch.Tensor | None] = [p[1] for p in pending]
        floor = max(self.min_tokens, math.floor(LAYER_FLOOR * budget))
        floors = []
        for v, p in zip(views, prot):
            n_prot = 0 if p is None else int(p.sum(dim=-1).max())
            floors.append(min(v.length, max(floor, n_prot)))
        counts = adaptive_counts(scores, prot, floors, len(order) * budget)
        decisions = []
        for j, v, s, p, n in zip(order, views, scores, prot, counts):
            n = v.round_budget(n)
            if n < v.length:
                idx = self.select(self.shared(s, v), p, n)
                decisions.append(Keep(idx) if j == layer.layer_idx else Keep(idx, layer=j))
        return decisions
