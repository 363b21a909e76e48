"""``fastv``: drop half of the image tokens after layer K by the last token's attention (Chen et al., 2024, FastV).

At the prefill, in layer ``K - 1`` (0-based; so ``K = 2`` means after two full layers), the last
prompt token's attention over the image/video tokens, averaged over all query heads, ranks them;
the top ``ratio`` (default 50%) are kept. With ``mode="prune"`` (FastV's own; default) the hidden
states of the dropped tokens are removed before layer ``K``, so layers ``K..`` never compute them
(prefill compute saved, see ``kvtrim.integrations.pruning``); with ``mode="kv"`` every layer computes them and
layers ``K..`` slice them out of their KV after the normal prefill. Layers before ``K`` keep every
token, as in FastV. Decoded tokens are appended; nothing else is evicted.

Which tokens are prunable comes from the cache's modality spans (``kvtrim.spans``): image and
video spans by default (``targets``), found automatically for VLMs; for a text model, tag e.g. a
document ``document`` and pass ``targets=("document",)``. A prompt without such spans would run as
``full``; the cache refuses it at the prefill (``kvtrim.registry.spans_error``; HAE with a budget is
allowed: its decode eviction acts on text too). The last prompt token is never pruned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtrim import validate
from kvtrim.decisions import Decision, Decisions, Keep, as_list
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy
from kvtrim.scores import grouped_queries
from kvtrim.spans import MODALITIES, VISUAL

MODES = ("prune", "kv")


@dataclass
class PrefillTokenPruning(Policy):
    """Shared mechanism of FastV and HAE's DAP: decide a kept token set once, in one layer of the
    prefill, and broadcast it to later layers (hidden-state pruning or KV slicing).

    Subclasses set ``decision_layer`` (0-based layer whose attention decides), write
    ``decide(layer, query, key, scaling, target) -> keep mask`` over the prompt, and say with
    ``slice_decision_layers`` whether layers ``<= decision_layer`` drop the tokens from their KV too.
    """

    mode: str | None = None  # "prune" or "kv"; None means "prune"
    targets: tuple = VISUAL

    slice_decision_layers: ClassVar[bool] = False
    takes_budget = False
    rewrites_forward = True
    needs_spans = True

    def __post_init__(self) -> None:
        self.mode = validate.choice("prune" if self.mode is None else self.mode, f"{self.name}: mode", MODES)
        if isinstance(self.targets, str):
            self.targets = (self.targets,)
        self.targets = tuple(self.targets)
        bad = [t for t in self.targets if t not in MODALITIES or t in ("text", "system")]
        if bad or not self.targets:
            raise KVTrimError(
                f"{self.name}: targets must be prunable modalities among image, video, document; got {self.targets!r}"
            )
        super().__post_init__()

    @property
    def decision_layer(self) -> int:
        raise NotImplementedError

    def decide(self, layer, query, key, scaling, target: torch.Tensor) -> torch.Tensor:
        """Boolean keep mask over this prefill's tokens ``[T]``; only ``target`` tokens may be dropped."""
        raise NotImplementedError

    def target_mask(self, layer) -> torch.Tensor | None:
        """Boolean ``[T]`` over the prompt: the prunable tokens (from the prompt's spans), or None."""
        spans = layer.spans
        if spans is None:
            return None
        pos = layer.positions[0, 0]
        target = spans.mask(pos, self.targets)
        target[-1] = False  # the last prompt token gives the next token's logits
        return target if bool(target.any()) else None

    def on_prefill(self, layer, query, key, scaling) -> Decisions:
        decisions: list[Decision] = []
        sliced = None  # this layer's own slice, which its after_token_pruning builds on
        if layer.layer_idx == self.decision_layer:
            target = self.target_mask(layer)
            if target is not None:
                keep = self.decide(layer, query, key, scaling, target) | ~target
                kept_stream = layer.positions[0, 0][keep]
                layer.state["kept_stream"] = kept_stream
                layer.state["targets"] = int(target.sum())
                layer.state["targets_kept"] = int((keep & target).sum())
                if self.mode == "prune":  # handed to the forward by take_hidden_state_keep
                    layer.state["hidden_state_keep"] = keep.nonzero().flatten()
                if self.slice_decision_layers:
                    for li in range(layer.layer_idx):
                        other = layer.other(li)
                        if other is not None and (idx := self.slice_index(other, kept_stream)) is not None:
                            decisions.append(Keep(idx, layer=li))
                    sliced = self.slice_index(layer, kept_stream)
        elif self.mode == "kv" and layer.layer_idx > self.decision_layer:
            first = layer.other(self.decision_layer)
            if first is not None and "kept_stream" in first.state:
                sliced = self.slice_index(layer, first.state["kept_stream"])
        return decisions + as_list(self.after_token_pruning(layer, query, key, scaling, sliced))

    def take_hidden_state_keep(self, cache) -> "tuple[int, torch.Tensor] | None":
        """In ``prune`` mode, the prompt tokens layers after ``decision_layer`` compute, once decided."""
        layers = cache.layers
        if self.decision_layer >= len(layers):
            return None
        keep = getattr(layers[self.decision_layer], "state", {}).pop("hidden_state_keep", None)
        return None if keep is None else (self.decision_layer, keep)

    def on_turn(self, layer, query, key, scaling) -> Decisions:
        """Later prompts (turns, chunks) are appended; the token set is decided once, at the prefill."""
        return self.after_token_pruning(layer, query, key, scaling, None)

    @staticmethod
    def slice_index(layer, kept_stream: torch.Tensor) -> torch.Tensor | None:
        """The slots of ``layer`` whose stream index is in ``kept_stream`` (``[B, H, n]``, the same per
        head at the prefill), or None when that is every slot."""
        hit = torch.isin(layer.positions, kept_stream.to(layer.positions.device))  # [B, H, S]
        n = int(hit[0, 0].sum())
        if n == layer.length:
            return None
        return hit[0, 0].nonzero().flatten().expand(*layer.positions.shape[:2], n).contiguous()

    def after_token_pruning(self, layer, query, key, scaling, sliced: torch.Tensor | None) -> Decisions:
        """This layer's decision once its prompt was pruned to the slots ``sliced`` (None: not
        sliced): the slice itself by default; HAE adds its budget (DDES) on top."""
        return None if sliced is None else Keep(sliced)


