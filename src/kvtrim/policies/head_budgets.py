"""Per-head budgets for score-based methods (AdaKV, Feng et al., 2024): a layer's total memory shared
unevenly by its KV heads, and really freed.

A method that mixes in :class:`HeadBudgets` and declares a ``heads`` field ("uniform" by default)
can keep a different number of tokens in each KV head of a layer:

* ``uniform``: every KV head keeps ``budget(seen)`` tokens, what every method does (the storage stays
  one rectangular ``[B, H, S, D]`` tensor per layer).
* ``adaptive``: the layer's total ``H * budget(seen)`` is shared by its ``H`` KV heads. Every head
  keeps a floor, ``HEAD_FLOOR`` of the uniform budget (AdaKV's safeguard; at least the sinks and the
  window, which every head keeps by rule), by its own ranking; the rest of the total goes to the
  heads whose next tokens hold the largest share of their head's score (a token's score over the
  sum of its head's scores: the share of that head's attention it holds). The ``t``-th next token
  of a head is worth its ``t``-th largest share, which does not grow with ``t``, so the top-k of the
  pooled values over all heads (``kvtrim.policies.layer_budgets.adaptive_counts``, one head per
  entry) maximises the total share kept, and the counts sum to the total exactly. Each head then
  keeps its own top tokens (the method's ``select``), returned as one
  :class:`~kvtrim.decisions.KeepHeads`. It runs at each prompt (prefill and turns), as ``uniform``
  does; at a turn the heads already hold different numbers, and each is scored alone
  (``LayerView.head``). Decoded tokens are appended to every head.

The memory is freed, not masked: a storage that holds heads of different lengths keeps one buffer per
head (``kvtrim.ragged_storage``, transformers). An engine whose heads share one block table (vLLM)
cannot: a policy with ``heads != "uniform"`` reports ``uniform_heads = False``, which the vLLM plugin,
the low-bit storage and session files refuse. ``eviction_target`` (the integer rule) stays the
uniform one: the heads' counts sum to ``H`` times it.
"""

from __future__ import annotations

import math

import torch

from kvtrim import validate
from kvtrim.decisions import Decisions, Keep, KeepHeads, LayerView
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.policies.layer_budgets import adaptive_counts

HEAD_MODES = ("uniform", "adaptive")
#: adaptive: the share of the uniform budget every KV head keeps whatever the others' scores (AdaKV's
#: safeguard, its default 0.2: a head whose scores are flat would otherwise keep only its sinks and window)
HEAD_FLOOR = 0.2


class HeadBudgets(Policy):
    """Mixin for a score-based :class:`Policy` whose dataclass declares ``heads`` (one of ``HEAD_MODES``,
    "uniform" by default): its prompt hooks keep per-head budgets (module docstring). Put it before
    :class:`~kvtrim.policies.layer_budgets.LayerBudgets` in the bases: ``uniform`` hands on to it."""

    heads: str

    def check_heads(self) -> None:
        """Validate ``heads`` and the parameters it goes with (call from ``__post_init__``)."""
        validate.choice(self.heads, f"{self.name}: heads", HEAD_MODES)
        if self.heads == "uniform":
            return
        if not getattr(self, "per_head", True):
            raise KVTrimError(f"{self.name}: heads={self.heads!r} selects per KV head; it needs per_head=True")
        if getattr(self, "layers", "uniform") != "uniform":
            raise KVTrimError(f"{self.name}: heads={self.heads!r} takes layers='uniform' (per-layer and per-head "
                              "budgets together are not implemented)")
        if self.position not in (None, "true"):
            raise KVTrimError(f"{self.name}: heads={self.heads!r} needs position='true' (heads of different lengths "
                              "cannot share re-assigned rotations)")

    @property
    def uniform_heads(self) -> bool:
        return self.heads == "uniform"

    def on_prefill(self, layer, query, key, scaling) -> Decisions:
        if self.heads == "adaptive":
            return self.adaptive_heads_keep(layer, query, key, scaling)
        return super().on_prefill(layer, query, key, scaling)

    def head_scores(self, layer: LayerView, query: torch.Tensor, key: torch.Tensor | None, scaling: float,
                    budget: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per KV head, its scores ``[S_h]`` and protected tokens (boolean ``[S_h]`` or None): from the
        layer's rectangular keys, or head by head where the heads hold different numbers (``query``
        ``[1, Hq, q, D]``; head ``h`` reads its group's query heads)."""
        if layer.head_lengths is None:
            assert key is not None
            s, p = self.score(layer, query, key, scaling), self.protected(layer, budget)
            return [s[0, h] for h in range(s.shape[1])], [None if p is None else p[0, h] for h in range(s.shape[1])]
        n_kv = len(layer.head_lengths)
        g = query.shape[1] // n_kv
        scores, prot = [], []
        for h in range(n_kv):
            view = layer.head(h)
            scores.append(self.score(view, query[:, h * g:(h + 1) * g], view.keys, scaling)[0, 0])
            p = self.protected(view, budget)
            prot.append(None if p is None else p[0, 0])
        return scores, prot

    def adaptive_heads_keep(self, layer: LayerView, query, key, scaling) -> Decisions:
        """The prompt hook under ``heads="adaptive"`` (module docstring)."""
        if layer.phase == "decode":
            return None
        if query.shape[0] != 1:
            raise KVTrimError(f"{self.name}: heads='adaptive' keeps one sequence per cache (batch 1)")
        budget = self.budget(layer.seen)
        lengths = layer.head_lengths or (layer.length,) * layer.positions.shape[1]
        total = len(lengths) * budget
        if sum(lengths) <= total:
            return None
        scores, prot = self.head_scores(layer, query, key, scaling, budget)
        floor = max(self.min_tokens, math.floor(HEAD_FLOOR * budget))
        floors = [min(n, max(floor, 0 if p is None else int(p.sum()))) for n, p in zip(lengths, prot)]
        counts = adaptive_counts([s.float().view(1, 1, -1) for s in scores],
                                 [None if p is None else p.view(1, 1, -1) for p in prot], floors, total)
        idx = [self.select(s.view(1, 1, -1), None if p is None else p.view(1, 1, -1), n)[0, 0]
               for s, p, n in zip(scores, prot, counts)]
        if layer.head_lengths is None and len(set(counts)) == 1:
            return Keep(torch.stack(idx).unsqueeze(0))  # every head the same count: the rectangular keep
        return KeepHeads(tuple(idx))
