"""What a policy sees of one layer (:class:`LayerView`) and what it returns (a decision).

A KV method (``kvtrim.policies``) never changes a storage itself. After a layer's attention its
hook reads a :class:`LayerView` -- how many tokens the layer has seen and stores, the stream index
of each stored token per KV head, the phase of the forward, the scores it asked the engine for,
its own per-layer and per-token state -- and returns one of the decision values below (or a
sequence of them, applied in order, or None for "nothing changes"). A storage applies them:

* the transformers storage, ``kvtrim.storage.CompressedLayer`` (contiguous buffers per layer);
* the vLLM storage, ``kvtrim.integrations.vllm.storage`` (vLLM's paged KV blocks).

Each storage picks its fastest way to carry a decision out by the decision's *kind* (dropping the
token after the sinks moves the sinks, not the window; a decode step's few drops fill their holes
with the newest tokens where the slot order carries no meaning), never by the method that made it.
Every decision has a plain meaning in terms of :class:`Keep` (``as_keep``), which is what a storage
without a faster path does and what the tests compare the fast paths against.

Tensor layouts: ``[B, H, S]`` per stored slot (``B`` sequences, ``H`` KV heads, ``S`` stored tokens);
slot ``s`` of head ``h`` is the ``s``-th stored token of that head.

Per-head budgets (``kvtrim.policies.head_budgets``) keep a different number of tokens in each KV head
of a layer: :class:`KeepHeads`, which has no rectangular meaning and which only a storage that holds
heads of different lengths applies (``kvtrim.ragged_storage``); the view of such a layer then says
``head_lengths`` and shows each head as a one-head view (``head(h)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvtrim.rope import Rotary
    from kvtrim.scores import PromptScores
    from kvtrim.spans import SpanSet

#: Name of the optional per-token state whose value every query adds to its attention logit for
#: that key (``[B, Hkv, stored]``; e.g. ``log(size)`` for a merged key, so that it weighs as much as
#: the tokens it stands for). New tokens get 0. Storages and attention functions honour it.
LOGIT_BIAS = "logit_bias"

PHASES = ("prefill", "turn", "decode")


class LayerView(Protocol):
    """A read-only view of one layer's storage, as a policy's hook receives it.

    Read-only means the stored tokens: keys, values, their stream indices and rotations change only
    through a decision. What belongs to the policy -- ``state`` (per-layer) and the per-token states
    (:meth:`new_token_state`, :meth:`state_view`: aligned with the stored slots, moved by the storage
    with them) -- the policy writes itself.
    """

    #: index of this layer in the model
    layer_idx: int
    #: layers of the model (compressed or not), or 0 where the engine shows a policy one layer at a
    #: time only (vLLM); a method that decides across layers (per-layer budgets) needs it
    n_layers: int
    #: tokens this layer has seen (the stream index of the next token)
    seen: int
    #: tokens it stores now (after this forward's new ones were appended)
    length: int
    #: tokens this forward brought (1 for a decode step)
    n_new: int
    #: "prefill" (the first forward of a sequence), "turn" (a later forward of several tokens) or "decode"
    phase: str
    #: where new tokens' keys are rotated: "true", "reassigned" or "compressed"
    position_policy: str
    #: the model's rotary embedding where keys can be re-rotated exactly, else None
    rotary: Rotary | None
    #: the prompt's modality spans (``kvtrim.spans``), or None
    spans: SpanSet | None
    #: the policy's per-layer state (its own; kept across forwards and saved with a session)
    state: dict
    #: scores the forward's own attention computed for this hook (``Policy.wants_prefill_scores``), or None
    attention_scores: PromptScores | None
    #: this decode step's attention probabilities ``[B, Hkv, G, 1, S]`` when asked for, or None
    decode_probs: torch.Tensor | None
    #: tokens stored per KV head where the heads hold different numbers (a :class:`KeepHeads` was
    #: applied; ``length`` is then the longest), else None: every head stores ``length``. Where it
    #: is set, ``keys``, ``values``, ``positions`` and ``rotations`` are not rectangular: read one
    #: head at a time through :meth:`head`
    head_lengths: tuple[int, ...] | None

    @property
    def keys(self) -> torch.Tensor:
        """Stored keys ``[B, H, S, D]`` (after RoPE at :attr:`rotations`); do not write."""
        ...

    @property
    def values(self) -> torch.Tensor:
        """Stored values ``[B, H, S, Dv]``; do not write."""
        ...

    @property
    def positions(self) -> torch.Tensor:
        """Stream index of each stored token, ``[B, H, S]`` int64."""
        ...

    @property
    def rotations(self) -> torch.Tensor:
        """Position each stored key is rotated at, ``[B, H, S]`` (``positions`` under ``true``)."""
        ...

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The policy's per-token state ``name`` (created as zeros): ``[B, H, capacity]``, slots
        ``:length`` valid; new tokens start at 0."""
        ...

    def state_view(self, name: str) -> torch.Tensor:
        """The stored part of per-token state ``name``, ``[B, H, S]`` (writable)."""
        ...

    def has_token_state(self, name: str) -> bool:
        ...

    def round_budget(self, budget: int) -> int:
        """The number of tokens this storage keeps when a policy asks for ``budget`` (at most
        ``length``): ``budget`` itself for the transformers storage; for a paged storage the least
        count at or above it that frees whole blocks."""
        ...

    def other(self, layer_idx: int) -> LayerView | None:
        """Another layer of the same sequence (read-only as well), or None where it is not a
        compressed layer. For methods that decide in one layer for all (FastV, HAE)."""
        ...

    def head(self, h: int) -> LayerView:
        """KV head ``h`` alone as a view of one KV head (``keys [1, 1, S_h, D]``, ``length`` its own
        count; counters, phase and ``state`` the layer's), where :attr:`head_lengths` is set."""
        ...

    def head_mean(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Hkv, G, ...]`` (one entry per attention head: KV head, then query head of its
        group) averaged over every attention head of the layer, ``[B, ...]``. Where this storage
        holds all the heads, the mean over dims 1 and 2; under tensor parallelism (vLLM, each rank
        holding a slice of the heads) the mean over every rank's heads, the same tensor on each
        rank. For a score that all heads share (Elastic Cache's anchors)."""
        ...


class ViewOf:
    """Base of a storage's :class:`LayerView`: the counters, phase, stream indices, policy state and
    handed-over scores, read from the storage object (``layer``) that keeps them under these names."""

    __slots__ = ("_layer",)

    def __init__(self, layer):
        self._layer = layer

    layer_idx = property(lambda self: self._layer.layer_idx)
    seen = property(lambda self: self._layer.seen)
    length = property(lambda self: self._layer.length)
    n_new = property(lambda self: self._layer.n_new)
    phase = property(lambda self: self._layer.phase)
    state = property(lambda self: self._layer.state)
    attention_scores = property(lambda self: self._layer.attention_scores)
    decode_probs = property(lambda self: self._layer.decode_probs)
    positions = property(lambda self: self._layer.positions)
    head_lengths = property(lambda self: getattr(self._layer, "head_lengths", None))

    def head(self, h: int) -> LayerView:
        raise ValueError("this layer's heads store the same number of tokens (head_lengths is None): read keys")

    def head_mean(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(1, 2))


# --------------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Keep:
    """Keep the slots ``idx`` (``[B, H, K]`` int64, ascending per head) in order; drop the rest.

    ``states``: per-token states to write after the keep, each ``[B, H, K]`` aligned with the kept
    slots (a state computed for the survivors). ``layer``: the layer this applies to when it is not
    the one whose hook returned it (FastV and HAE slice every layer from one decision)."""

    idx: torch.Tensor
    states: Mapping[str, torch.Tensor] = field(default_factory=dict)
    layer: int | None = None

    def kept(self, length: int) -> int:
        return int(self.idx.shape[-1])


@dataclass(frozen=True)
class DropLead:
    """Drop ``count`` slots right after the first ``lead`` ones, in every head, keeping the rest in
    order (StreamingLLM's step: the oldest tokens after the sinks leave)."""

    lead: int
    count: int = 1

    def kept(self, length: int) -> int:
        return length - self.count


@dataclass(frozen=True)
class DropSlot:
    """Drop slot ``slot`` (the same in every head), keeping the rest in order (Elastic Cache's
    fixed-point eviction)."""

    slot: int

    def kept(self, length: int) -> int:
        return length - 1


@dataclass(frozen=True)
class DropSlots:
    """Drop the slots ``slots`` (``[B, H, m]``, distinct per head, a few). The survivors' slot order
    carries no meaning for the policy that returns this (its state lives per slot), so a storage
    may move the newest tokens into the holes instead of shifting every later one."""

    slots: torch.Tensor

    def kept(self, length: int) -> int:
        return length - int(self.slots.shape[-1])


@dataclass(frozen=True)
class Merge:
    """Keep the slots ``idx`` (``[B, H, K]``, ascending) with new keys and values ``[B, H, K, D]``
    (merged tokens), and write ``states`` (``[B, H, K]`` each) after."""

    idx: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    states: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def kept(self, length: int) -> int:
        return int(self.idx.shape[-1])


@dataclass(frozen=True)
class KeepHeads:
    """Keep, in KV head ``h``, that head's slots ``idx[h]`` (``[K_h]`` int64, ascending) in order; drop
    the rest. The heads may keep different numbers of tokens (per-head budgets), so this has no
    rectangular :class:`Keep` form: only a storage that holds heads of different lengths applies it
    (``kvtrim.ragged_storage``; a cache of one sequence, batch 1), and an engine whose heads share
    one block table refuses the policies that return it (``Policy.uniform_heads``)."""

    idx: tuple[torch.Tensor, ...]

    def kept(self, length: int) -> int:
        """The longest head's count (what a layer's ``length`` is after it)."""
        return max(int(i.shape[-1]) for i in self.idx)

    @property
    def counts(self) -> list[int]:
        return [int(i.shape[-1]) for i in self.idx]


Decision = Keep | DropLead | DropSlot | DropSlots | Merge | KeepHeads
#: what a hook returns: nothing, one decision, or several applied in order
Decisions = Decision | Sequence[Decision] | None


def as_list(decisions: Decisions) -> list[Decision]:
    """A hook's return value as a list of decisions (empty for None)."""
    if decisions is None:
        return []
    if isinstance(decisions, (Keep, DropLead, DropSlot, DropSlots, Merge, KeepHeads)):
        return [decisions]
    return list(decisions)


def kept_after(decisions: Decisions, length: int) -> int:
    """Stored tokens after applying ``decisions`` (to this layer) to ``length`` stored tokens."""
    for d in as_list(decisions):
        if not (isinstance(d, Keep) and d.layer is not None):
            length = d.kept(length)
    return length


def as_keep(decision: Decision, length: int, batch: int, heads: int, device=None) -> Keep:
    """The :class:`Keep` a decision means for a layer storing ``length`` tokens (``Merge``: its
    slots; the merged keys and values are the storage's to write)."""
    if isinstance(decision, (Keep, Merge)):
        return Keep(decision.idx, decision.states)
    if isinstance(decision, DropLead):
        a, b = decision.lead, decision.lead + decision.count
        idx = torch.cat([torch.arange(a, device=device), torch.arange(b, length, device=device)])
        return Keep(idx.view(1, 1, -1).expand(batch, heads, -1))
    if isinstance(decision, DropSlot):
        p = decision.slot
        idx = torch.cat([torch.arange(p, device=device), torch.arange(p + 1, length, device=device)])
        return Keep(idx.view(1, 1, -1).expand(batch, heads, -1))
    if isinstance(decision, DropSlots):
        slots = decision.slots
        alive = torch.ones(slots.shape[0], slots.shape[1], length, dtype=torch.bool, device=slots.device)
        alive.scatter_(-1, slots, False)
        k = length - slots.shape[-1]
        return Keep(alive.nonzero()[:, -1].view(slots.shape[0], slots.shape[1], k))
    if isinstance(decision, KeepHeads):
        raise ValueError("KeepHeads keeps a different number of tokens per head: it has no rectangular Keep")
    raise TypeError(f"not a decision: {decision!r}")


def planned_length(target: int | None, stored: int, granule: int = 1) -> int:
    """What a storage holds after an event where the policy's integer rule says ``target`` (None:
    no eviction), for a storage that frees tokens in whole groups of ``granule`` (blocks): the
    least count ``>= target`` whose difference from ``stored`` is a multiple of ``granule``."""
    if target is None or target >= stored:
        return stored
    return stored - granule * ((stored - target) // granule)


def paged_kept(target: int | None, stored: int, block_size: int) -> int:
    """Tokens a paged storage (blocks of ``block_size`` tokens) storing ``stored`` keeps when a policy's
    rule says ``target`` (None: no eviction): the least count at or above ``target`` that frees whole
    blocks, freeing neither the first block (a paged engine knows a sequence by it) nor the last (the
    next token is written into it). The vLLM plugin's rule (``kvtrim.integrations.vllm.plan``); a
    ``KVTrimCache`` given ``block_size`` rounds the same way, to compare the two engines."""
    kept = planned_length(target, stored, block_size)
    held = -(-stored // block_size)
    return max(kept, stored - block_size * max(0, held - 2))
