"""``inf_mllm``: bounded-memory streaming over many turns (Ning et al., 2024, Inf-MLLM).

Eviction runs once per new prompt (a user turn, a stream chunk, the first prompt), never per
decoded token. The last ``window`` queries of the new prompt form the *retrieval window*; their
softmax attention over every stored key (the cache's plus the new prompt's own, causal inside the
window) is averaged per key over the window queries that can see it (the *causal-normalised
average*: key ``j`` among the last ``w`` keys is seen by only ``S - j`` of the ``w`` queries, so
its column is divided by ``S - j`` instead of ``w``), then over the query heads of each KV group.

Scores are scaled so that uniform attention scores 1 and the **attention bias** is added (the
paper gives no formula; kvtrim's choice, docs/methods-spec.md)::

    score_j = S * mean_attention_j + bias * slot_j / (S - 1)

where ``S`` is the number of stored tokens and ``slot_j`` the token's place in the cache
(0 = oldest, ``S - 1`` = newest; with ``reassigned`` positions it is the token's in-cache
position). It is a linear recency ramp: ``bias = 1`` gives the newest token the boost of one
uniform share of attention. A larger bias keeps newer tokens (high-attention regions move forward
across turns and old saddles do not hold the cache forever); ``bias = 0`` keeps the
highest-attention ("attention saddle") tokens wherever they are (longer-range dependencies). The
bias changes only the eviction score; the forward pass stays exact.

The most recent ``min(new prompt, floor(recent_share * budget))`` tokens are always kept (at least
the retrieval window), and so are the attention sinks (``Policy``); the rest of the budget goes to the top-scoring older tokens. Positions are
``reassigned`` by default, so a stream runs past the model's trained context.

Decoding inside a turn appends tokens beyond the budget, up to ``decode_cap`` extra tokens; they
are trimmed back to the budget at the next prompt. If a reply reaches the cap, the cache is
trimmed to the budget once, scored by that decode step's query (one row, plus the bias) with the
recent share protected, and decoding goes on: stored tokens never exceed
``max_tokens + decode_cap`` between forwards. (During one prompt's forward the cache briefly holds
the new prompt on top: ``max_tokens + decode_cap + prompt``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtrim import validate
from kvtrim.decisions import Keep
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest, chunk_selection, group_reduce, window_probs

#: name of the per-token saddle memory (``history > 0``) in the layer's token state
SADDLE_STATE = "inf_mllm_saddle"


def retrieval_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int,
                     probs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal-normalised average attention of the last ``window`` queries, per KV head.

    Args:
        query: ``[B, Hq, q, D]`` post-RoPE queries of the new prompt (the window is its last
            ``min(window, q)`` rows).
        key: ``[B, Hkv, S, D]`` all stored keys, the new prompt's last.
        probs: ``window_probs(query, key, scaling, window)`` when already at hand (a decode step's
            own attention), else computed here.
    Returns:
        ``[B, Hkv, S]`` float32: each key's softmax column averaged over the window queries that
        can see it, then averaged over the query heads of its group.
    """
    w = min(window, query.shape[-2])
    if probs is None:
        probs = window_probs(query, key, scaling, w)  # [B, Hkv, G, w, S]
    s = probs.shape[-1]
    col = probs.sum(dim=-2)
    seen_by = torch.clamp(s - torch.arange(s, device=probs.device), max=w).to(col.dtype)
    return group_reduce(col / seen_by, "mean")


def bias_ramp(n: int, bias: float, device=None) -> torch.Tensor:
    """The attention-bias term for ``n`` stored tokens, oldest first: ``bias * slot / (n - 1)``."""
    if n <= 1:
        return torch.full((n,), float(bias), device=device)
    return float(bias) * torch.arange(n, device=device, dtype=torch.float32) / (n - 1)