def head_mean_probs(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Causal softmax attention of the prompt queries ``rows`` (indices into the ``T`` prompt
    tokens) over all keys, averaged over every query head: ``[len(rows), S]`` (float32).

    ``query [1, Hq, T, D]``, ``key [1, Hkv, S, D]`` with the prompt's keys last (``S >= T``).
    Computed ``chunk`` rows at a time; only the needed rows, never the whole T x T matrix.
    """
    t, s = query.shape[-2], key.shape[-2]
    kf = key.float()
    kj = torch.arange(s, device=key.device)
    out = []
    for a in range(0, rows.numel(), chunk):
        r = rows[a : a + chunk].to(query.device)
        qg = grouped_queries(query[:, :, r].float(), key.shape[1])  # [1, Hkv, G, n, D]
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, kf) * scaling
        qi = (s - t + r).unsqueeze(1)
        logits = logits.masked_fill(kj.unsqueeze(0) > qi, float("-inf"))
        out.append(torch.softmax(logits, dim=-1).mean(dim=(1, 2))[0])  # mean over all query heads
    return torch.cat(out, dim=0)


@dataclass
class FastV(PrefillTokenPruning):
    """Args: ``k`` (2: decide in layer k-1, prune before layer k), ``ratio`` (default 0.5: share of
    the target tokens kept, rounded down), ``mode`` ("prune" or "kv"), ``targets`` (image, video).

    FastV has no cache budget: ``keep`` is taken as ``ratio`` (so ``--keep 0.3`` on the command line
    keeps 30% of the image tokens) and stored there (``keep`` stays None); giving both with
    different values, or ``max_tokens``, is refused."""

    k: int = 2
    ratio: float | None = None  # None: 0.5, or keep when given

    name = "fastv"
    description = "FastV: keep the top 50% of image tokens by the last token's attention in layer K=2, prune hidden states after"

    def __post_init__(self) -> None:
        self.k = validate.integer(self.k, "fastv: k", minimum=1)
        if self.max_tokens is not None:
            raise KVTrimError("fastv takes no cache budget (max_tokens); set the share of image tokens it keeps with "
                              "--keep (ratio= or keep= in Python)")
        if self.keep is not None:
            keep = validate.fraction(self.keep, "fastv: keep (the share of image tokens kept)")
            if self.ratio is not None and validate.number(self.ratio, "fastv: ratio") != keep:
                raise KVTrimError(f"fastv: keep={keep} and ratio={self.ratio} disagree; keep is FastV's ratio, give one")
            self.ratio, self.keep = keep, None
        self.ratio = validate.number(0.5 if self.ratio is None else self.ratio, "fastv: ratio", minimum=0.0, maximum=1.0)
        super().__post_init__()

    @property
    def decision_layer(self) -> int:
        return self.k - 1

    def decide(self, layer, query, key, scaling, target):
        last = torch.tensor([query.shape[-2] - 1], device=query.device)
        att = head_mean_probs(query, key, scaling, last)[0, -query.shape[-2] :]  # [T]
        n_keep = math.floor((self.ratio or 0.0) * int(target.sum()) + 1e-9)  # ratio is set by __post_init__
        s = att.masked_fill(~target, float("-inf"))
        keep = torch.zeros_like(target)
        if n_keep:
            keep[torch.topk(s, n_keep).indices] = True
        return keep
