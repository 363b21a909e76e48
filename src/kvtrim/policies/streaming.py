"""``streaming_llm``: attention sinks + a window of recent tokens (Xiao et al., 2023, StreamingLLM).

Keeps the first ``sinks`` tokens of the stream and the most recent ones, evicting at every step.
Positions are ``reassigned`` by default: kept keys are re-rotated to positions ``0..stored-1``
so a stream can run past the model's trained context. No attention scores are needed; the
"score" of a token is its stream index (newer is better), which makes the kept set exactly the
top-k of that score with the sinks forced in.

Slots hold the tokens in stream order, so that top-k is the first stored sinks and the last
``budget - sinks`` slots: a decode step returns that as "drop the tokens after the sinks"
(``kvtrim.decisions.DropLead``) instead of ranking the positions, and a storage moves the sinks, not
the window (the transformers storage re-rotates only the sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim import validate
from kvtrim.decisions import DropLead
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

    def eviction_target(self, phase, seen, stored):
        budget = self.budget(seen)  # every forward, decode steps included
        return budget if stored > budget else None

    def on_decode(self, layer, query, key, scaling):
        budget = self.kept_target(layer)
        if budget is None:
            return None
        # the same set as evict_by_score (top-budget stream indices, sinks forced in), read off the
        # slot order: sinks first, then the newest; positions are the same in every head
        n_sinks = min(int((layer.positions[0, 0] < self.n_sinks).sum()), budget)
        return DropLead(n_sinks, layer.length - budget)
