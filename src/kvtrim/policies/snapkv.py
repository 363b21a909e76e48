"""``snapkv``: observation-window selection at prefill (Li et al., 2024, SnapKV).

Once per prompt (and again at each new turn), per KV head: the last ``window`` queries attend to
all keys; their softmax rows are summed over the window, averaged over the query heads of the
group, and pooled along the keys (``kernel``-wide max or average), so that neighbours of an
important token survive with it. Keeping whole spans matters: SmolLM2's tokenizer splits a number
into single digits. Default: max pooling, kernel 7 (SnapKV's LongBench setting), which kept more
pass keys than the paper's average pooling on the embedded model (docs/results.md, "Smaller
measurements"). The top tokens by that score are kept,
plus the window itself and the attention sinks (``Policy``). Decoded tokens are appended without eviction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtrim import validate
from kvtrim.policies.head_budgets import HeadBudgets
from kvtrim.policies.layer_budgets import LayerBudgets
from kvtrim.scores import ScoreRequest, chunk_selection, group_reduce, pool_scores


@dataclass
class SnapKV(HeadBudgets, LayerBudgets):
    """Args: ``window`` (32), ``kernel`` (7; odd, 1 = no pooling), ``pooling`` ("max" or "avg"),
    ``chunk`` (1 = per-token selection; ``c > 1`` keeps whole chunks of ``c`` consecutive tokens,
    ranked by their best pooled score: ``kvtrim.scores.chunk_priority``), ``layers`` ("uniform": the
    same budget in every layer; "pyramid" or "adaptive": per-layer budgets that sum to the same total,
    ``kvtrim.policies.layer_budgets``), ``heads`` ("uniform": every KV head of a layer keeps the same
    number; "adaptive": the KV heads of a layer share their total unevenly, AdaKV's per-head budgets,
    ``kvtrim.policies.head_budgets``)."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    chunk: int = 1
    layers: str = "uniform"
    heads: str = "uniform"

    name = "snapkv"
    # describe() as before per-layer and per-head budgets, at their defaults
    added_later: ClassVar[dict] = {"layers": "uniform", "heads": "uniform"}
    description = "observation window of the last 32 queries, pooled scores, per KV head, at each prompt"

    def __post_init__(self) -> None:
        self.window = validate.integer(self.window, "snapkv: window", minimum=1)
        self.kernel = validate.odd_integer(self.kernel, "snapkv: kernel")
        validate.choice(self.pooling, "snapkv: pooling", ("avg", "max"))
        self.chunk = validate.integer(self.chunk, "snapkv: chunk", minimum=1)
        self.check_layers()
        self.check_heads()
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return self.window

    def window_reason(self) -> str:
        return f"the observation window of {self.window} tokens"

    def score(self, layer, query, key, scaling):
        probs = self.attention_window_probs(layer, query, key, scaling, self.window)  # [B, Hkv, G, w, S]
        return pool_scores(group_reduce(probs.sum(dim=-2), "mean"), self.kernel, self.pooling)  # [B, Hkv, S]

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        return ScoreRequest(window=self.window) if self.wants_scores(layer) else None

    def select(self, scores, protected, budget):
        return super().select(chunk_selection(scores, protected, self.chunk, self.per_head), protected, budget)

    def window_tokens(self, layer, budget):
        return min(self.window, layer.n_new)
