"""``hae``: hierarchical adaptive eviction for multimodal models (Ma et al., 2026,
"Hierarchical Adaptive Eviction for KV Cache Management in Multimodal Language Models";
specification in docs/methods-spec.md).

**DAP (prefill).** In the first layer, the attention of the text tokens (every prompt token that
is not a target, i.e. not image/video) over the keys, averaged over all query heads, gives
``A[i, j]`` for text row ``i`` and target (visual) token ``j``. Global relevance
``g_j = sum_i A[i, j]``, local relevance ``m_j = max_i A[i, j]``. Token ``j`` is dropped only if
``g_j < r * sum_k g_k`` **and** ``m_j < alpha`` (defaults: r = 0.0015 from the paper; alpha =
0.0005, kvtrim's choice). The kept set is computed once and broadcast to every layer, layer 0
included. Two modes (``mode``, as for FastV; ``dap_mode`` is its former name and still accepted):

* ``mode="prune"`` (default): the hidden states of dropped tokens are removed after layer 0,
  so layers 1.. never compute them (prefill compute saved; ``kvtrim.integrations.pruning``);
* ``mode="kv"``: a normal prefill, then every layer's KV is sliced to the kept set.

Relationship (tested): both modes hold the same token set in every layer, and identical KV in
layers 0 and 1 (layer 1's keys and values are projections of layer 0's output, which both modes
compute on every token). From layer 2 on, the KV of every token *before the first dropped token*
is identical in both modes (causal attention: such tokens never see a dropped one), while later
kept tokens differ, because in ``prune`` mode layers 1.. never let them attend to the dropped
tokens. With nothing dropped the two modes equal the full cache.

**DDES (decoding).** With a budget ``B`` (``keep`` or ``max_tokens``; none = no decode eviction)
and a recycle bin of capacity ``D = max(1, round(bin_ratio * B))`` (default ``bin_ratio`` 0.15,
within the 10-20% HAE suggests). Each step, every stored token's score is updated from q and k:

    hist <- gamma * hist + (1 - gamma) * a_t          (gamma = 0.9)
    score = lam * a_t + (1 - lam) * hist              (lam = 0.5)

where ``a_t`` is the attention the token gets from the current query (mean over the query heads
of its KV group; the formula is kvtrim's, the paper gives none). ``hist`` starts at the mean
attention from the last ``window`` (32) prompt queries. The ``B - D`` top-scoring tokens (the
``recent`` newest and the attention sinks forced in, ``Policy``) are *active*; the other stored tokens are in the *bin*: still
resident, so a binned token whose score climbs back into the top ``B - D`` is restored (counted in
``layer.state["hae_restored"]``). When the bin overflows (stored > B) it is emptied in one batch
(one gather per layer for ``D + 1`` tokens, against one per step for ``h2o``). The cache never
holds more than ``B`` tokens after a step. Text and visual tokens are treated alike. At the
prefill, if the prompt left after DAP exceeds ``B``, the top ``B`` by the window score are kept.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch

from kvtrim import validate
from kvtrim.decisions import Keep
from kvtrim.errors import KVTrimError
from kvtrim.policies.fastv import PrefillTokenPruning, head_mean_probs
from kvtrim.scores import group_reduce, window_probs


def dap_keep(attn: torch.Tensor, r: float = 0.0015, alpha: float = 0.0005) -> torch.Tensor:
    """DAP's rule on ``attn [n_text, n_visual]`` (head-averaged text->visual attention): boolean
    keep mask ``[n_visual]``; visual token j is dropped iff ``g_j < r * sum(g)`` and ``m_j < alpha``."""
    g = attn.sum(dim=0)
    m = attn.max(dim=0).values if attn.shape[0] else torch.zeros_like(g)
    drop = (g < r * g.sum()) & (m < alpha)
    return ~drop


@dataclass
class HAE(PrefillTokenPruning):
    """Args: ``r`` (0.0015), ``alpha`` (0.0005), ``mode`` ("prune" | "kv"; default "prune"),
    ``targets`` (image, video), budget ``keep``/``max_tokens`` for DDES (none: decoded tokens are
    appended), ``bin_ratio`` (0.15), ``gamma`` (0.9), ``lam`` (0.5), ``recent`` (8), ``window`` (32).
    ``dap_mode`` is the former name of ``mode``, accepted for older scripts and saved sessions;
    giving both with different values is refused."""

    r: float = 0.0015
    alpha: float = 0.0005
    bin_ratio: float = 0.15
    gamma: float = 0.9
    lam: float = 0.5
    recent: int = 8
    window: int = 32
    dap_mode: InitVar[str | None] = None

    name = "hae"
    description = "HAE: first-layer dual-attention pruning of visual tokens (broadcast) + recycle-bin decode eviction"
    takes_budget = True
    # DDES is optional: without keep/max_tokens HAE runs DAP alone (which needs image spans)
    default_max_tokens = None

    def __post_init__(self, dap_mode: str | None) -> None:  # the InitVar dap_mode
        if dap_mode is not None:
            if self.mode is not None and self.mode != dap_mode:
                raise KVTrimError(
                    f"hae: mode={self.mode!r} and dap_mode={dap_mode!r} disagree; dap_mode is the former name of mode, give one"
                )
            self.mode = dap_mode
        self.r = validate.number(self.r, "hae: r", minimum=0.0, maximum=1.0)
        self.alpha = validate.number(self.alpha, "hae: alpha", minimum=0.0, maximum=1.0)
        self.bin_ratio = validate.number(self.bin_ratio, "hae: bin_ratio", minimum=0.0, maximum=1.0, min_open=True, max_open=True)
        self.gamma = validate.number(self.gamma, "hae: gamma", minimum=0.0, maximum=1.0)
        self.lam = validate.number(self.lam, "hae: lam", minimum=0.0, maximum=1.0)
        self.recent = validate.integer(self.recent, "hae: recent", minimum=1)
        self.window = validate.integer(self.window, "hae: window", minimum=1)
        super().__post_init__()

    @property
    def min_window(self) -> int:
        return self.recent + 2

    def window_reason(self) -> str:
        return f"{self.recent} recent tokens + 1 active token + a bin of 1"

    @property
    def decision_layer(self) -> int:
        return 0

    slice_decision_layers = True

    def bin_size(self, budget: int) -> int:
        return max(1, min(budget - self.n_sinks - self.recent - 1, round(self.bin_ratio * budget)))

    # --- DAP -------------------------------------------------------------------------------------
    def decide(self, layer, query, key, scaling, target):
        rows = (~target).nonzero().flatten()
        attn = head_mean_probs(query, key, scaling, rows)[:, -query.shape[-2] :]  # [n_text, T]
        keep = torch.ones_like(target)
        keep[target] = dap_keep(attn[:, target], self.r, self.alpha)
        return keep

    # --- DDES ------------------------------------------------------------------------------------
    def after_token_pruning(self, layer, query, key, scaling, sliced):
        if not self.compresses:
            return None if sliced is None else Keep(sliced)
        layer.new_token_state("hae_hist")
        layer.new_token_state("hae_bin", torch.bool)
        positions = layer.positions if sliced is None else torch.gather(layer.positions, 2, sliced)
        w = min(self.window, query.shape[-2])
        probs = group_reduce(window_probs(query, key, scaling, w).mean(dim=-2), "mean")  # [B, Hkv, S_key]
        if probs.shape[-1] != positions.shape[-1]:  # the prompt's KV is sliced after attention (DAP kv mode / layer 0)
            probs = torch.gather(probs, -1, positions - (layer.seen - probs.shape[-1]))
        layer.state.setdefault("hae_evictions", 0)
        layer.state.setdefault("hae_restored", 0)
        layer.state.setdefault("hae_binned", 0)
        budget = self.budget(layer.seen)
        hist = probs
        if positions.shape[-1] > budget:
            idx = self.select(self.shared(hist, layer), self.always_kept_at(positions, layer.seen, self.recent), budget)
            sliced = idx if sliced is None else torch.gather(sliced, 2, idx)
            hist, positions = torch.gather(hist, 2, idx), torch.gather(positions, 2, idx)
            layer.state["hae_evictions"] += 1
        binned = self.binned(hist, positions, layer.seen, budget)
        if sliced is None:  # the slots stay where they are: the states are written in place
            layer.state_view("hae_hist")[:] = hist
            layer.state_view("hae_bin")[:] = binned
            return None
        return Keep(sliced, {"hae_hist": hist, "hae_bin": binned})

    def on_turn(self, layer, query, key, scaling):
        return self.after_token_pruning(layer, query, key, scaling, None)

    def on_decode(self, layer, query, key, scaling):
        if not self.compresses:
            return None
        a = group_reduce(self.decode_probs(layer, query, key, scaling)[..., 0, :], "mean")  # [B, Hkv, S]
        hist = layer.state_view("hae_hist")
        hist.mul_(self.gamma).add_(a, alpha=1.0 - self.gamma)
        score = self.lam * a + (1.0 - self.lam) * hist
        budget = self.budget(layer.seen)
        old, new = layer.state_view("hae_bin"), self.binned(score, layer.positions, layer.seen, budget)
        layer.state["hae_restored"] += int((old & ~new).sum())
        layer.state["hae_binned"] += int((~old & new).sum())
        old.copy_(new)
        if layer.length > budget:  # the bin overflowed: empty it in one batch
            keep = ~new
            n = int(keep[0, 0].sum())
            layer.state["hae_evictions"] += 1
            return Keep(keep.nonzero()[:, -1].reshape(*keep.shape[:2], n))
        return None

    def binned(self, score: torch.Tensor, positions: torch.Tensor, seen: int, budget: int) -> torch.Tensor:
        """The recycle bin ``[B, H, S]`` (True: binned): every stored token but the active ones, the top
        ``budget - D`` by ``score`` (the recent ones and the sinks forced in)."""
        n_active = min(score.shape[-1], budget - self.bin_size(budget))
        idx = self.select(score, self.always_kept_at(positions, seen, self.recent), n_active)
        return torch.ones(score.shape, dtype=torch.bool, device=score.device).scatter_(-1, idx, False)
