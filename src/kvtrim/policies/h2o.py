"""``h2o``: heavy hitters + recent tokens (Zhang et al., 2023, H2O).

Per KV head, every key accumulates the attention it receives from every query (summed over the
query heads of its group and over all steps, causally: a query only credits keys it can see;
H2O's accuracy tables used future queries, kvtrim does not). The cache keeps the
``budget * (1 - recent_ratio)`` highest-accumulated tokens plus the ``budget * recent_ratio``
most recent ones (the attention sinks always among the kept, ``Policy``; the recent share leaves
room for at least one heavy hitter), and evicts at every step, as the paper's streaming variant does.
Prefill scores are all-row column sums: from the prefill attention's own probabilities where
kvtrim's attention function fuses them (``Policy.wants_prefill_scores``), else computed in chunks of
queries from q and k; a decode
step's scores are the probabilities of the step's own attention (``Policy.wants_decode_probs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim import validate
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest, group_reduce


@dataclass
class H2O(Policy):
    """Args: ``recent_ratio`` - share of the budget reserved for recent tokens (default 0.5:
    H2O's 10% heavy + 10% recent at a 20% budget)."""

    recent_ratio: float = 0.5

    name = "h2o"
    description = "heavy hitters (accumulated attention per KV head) + recent tokens, evicts every step"
    supports_streaming = True
    shares_prefill_scores = True

    def __post_init__(self) -> None:
        self.recent_ratio = validate.number(self.recent_ratio, "h2o: recent_ratio", minimum=0.0, maximum=1.0, max_open=True)
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return 2

    def window_reason(self) -> str:
        return "one heavy and one recent token"

    def _accumulate(self, layer, query, key, scaling) -> None:
        acc = layer.new_token_state("h2o_acc")
        if query.shape[-2] == 1:
            got = group_reduce(self.decode_probs(layer, query, key, scaling).sum(dim=-2), "sum")
        else:  # the prompt's sums do not depend on the budget: shared across budgets (share_prefill_scores)
            got = self.prefill_scores(
                layer, "h2o", lambda: group_reduce(self.prefill_column_sums(layer, query, key, scaling), "sum"))
        acc[:, :, : layer.length] += got

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        # accumulated at every prompt, evicting or not; a budget that keeps everything never reads them
        return ScoreRequest(column_sums=True) if self.compresses else None

    def wants_decode_probs(self, layer) -> bool:
        return True  # every decode step adds the step's attention to the accumulated scores

    def score(self, layer, query, key, scaling):
        return layer.state_view("h2o_acc")

    def window_tokens(self, layer, budget):
        return min(int(budget * self.recent_ratio), budget - self.n_sinks - 1)

    def eviction_target(self, phase, seen, stored):
        budget = self.budget(seen)  # every forward, decode steps included
        return budget if stored > budget else None

    def on_prefill(self, layer, query, key, scaling):
        self._accumulate(layer, query, key, scaling)
        return self.evict_by_score(layer, query, key, scaling)

    def on_decode(self, layer, query, key, scaling):
        # scores and positions live per slot, so the slot order means nothing to H2O: a step's few
        # drops may be filled with the newest tokens (DropSlots) instead of shifting the rest
        self._accumulate(layer, query, key, scaling)
        return self.evict_by_score(layer, query, key, scaling, order_free=True)
