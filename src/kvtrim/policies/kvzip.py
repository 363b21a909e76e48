"""``kvzip``: keep what the model needs to reconstruct the prompt (Kim et al., 2025, KVzip).

A query-aware method (SnapKV, TOVA) ranks the prompt by the question at its end, so a cache that
later serves other questions (a chat about one document, a session) has dropped what they ask for.
KVzip's score does not depend on any question: after the prompt's prefill the model is asked to
repeat the prompt ("Repeat the previous context exactly." and then the prompt itself, teacher-forced,
in chunks), and each stored token is scored by the largest attention any of those reconstructing
queries gives it (over the query heads of its KV head). A token the model needs to reproduce the
prompt ranks high whatever is asked next. Each KV head keeps its own top ``keep`` share (the sinks
forced in) and the rest is freed, once, at the prompt.

The reconstruction is a second forward over the prompt (about the prefill's cost again, plus a
short instruction per chunk) that kvtrim runs itself (:mod:`kvtrim.reconstruction`), so the method
runs where kvtrim drives the forwards: ``kvtrim.generate_ids`` / ``kvtrim generate``, ``kvtrim
eval``, and a :class:`kvtrim.session.Session` (``kvtrim chat``), whose first message (a document
and a question, say) is compressed once. Later turns and decoded tokens are kept: the method evicts
at that first prompt only, so a long conversation grows past the budget (a bounded chat wants
``tova``). A cache filled by someone else's loop (``model.generate``, a streamed session, vLLM)
has no reconstruction scores, and the method is refused there with a ``KVTrimError`` rather than
run as something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtrim import validate
from kvtrim.decisions import KeepHeads
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy

SCOPES = ("global", "uniform")

#: the instruction that precedes each reconstructed chunk (KVzip's repeat prompt, in kvtrim's words)
REPEAT_INSTRUCTION = "Repeat the previous context exactly."


@dataclass
class KVzip(Policy):
    """Args: ``chunk`` (2048: prompt tokens reconstructed per forward; each chunk is preceded by the
    repeat instruction and sees the whole stored prompt and itself, so the reconstruction's working
    set is one chunk against the prompt, not the prompt against itself); ``scope`` ("global": one
    threshold over every layer and KV head; "uniform": ``budget`` tokens per KV head); ``window``
    (1: the newest prompt tokens every head keeps, as it keeps the sinks)."""

    chunk: int = 2048
    scope: str = "global"
    window: int = 1

    name = "kvzip"
    description = "query-agnostic: attention received while the model reconstructs the prompt; evicts once, at the prompt"
    # a conversation's first message is compressed once (kvtrim.session), later turns and answers kept
    supports_turns = True
    needs_reconstruction: ClassVar[bool] = True
    uniform_heads_setting: ClassVar[str] = "scope='uniform'"

    def __post_init__(self) -> None:
        self.chunk = validate.integer(self.chunk, "kvzip: chunk", minimum=16)
        validate.choice(self.scope, "kvzip: scope", SCOPES)
        self.window = validate.integer(self.window, "kvzip: window", minimum=0)
        if self.scope == "global" and self.position not in (None, "true"):
            raise KVTrimError("kvzip: scope='global' keeps heads of different lengths, which need position='true'; "
                              "use scope='uniform' for another position policy")
        super().__post_init__()
        #: per layer index, the reconstruction scores ``[B, Hkv, S]`` of the prompt (set by
        #: :func:`kvtrim.reconstruction.prepare` before the prompt's eviction)
        self.reconstruction: dict[int, torch.Tensor] | None = None
        self._global: tuple[object, int, dict[int, torch.Tensor]] | None = None  # (scores, budget, kept per layer)

    @property
    def uniform_heads(self) -> bool:
        return self.scope == "uniform"

    @property
    def uniform_layers(self) -> bool:
        return self.scope == "uniform"

    def score(self, layer, query, key, scaling):
        if self.reconstruction is None:
            raise KVTrimError(
                "kvzip scores the prompt by a second forward that reconstructs it, which kvtrim runs itself: use "
                "kvtrim.generate_ids / `kvtrim generate`, a Session / `kvtrim chat`, or `kvtrim eval` (model.generate "
                "and the vLLM plugin cannot run it)")
        s = self.reconstruction.get(layer.layer_idx)
        if s is None or s.shape[-1] != layer.length:
            got = "none" if s is None else f"{s.shape[-1]} tokens"
            raise KVTrimError(f"kvzip: the reconstruction scores of layer {layer.layer_idx} ({got}) do not match the "
                              f"{layer.length} stored tokens; they belong to another prompt")
        return s

    def on_prefill(self, layer, query, key, scaling):
        if self.scope == "uniform":
            return self.evict_by_score(layer, query, key, scaling)
        budget = self.kept_target(layer)
        if budget is None:
            return None
        s = self.score(layer, query, key, scaling)
        if s.shape[0] != 1:
            raise KVTrimError("kvzip: scope='global' keeps one sequence per cache (batch 1); use scope='uniform'")
        kept = self.global_keep(budget)[layer.layer_idx]  # [H, S]
        return KeepHeads(tuple(kept[h].nonzero()[:, 0] for h in range(kept.shape[0])))

    def global_keep(self, budget: int) -> dict[int, torch.Tensor]:
        """Per layer, the boolean ``[H, S]`` of the tokens kept under one threshold over every layer and
        KV head: the top ``L * H * budget`` scores, the sinks forced in (computed once per prompt)."""
        scores = self.reconstruction
        assert scores is not None
        if self._global is not None and self._global[0] is scores and self._global[1] == budget:
            return self._global[2]
        order = sorted(scores)
        flat = torch.stack([scores[i][0].float() for i in order])  # [L, H, S]
        flat[..., : self.n_sinks] = float("inf")
        if self.window:
            flat[..., -self.window :] = float("inf")
        total = min(flat.numel(), len(order) * flat.shape[1] * budget)
        mask = torch.zeros(flat.numel(), dtype=torch.bool)
        mask[torch.topk(flat.flatten(), total, sorted=False).indices] = True
        mask = mask.view(flat.shape)
        kept = {i: mask[j] for j, i in enumerate(order)}
        self._global = (scores, budget, kept)
        return kept

    @property
    def min_window(self) -> int:
        return self.window

    def window_reason(self) -> str:
        return f"the newest {self.window} prompt token(s)"

    def window_tokens(self, layer, budget):
        return min(self.window, layer.n_new)

    def eviction_target(self, phase, seen, stored):
        return super().eviction_target(phase, seen, stored) if phase == "prefill" else None

    def on_turn(self, layer, query, key, scaling):
        return None

    def on_decode(self, layer, query, key, scaling):
        return None
