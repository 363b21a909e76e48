"""``elastic``: Elastic Cache (Liu et al., ECCV 2024, arXiv 2407.18121).

"One sequence, two policies":

* **Instruction encoding (prefill): importance-based merging.** Per layer, the importance of a
  prompt token is the column sum of the prompt's causal self-attention probabilities, averaged
  over all query heads: ``I_n = mean_h sum_m A_h[m, n]``. It is computed from ``q`` and ``k`` in
  chunks of ``chunk`` queries, each chunk against only the keys it can see, so a T-token prompt
  needs ``chunk x T`` floats per head at once, never ``T x T``. The top ``floor(keep * T)``
  tokens become *anchors* (the attention sinks, the first ``SINKS`` = 4 tokens of the stream, and
  the last prompt token are always anchors, ``Policy``).
  Every other token is merged into the anchor nearest to it by stream position; each anchor's
  key and value become the unweighted mean of itself and its members. One index set per layer,
  shared by all KV heads (as in the paper).
* **Generation (decode): fixed-point eviction.** The budget is elastic:
  ``budget(t) = floor(keep * (T + t))`` after ``t`` generated tokens. Whenever the cache exceeds
  it, the entry at one fixed slot ``P`` is deleted. ``P = L - distance`` is set once after the
  prompt, with ``L`` the compressed prompt length (``distance = 24``, docs/methods-spec.md). The slots
  before ``P`` are a frozen prefix; from ``P`` on the cache is a queue. Guard: ``P >= 4`` (the
  sinks), so the sinks are never evicted when the compressed prompt is shorter than ``distance + 4``.

Design decisions where the sources are silent or differ (kvtrim's choices):

* Tie rule: a token exactly half-way between two anchors joins the *earlier* anchor (the
  official code's ``argmin`` over ascending anchors does the same).
* Anchors are the intended top-k of the importance (the official code confuses ranks with token
  indices); the official code also always keeps a few start tokens (``start_size``, 1 in its
  evaluation scripts); kvtrim always forces the 4 attention sinks in, as every kvtrim method does.
* ``distance`` is 24, kvtrim's reading of the paper's "recent distance of 25"; the official
  code's ``distance=-25`` gives ``P = L - 25`` (one more recent slot). It is a parameter.
* A later multi-token forward (a new user turn) is encoded like the prompt: importance from the
  turn's queries over all stored keys, then a merge of everything stored down to
  ``floor(keep * seen)`` and a new ``P``. The paper covers single-turn requests only.
* With ``max_tokens`` instead of ``keep`` the budget is fixed: the prompt is merged to
  ``max_tokens`` and decoding evicts at ``P`` every step.
* Default position policy ``true``: ``compressed`` (what the official code does implicitly: a new
  token's position is the stored length) is offered for faithful reproduction
  (``position="compressed"``). See docs/elastic.md for the measured difference.

Ablation switches (the paper's Table of ablations):

* ``combine``: ``"merge"`` (default) or ``"drop"`` (keep the anchors, discard the rest).
* ``importance``: ``"sum"`` (default, column sum), ``"mean"`` (column sum divided by the number
  of queries that can see the key) or ``"ema"`` (exponential moving average over the query rows
  in order, ``I <- decay * I + (1 - decay) * A[m]``, ``decay = ema_decay``, default 0.99: the
  last ~100 queries dominate). The paper does not publish its mean and moving-average formulas;
  these are kvtrim's readings. ``"query"`` (not in the paper; an investigation of the needle
  failures, docs/elastic.md): column sums of only the last ``window`` prompt queries (32 when
  ``window`` is 0), i.e. the question at the prompt's end, as SnapKV's observation window.
  ``kernel`` (not in the paper, same investigation): max-pool the importance along the tokens
  before the top-k, as SnapKV pools its scores, so the neighbours of an important token become
  anchors too (a number's digits are kept together).
* ``eviction``: ``"fixed"`` (default, slot ``P``), ``"recent"`` (slot 4: keep the sinks
  and a queue of the most recent entries, StreamingLLM-like) or ``"frequency"`` (the entry with
  the lowest accumulated importance, the sinks and the newest one protected; decode rows
  keep adding their head-averaged attention, H2O-like).

Investigation switch (not in the paper): ``proportional=True`` makes the merge size-aware, as in
token merging's proportional attention (Bolya et al., ToMe, 2023): an anchor's key and value become
the mean over the original tokens it stands for (weighted by the sizes of earlier merges), and the
cache's ``logit_bias`` state holds ``log(size)`` for it, which kvtrim's attention function adds to
every query's logit for that key. A merged key then takes the softmax share its tokens would take
if they all had that key and value; with plain merging it counts as one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtrim import validate
from kvtrim.decisions import LOGIT_BIAS, DropSlot, Keep, Merge
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.scores import ScoreRequest, causal_prob_chunks, pool_scores, window_probs

COMBINE = ("merge", "drop")
IMPORTANCE = ("sum", "mean", "ema", "query")

#: queries the ``query`` importance reads when ``window`` is 0 (the question at the prompt's end)
QUERY_ROWS = 32
EVICTION = ("fixed", "recent", "frequency")


def attention_importance(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    how: str = "sum",
    decay: float = 0.99,
    chunk: int = 256,
    rows: int = QUERY_ROWS,
    head_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Head-averaged importance of every key from the causal attention of all ``q`` queries: ``[B, S]``.

    ``query [B, Hq, q, D]`` (post-RoPE), ``key [B, Hkv, S, D]`` with the queries' own keys last
    (query ``i`` sees keys ``<= S - q + i``). ``how``: ``"sum"`` = column sums of the softmax
    rows; ``"mean"`` = column sums / number of queries that see the key; ``"ema"`` = rows weighted
    ``(1 - decay) * decay**(q - 1 - m)``; ``"query"`` = column sums of the last ``rows`` queries only
    (the question at the prompt's end, as SnapKV's observation window). Float32; ``chunk`` queries at
    a time, each chunk against the keys up to its last query only (the masked upper triangle is
    never computed). ``head_mean`` averages ``[B, Hkv, G, S]`` over the heads (default: dims 1 and
    2; a policy passes its layer's :meth:`~kvtrim.decisions.LayerView.head_mean`, which under
    tensor parallelism averages over every rank's heads).
    """
    mean = head_mean or _mean_of_heads
    if how == "query":
        return mean(window_probs(query, key, scaling, rows).sum(dim=-2))
    b, q, s = query.shape[0], query.shape[-2], key.shape[-2]
    off = s - q
    out = torch.zeros(b, s, dtype=torch.float32, device=key.device)
    for start, stop, probs in causal_prob_chunks(query, key, scaling, chunk):
        if how == "ema":
            m = torch.arange(start, stop, device=key.device, dtype=torch.float64)
            w = ((1.0 - decay) * decay ** (q - 1 - m)).float()
            probs = probs * w.view(1, 1, 1, -1, 1)
        out[:, :off + stop] += mean(probs.sum(dim=-2))
    if how == "mean":
        out = out / seen_by(q, s, key.device)
    return out