@dataclass
class InfMLLM(Policy):
    """Args:
        window: retrieval window ``L``, the last queries of each new prompt that score the cache
            (default 32, SnapKV's observation window; the paper does not publish ``L``). A budget
            below it is refused.
        bias: attention-bias strength (default 1.0; >= 0). 0 = pure attention saddles; larger
            keeps newer tokens. Measured over a range in ``benchmarks/bench_recall.py``.
        recent_share: the share of the budget the newest tokens may claim unconditionally
            (default 0.5): a new prompt that fits in it is kept whole, a longer one keeps its last
            ``floor(recent_share * budget)`` tokens and competes on score for the rest.
        decode_cap: decoded tokens allowed beyond the budget inside one turn (default 256).
        history: saddle memory across prompts (default 0.0: off, each prompt scores the cache by
            its own retrieval window only). With ``history = h > 0`` every prompt scores every
            stored token (also when nothing is evicted) and a token's attention term becomes
            ``max(h * previous, current)``: a token that was a saddle for an earlier prompt (a fact
            when its own turn was read) keeps that score, decaying by ``h`` per prompt, instead of
            being judged only by what the newest passage attends to. The bias is added afterwards.
            ``h`` in [0, 1].
        chunk: 1 (default) selects tokens; ``c > 1`` keeps whole chunks of ``c`` consecutive
            stored tokens, ranked by their best score (``kvtrim.scores.chunk_priority``).
    """

    window: int = 32
    bias: float = 1.0
    recent_share: float = 0.5
    decode_cap: int = 256
    history: float = 0.0
    chunk: int = 1

    name = "inf_mllm"
    description = "per-prompt eviction: retrieval-window attention saddles + recency bias, reassigned positions"
    default_position = "reassigned"
    supports_streaming = True

    def __post_init__(self) -> None:
        self.window = validate.integer(self.window, "inf_mllm: window", minimum=1)
        self.bias = validate.number(self.bias, "inf_mllm: bias", minimum=0.0)
        self.recent_share = validate.number(self.recent_share, "inf_mllm: recent_share", minimum=0.0, maximum=1.0, min_open=True)
        self.decode_cap = validate.integer(self.decode_cap, "inf_mllm: decode_cap", minimum=0)
        self.history = validate.number(self.history, "inf_mllm: history", minimum=0.0, maximum=1.0)
        self.chunk = validate.integer(self.chunk, "inf_mllm: chunk", minimum=1)
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return self.window

    def window_reason(self) -> str:
        return f"the retrieval window of {self.window} tokens"

    def n_recent(self, layer, budget: int) -> int:
        """Most recent tokens kept unconditionally at this prompt (room is left for the sinks)."""
        return min(layer.n_new, max(self.window, math.floor(self.recent_share * budget)), budget - self.n_sinks)

    def score(self, layer, query, key, scaling):
        att = retrieval_scores(query, key, scaling, self.window,
                               self.attention_window_probs(layer, query, key, scaling, self.window))
        s = att.shape[-1]
        att = att * s
        if self.history > 0:
            memory = layer.new_token_state(SADDLE_STATE)[:, :, :s]
            memory.copy_(torch.maximum(memory * self.history, att))
            att = memory.clone()
        return att + bias_ramp(s, self.bias, att.device)

    def window_tokens(self, layer, budget):
        return self.n_recent(layer, budget)

    def eviction_target(self, phase, seen, stored):
        budget = self.budget(seen)
        if phase == "decode":  # one batch trim per decode_cap tokens beyond the budget
            return budget if stored > budget + self.decode_cap else None
        return budget if stored > budget else None

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        return ScoreRequest(window=self.window) if self.history > 0 or self.kept_target(layer) is not None else None

    def select(self, scores, protected, budget):
        return super().select(chunk_selection(scores, protected, self.chunk, self.per_head), protected, budget)

    def on_prefill(self, layer, query, key, scaling):
        if self.history > 0 and self.kept_target(layer) is None:
            self.score(layer, query, key, scaling)  # nothing to evict: only the saddle memory is updated
            return None
        return self.evict_by_score(layer, query, key, scaling)

    def wants_decode_probs(self, layer) -> bool:
        return self.kept_target(layer) is not None  # a trim step (on_decode)

    def on_decode(self, layer, query, key, scaling):
        budget = self.kept_target(layer)
        if budget is None:
            return None
        # One batch trim per decode_cap tokens: score by this step's query (window of one row).
        att = retrieval_scores(query, key, scaling, 1, self.decode_probs(layer, query, key, scaling))
        s = att.shape[-1]
        scores = att * s + bias_ramp(s, self.bias, att.device)
        keep_recent = max(1, math.floor(self.recent_share * budget))
        return Keep(self.select(self.shared(scores, layer), self.always_kept(layer, keep_recent), budget))
