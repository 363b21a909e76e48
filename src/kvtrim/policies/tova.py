"""``tova``: keep what the newest query attends to, everywhere (Oren et al., 2024, TOVA).

TOVA ("token omission via attention") ranks the stored tokens by the attention the newest query
gives them, averaged over all heads of the layer, so every head of a layer keeps the same tokens.
It evicts down to the budget at each prompt and again at every decoding step, where the newest
query is the step's own; a conversation therefore runs in bounded memory, and with reassigned
positions and a fixed budget it streams past the model's context (``supports_streaming``).

Why it is here: the newest query of a prompt in a chat template is the assistant header's last
token, which has read the whole question but is not yet answering it; ranking by that single row
keeps more of what later questions ask for than SnapKV's window of question tokens, on the
reference model's multi-turn chat (docs/methods.md, "tova (TOVA)", has the measured tables).

Two choices differ from the paper and are parameters: ``kernel`` (7: max-pooled along the keys,
as kvtrim's SnapKV, so a kept token's neighbours survive with it; 1 is the paper's) and
``window`` (1: the newest query; ``w`` sums the last ``w`` rows at a prompt, as SnapKV's window).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim import validate
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest, group_reduce, pool_scores


@dataclass
class TOVA(Policy):
    """Args: ``window`` (1: the rows of the newest queries that score a prompt), ``kernel`` (7; odd,
    1 = no pooling), ``pooling`` ("max" or "avg"). ``per_head`` defaults to False (one token set per
    layer, TOVA's head average); True ranks per KV head."""

    window: int = 1
    kernel: int = 7
    pooling: str = "max"
    per_head: bool = False

    name = "tova"
    description = "attention of the newest query, averaged over heads, pooled; evicts at each prompt and every step"
    supports_streaming = True
    scores_shared_by_heads = True  # score() averages over every rank's heads itself (before pooling)

    def __post_init__(self) -> None:
        self.window = validate.integer(self.window, "tova: window", minimum=1)
        self.kernel = validate.odd_integer(self.kernel, "tova: kernel")
        validate.choice(self.pooling, "tova: pooling", ("avg", "max"))
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return self.window

    def window_reason(self) -> str:
        return f"the newest {self.window} token(s), whose attention ranks the rest"

    def score(self, layer, query, key, scaling):
        if layer.phase == "decode":
            probs = self.decode_probs(layer, query, key, scaling)  # [B, Hkv, G, 1, S]
        else:
            probs = self.attention_window_probs(layer, query, key, scaling, self.window)  # [B, Hkv, G, w, S]
        rows = probs.sum(dim=-2)  # [B, Hkv, G, S]
        if not self.per_head:
            # TOVA's score: the mean over every attention head of the layer (under tensor parallelism
            # every rank's heads: LayerView.head_mean), then pooled; the same row for each KV head
            mean = layer.head_mean(rows).unsqueeze(1)  # [B, 1, S]
            return pool_scores(mean, self.kernel, self.pooling).expand(-1, rows.shape[1], -1)
        return pool_scores(group_reduce(rows, "mean"), self.kernel, self.pooling)

    def wants_prefill_scores(self, layer):
        return ScoreRequest(window=self.window) if self.compresses else None

    def wants_decode_probs(self, layer) -> bool:
        return self.compresses  # every step ranks by the step's own attention

    def window_tokens(self, layer, budget):
        return min(self.window, layer.n_new)

    def eviction_target(self, phase, seen, stored):
        budget = self.budget(seen)  # every forward, decode steps included
        return budget if stored > budget else None

    def on_decode(self, layer, query, key, scaling):
        # positions live per slot and the ranking is recomputed at each step, so a step's drop may be
        # refilled with the newest token (DropSlots) instead of shifting the kept slots
        return self.evict_by_score(layer, query, key, scaling, order_free=True)