def _mean_of_heads(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(1, 2))


def seen_by(q: int, s: int, device=None) -> torch.Tensor:
    """``[S]``: how many of the last ``q`` queries see each of ``s`` keys (at least 1), the divisor
    of the ``mean`` importance."""
    j = torch.arange(s, device=device)
    return (q - (j - (s - q)).clamp(min=0)).clamp(min=1)


def nearest_anchor(positions: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
    """For each token, the index (into ``anchor_positions``) of the anchor nearest to it by position.

    ``positions [N]``, ``anchor_positions [K]`` ascending, ``K >= 1``. A token exactly half-way
    between two anchors goes to the earlier one.
    """
    left = (torch.searchsorted(anchor_positions, positions, right=True) - 1).clamp(min=0)
    right = (left + 1).clamp(max=anchor_positions.numel() - 1)
    d_left = (positions - anchor_positions[left]).abs()
    d_right = (anchor_positions[right] - positions).abs()
    return torch.where(d_right < d_left, right, left)


@dataclass
class Elastic(Policy):
    """Args (defaults in brackets): ``distance`` [24] - recent slots kept behind the fixed
    eviction point, ``P = L - distance``; ``combine`` ["merge"] | "drop"; ``importance`` ["sum"] |
    "mean" | "ema"; ``ema_decay`` [0.99]; ``eviction`` ["fixed"] | "recent" | "frequency";
    ``chunk`` [256] - queries per importance chunk (memory ``chunk x T`` per head); ``kernel`` [1]
    - max-pool width of the importance before the top-k (1 = none, the paper).
    ``per_head`` must stay False: Elastic Cache shares one index set per layer."""

    per_head: bool = False
    distance: int = 24
    combine: str = "merge"
    importance: str = "sum"
    ema_decay: float = 0.99
    eviction: str = "fixed"
    chunk: int = 256
    align: bool = False
    merge_protected: bool = False
    window: int = 0
    proportional: bool = False
    kernel: int = 1

    name = "elastic"
    description = "Elastic Cache: merge into top-importance anchors at the prompt, fixed-point eviction while decoding"
    shares_prefill_scores = True

    def __post_init__(self) -> None:
        if self.per_head:
            raise KVTrimError("elastic: per_head=True is not supported; Elastic Cache keeps one index set per layer")
        self.distance = validate.integer(self.distance, "elastic: distance", minimum=0)
        validate.choice(self.combine, "elastic: combine", COMBINE)
        validate.choice(self.importance, "elastic: importance", IMPORTANCE)
        validate.choice(self.eviction, "elastic: eviction", EVICTION)
        self.ema_decay = validate.number(self.ema_decay, "elastic: ema_decay", minimum=0.0, maximum=1.0, min_open=True, max_open=True)
        self.window = validate.integer(self.window, "elastic: window", minimum=0)
        self.kernel = validate.odd_integer(self.kernel, "elastic: kernel")
        if self.proportional and self.combine != "merge":
            raise KVTrimError("elastic: proportional=True needs combine='merge' (it weighs merged tokens by their bucket size)")
        self.chunk = validate.integer(self.chunk, "elastic: chunk", minimum=1)
        super().__post_init__()

    @property
    def n_last(self) -> int:
        """Prompt tokens at the end that are always kept exact (the last one, or ``window``)."""
        return max(1, self.window)

    @property
    def min_window(self) -> int:
        return self.n_last

    def window_reason(self) -> str:
        if self.window > 1:
            return f"the last {self.window} prompt tokens"
        return "the last prompt token"

    # --- instruction encoding ----------------------------------------------------------------------
    def layer_importance(self, layer, query, key, scaling) -> torch.Tensor:
        """Importance of each stored token of ``layer``, ``[B, stored]`` (see ``attention_importance``).

        With shared prefill scores (``share_prefill_scores``) a prompt's importance is computed once
        for every budget; the ``sum`` importance is then the head mean of the column sums that H2O
        uses too (``prefill_column_sums``), so one sweep computes them once for both methods.
        When the prefill attention handed its own scores over (:meth:`wants_prefill_scores`), the
        ``sum``, ``mean`` and ``query`` importances are taken from them (column sums, or the last
        ``query_rows`` probability rows); ``ema`` is always computed here.
        """
        got = layer.attention_scores  # computed by the prefill attention itself (wants_prefill_scores)
        if got is not None:
            q, s = query.shape[-2], key.shape[-2]
            if self.importance == "mean" and got.column_sums is not None:
                return layer.head_mean(self.prefill_column_sums(layer, query, key, scaling)) / seen_by(q, s, key.device)
            if self.importance == "query" and (rows := got.window(self.query_rows, q)) is not None:
                return layer.head_mean(rows.sum(dim=-2))
            if self.importance == "sum" and got.column_sums is not None:
                return layer.head_mean(self.prefill_column_sums(layer, query, key, scaling))
        if self.sharing_prefill_scores(layer):
            if self.importance == "sum":
                return layer.head_mean(self.prefill_column_sums(layer, query, key, scaling))
            key_ = ("elastic", self.importance, self.ema_decay, self.query_rows)
            return self.prefill_scores(layer, key_, lambda: attention_importance(
                query, key, scaling, self.importance, self.ema_decay, self.chunk, self.query_rows, layer.head_mean))
        return attention_importance(query, key, scaling, self.importance, self.ema_decay, self.chunk, self.query_rows,
                                    layer.head_mean)

    def wants_prefill_scores(self, layer) -> ScoreRequest | None:
        if self.importance == "ema" or not (self.kept_target(layer) is not None or self.eviction == "frequency"):
            return None  # the ema weights rows by their place: computed apart (attention_importance)
        if self.importance == "query":
            return ScoreRequest(window=self.query_rows)
        return ScoreRequest(column_sums=True)

    @property
    def query_rows(self) -> int:
        """Queries the ``query`` importance reads: the kept-exact ``window``, else ``QUERY_ROWS``."""
        return self.window or QUERY_ROWS

    def select_anchors(self, importance: torch.Tensor, budget: int) -> torch.Tensor:
        """Top-``budget`` slots of ``importance [B, S]`` with the sink slots and the last ``n_last`` forced in,
        ascending ``[B, budget]``. With ``kernel > 1`` the importance is first max-pooled along the
        tokens (``kernel`` wide), so a token's neighbours rank with it (whole spans become anchors)."""
        s = importance.float().clone()
        if self.kernel > 1:
            s = pool_scores(s.unsqueeze(1), self.kernel, "max").squeeze(1)
        s[:, : self.n_sinks] = float("inf")
        s[:, -self.n_last :] = float("inf")
        return torch.topk(s, budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def merge(self, layer, anchors: torch.Tensor) -> Keep | Merge:
        """The decision that keeps ``anchors [B, K]`` (slots, ascending, the first and last stored slot among them).

        With ``combine="merge"`` every other token joins the nearest *mergeable* anchor and that
        anchor's key and value become the unweighted mean of itself and its members (with
        ``proportional=True``: the mean weighted by the tokens each slot stands for, and the anchor's
        ``logit_bias`` becomes the log of its new size). The sinks
        and the last slots are mergeable only with ``merge_protected=True``; by default they stay
        exact, as in the official code (which keeps its first token, the attention sink, exact). With no mergeable
        anchor (a budget of 2) the other tokens are dropped.
        """
        b, h = layer.keys.shape[:2]
        k = anchors.shape[-1]
        idx = anchors.unsqueeze(1).expand(b, h, k)
        if self.combine == "drop":
            return Keep(idx)
        keys, values = layer.keys, layer.values
        if b == 1:
            new_k, new_v = keys.index_select(2, anchors[0]), values.index_select(2, anchors[0])
        else:
            new_k = torch.stack([keys[i].index_select(1, anchors[i]) for i in range(b)])
            new_v = torch.stack([values[i].index_select(1, anchors[i]) for i in range(b)])
        rotary = layer.rotary
        if self.align and rotary is None:
            raise KVTrimError("elastic: align=True needs a model whose RoPE kvtrim can re-rotate exactly (a plain rotary embedding)")
        last = layer.length - self.n_last  # slots >= last are protected
        # tokens each slot stands for: 1 each for a plain (unweighted) merge
        if self.proportional:
            sizes = layer.new_token_state(LOGIT_BIAS)[:, 0, : layer.length].exp()
        else:
            sizes = torch.ones(b, layer.length, dtype=torch.float32, device=keys.device)
        new_sizes = []
        for i in range(b):
            a = anchors[i]
            targets = torch.arange(k, device=a.device)
            if not self.merge_protected:
                targets = targets[(a[targets] >= self.n_sinks) & (a[targets] < last)]
            if targets.numel() == 0:
                continue
            is_anchor = torch.zeros(layer.length, dtype=torch.bool, device=a.device)
            is_anchor[a] = True
            members = (~is_anchor).nonzero().squeeze(-1)
            pos = layer.positions[i, 0]
            tgt = targets[nearest_anchor(pos[members], pos[a[targets]])]  # [M] index into anchors
            w_a, w_m = sizes[i, a].view(1, k, 1), sizes[i, members].view(1, -1, 1)
            count = w_a.clone().index_add_(1, tgt, w_m)
            if self.proportional:
                new_sizes.append((i, count.view(k)))
            # keys, then values, each in place: the working set is one copy of the members' rows (and,
            # for a model in float32, none of the anchors': they are averaged inside new_k/new_v
            # themselves); in a chunked prefill every layer merges once per chunk, and temporaries of
            # the anchors' and members' size would raise its peak (docs/memory.md)
            for new, src, is_key in ((new_k, keys, True), (new_v, values, False)):
                part = src[i].index_select(1, members).float()
                if is_key and self.align:  # re-rotate each member key to its anchor's rotation before averaging
                    rot = layer.rotations[i, 0]
                    part = rotary.rotate(part, (rot[a[tgt]] - rot[members]).view(1, -1))
                acc = new[i].float()  # new[i] itself when the cache is float32
                acc.mul_(w_a).index_add_(1, tgt, part.mul_(w_m)).div_(count)
                del part
                if acc.data_ptr() != new[i].data_ptr():
                    new[i] = acc.to(new.dtype)
        states = {}
        if self.proportional:
            bias = torch.gather(layer.state_view(LOGIT_BIAS), 2, idx)
            for i, count in new_sizes:
                bias[i] = count.log().unsqueeze(0)
            states[LOGIT_BIAS] = bias
        return Merge(idx, new_k, new_v, states)

    def eviction_target(self, phase, seen, stored):
        budget = self.budget(seen)  # at a prompt (the merge) and at every decode step (the fixed point)
        return budget if stored > budget else None

    def on_prefill(self, layer, query, key, scaling):
        if self.compresses and not self.kept_whole(layer.seen) and layer.length < self.min_tokens:
            raise KVTrimError(
                f"elastic: the prompt has {layer.length} token(s), fewer than the {self.min_tokens} it always keeps "
                f"({self.min_tokens_reason()}); give a longer prompt or use keep=1.0"
            )
        need_imp = self.eviction == "frequency"
        budget = self.kept_target(layer)
        imp = None
        if budget is not None or need_imp:
            imp = self.layer_importance(layer, query, key, scaling)
        decision: Keep | Merge | None = None
        length = layer.length
        if budget is not None:
            assert imp is not None
            anchors = self.select_anchors(imp, budget)
            decision = self.merge(layer, anchors)
            imp = torch.gather(imp, 1, anchors)
            length = budget
        if need_imp:
            assert imp is not None
            layer.new_token_state("elastic_importance")
            b, h = layer.positions.shape[:2]
            acc = imp.unsqueeze(1).expand(b, h, -1).contiguous()
            if decision is None:
                layer.state_view("elastic_importance")[:] = acc
            else:
                decision = dataclasses.replace(decision, states={**decision.states, "elastic_importance": acc})
        layer.state["elastic_P"] = max(min(self.n_sinks, length - 1), length - self.distance)
        return decision

    def on_turn(self, layer, query, key, scaling):
        return self.on_prefill(layer, query, key, scaling)

    # --- generation --------------------------------------------------------------------------------
    def eviction_slot(self, layer, length: int, importance: torch.Tensor | None = None) -> int:
        """The slot the next decode-time eviction deletes from ``length`` stored tokens
        (``importance``: the accumulated importance ``[length]`` of the ``frequency`` eviction)."""
        if self.eviction == "fixed":
            return min(layer.state["elastic_P"], length - 1)
        if self.eviction == "recent":
            return self.n_sinks
        assert importance is not None
        return self.n_sinks + int(torch.argmin(importance[self.n_sinks : length - 1]))

    def wants_decode_probs(self, layer) -> bool:
        return self.eviction == "frequency"

    def on_decode(self, layer, query, key, scaling):
        if self.eviction == "frequency":
            row = layer.head_mean(self.decode_probs(layer, query, key, scaling)[..., 0, :])  # [B, S]
            layer.state_view("elastic_importance")[:] += row.unsqueeze(1)
        budget = self.kept_target(layer)
        if budget is None:
            return None
        # one slot out at a time, the others in order; the importance follows the slots it describes
        importance = layer.state_view("elastic_importance")[0, 0] if self.eviction == "frequency" else None
        drops = []
        for length in range(layer.length, budget, -1):
            p = self.eviction_slot(layer, length, importance)
            drops.append(DropSlot(p))
            if importance is not None:
                importance = torch.cat([importance[:p], importance[p + 1:]])
        return drops
