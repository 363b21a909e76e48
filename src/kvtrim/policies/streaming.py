"""``streaming_llm``: attention sinks + a window of recent tokens (Xiao et al., 2023, StreamingLLM).

Keeps the first ``sinks`` tokens of the stream and the most recent ones, evicting at every step.
Positions are ``reassigned`` by default: kept keys are re-rotated to positions ``0..stored-1``
so a stream can run past the model's trained context. No attention scores are needed; the
"score" of a token is its stream index (newer is better), which makes the kept set exactly the
top-k of that score with the sinks forced in.

Slots hold the tokens in stream order, so that top-k is the first stored sinks and the last
``budget - sinks`` slots: a decode step builds that index directly (one index set shared by all
heads) instead of ranking the positions, and the cache re-rotates only the sinks (``keep_indices``);
the usual step, one token over the budget, drops the token after the sinks without building an
index at all (``CompressedLayer.drop_after_lead``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim import validate
from kvtrim.policies.base import Policy


@dataclass
class StreamingLLM(Policy):
    """Args: ``sinks`` - number of initial tokens always kept (default 4, as in the paper)."""

    sinks: int = 4

    name = "streaming_llm"
    description = "attention sinks (first 4 tokens) + most recent tokens, reassigned positions, evicts every step"
    default_position = "reassigned"
    supports_streaming = True

    def __post_init__(self) -> None:
        self.sinks = validate.integer(self.sinks, "streaming_llm: sinks", minimum=0)
        super().__post_init__()

    @property
    def n_sinks(self) -> int:
        return self.sinks

    def score(self, layer, query, key, scaling):
        return layer.positions.float()

    def on_decode(self, layer, query, key, scaling) -> None:
        budget = self.budget(layer.seen)
        if layer.length <= budget:
            return
        # the same set as evict_by_score (top-budget stream indices, sinks forced in), read off the
        # slot order: sinks first, then the newest; positions are the same in every head
        n_sinks = min(int((layer.positions[0, 0] < self.n_sinks).sum()), budget)
        if layer.length == budget + 1 and layer.drop_after_lead(n_sinks):
            return  # the usual step: the token after the sinks leaves, nothing else moves
        dev = layer.positions.device
        idx = torch.cat([torch.arange(n_sinks, device=dev), torch.arange(layer.length - (budget - n_sinks), layer.length, device=dev)])
        b, h = layer.positions.shape[:2]
        layer.keep_indices(idx.view(1, 1, -1).expand(b, h, -1))
