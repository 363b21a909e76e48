"""The compressing KV cache for transformers 5.x.

``KVTrimCache`` is a transformers ``Cache`` whose full-attention layers are ``CompressedLayer``
objects. A compressed layer physically holds only the kept tokens (evicted keys and values leave
the tensors; the memory is freed, not masked), per KV head: tensors are
``[batch, kv_heads, stored, head_dim]`` and each KV head may keep a different set of tokens (all
heads keep the same number, so the tensors stay rectangular).

Seen vs stored (docs/methods-spec.md): a layer counts the tokens it has *seen* (the stream index of the
next token) and the tokens it *stores*. ``get_seq_length()`` returns *seen* and
``get_mask_sizes(q)`` returns ``(stored + q, seen - stored)``, which is what transformers' mask
and position code needs for a cache that drops tokens. Each stored token carries its stream
index (``positions``); under the ``reassigned`` and ``compressed`` position policies it also
carries the position its key is rotated at (``rotations``).

Sliding-window layers of hybrid models (``config.layer_types``) keep transformers' own
``DynamicSlidingWindowLayer``: they are bounded already, and policies do not touch them.

Eviction decisions need attention scores, which only the attention function sees. The cache
hands each layer to kvtrim's registered attention function through a context variable set in
``update()``; that function calls ``KVTrimCache.after_attention`` (see ``integrations/hf.py``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.rope import Rotary, find_rotary
from kvtrim.scores import PromptScores

if TYPE_CHECKING:
    from kvtrim.policies.base import Policy
    from kvtrim.spans import SpanSet


class AttentionBinding(Protocol):
    """What ``ACTIVE`` holds for the attention call that runs next.

    ``attend(attend_one, query, key, value, attention_mask)`` returns the attention output and
    weights; ``attend_one(binding, query, key, value, attention_mask)`` is kvtrim's attention for
    one batch-1 cache layer (``binding`` a :class:`LayerBinding`, or None for a layer that is not
    compressed). A single cache attends once; a binding of several caches run as the rows of one
    batch (``kvtrim.integrations.batched``) calls it once per row.
    """

    def attend(self, attend_one: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None) -> tuple: ...


@dataclass
class LayerBinding:
    """One cache's layer whose attention runs next."""

    cache: "KVTrimCache"
    layer: "CompressedLayer"

    def attend(self, attend_one, query, key, value, attention_mask) -> tuple:
        return attend_one(self, query, key, value, attention_mask)


# Set by KVTrimCache.update() for the layer whose attention runs next; consumed (and cleared) by
# kvtrim's attention function. A context variable keeps concurrent generations apart.
# Name of the optional per-token state that kvtrim's attention function adds to every query's
# attention logit for that key (``[B, H_kv, stored]``; e.g. ``log(bucket size)`` for a merged key,
# so that it weighs as much as the tokens it stands for). New tokens get 0.
LOGIT_BIAS = "logit_bias"

ACTIVE: contextvars.ContextVar[AttentionBinding | None] = contextvars.ContextVar("kvtrim_active_layer", default=None)


def buffer_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``[B=1, H, C, ...]`` buffer (or a view of one that starts later along C) as rows: a 2-D view
    ``[rows, width]`` over its storage in which slot ``s`` of head ``h`` is row ``h * per + s``;
    returns the view and ``per`` (the rows between heads)."""
    width = t.stride(2)
    per = t.stride(1) // width
    return t.as_strided(((t.shape[1] - 1) * per + t.shape[2], width), (width, 1)), per


class CompressedLayer(CacheLayerMixin):
    """One full-attention layer's KV storage, with capacity-managed buffers.

    Buffers grow with a slack of ``slack(n)`` tokens (1/16 of the size, between 8 and 256), so
    appending a decoded token does not copy the whole cache (unlike ``torch.cat``); after a
    compression that frees more than twice the slack, the buffers are re-allocated at the smaller
    size so the memory is returned.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    @staticmethod
    def slack(n: int) -> int:
        """Spare slots allocated beyond ``n`` stored tokens."""
        return max(8, min(256, n // 16))

    def __init__(self, cache: "KVTrimCache", layer_idx: int):
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = False
        self.seen = 0
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # int64 [B, H, C]: stream index of each stored token
        self._rot: torch.Tensor | None = None  # int64 [B, H, C]: position each key is rotated at
        # under ``reassigned``: the key of in-cache slot i is rotated at i + rot_offset (0 after a
        # prompt; a decode-time eviction raises it instead of re-rotating every kept key, see keep_indices)
        self.rot_offset = 0
        self.token_state: dict[str, torch.Tensor] = {}  # policy per-token state, [B, H, C]
        self.state: dict = {}  # policy per-layer state
        # the rotation the query of this forward needs: one int for every query (a decode step), or [B, q]
        self.q_delta: torch.Tensor | int | None = None
        # float32 [B, Hkv, G, 1, S]: this decode step's attention probabilities, while the policy's
        # hook runs, when the policy asked for them (Policy.wants_decode_probs; kvtrim.scores.decode_attention)
        self.decode_probs: torch.Tensor | None = None
        # the scores a prefill's attention computed from its own probabilities (fused scoring), while
        # the policy's hook runs, when the policy asked for them (Policy.wants_prefill_scores)
        self.attention_scores: PromptScores | None = None
        self.n_new = 0
        self.phase = "prefill"
        self.awaiting_attention = False
        # set by expect_positions(): the stream indices of the tokens the next update() receives,
        # and how many tokens that forward really covers
        self._next_positions: torch.Tensor | None = None
        self._next_seen = 0

    # --- views -----------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("CompressedLayer.keys is read-only; use keep_indices()")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("CompressedLayer.values is read-only; use keep_indices()")

    @property
    def positions(self) -> torch.Tensor:
        """Stream index of each stored token, ``[B, H, stored]`` (int64)."""
        assert self._pos is not None
        return self._pos[:, :, : self.length]

    @property
    def rotations(self) -> torch.Tensor:
        """Position each stored key is rotated at, ``[B, H, stored]``; equals ``positions`` under ``true``."""
        if self._rot is None:
            return self.positions
        return self._rot[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    # --- CacheLayerMixin API -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty(b, h, 0, d)
        self._v = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self._pos = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        if self.cache.position_policy != "true":
            self._rot = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise KVTrimError(
                f"KVTrimCache supports batch size 1 (got {key_states.shape[0]} sequences: a batch of prompts, or one "
                "prompt expanded by beam search (num_beams > 1) or num_return_sequences > 1): token-level eviction "
                "keeps a different token set per sequence, which transformers' padding masks cannot express. "
                "Run one sequence per cache, with greedy decoding or sampling."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None and self._pos is not None
        q = key_states.shape[-2]
        dev = key_states.device
        n_seen = q
        # a decode step keeps its bookkeeping in Python integers: a few tensor ops fewer per layer and
        # step, which the step time of a short cache notices
        stream: torch.Tensor | int
        if self._next_positions is not None:  # earlier layers pruned this forward's hidden states
            if self._next_positions.numel() != q:
                raise KVTrimError(
                    f"layer {self.layer_idx}: pruned hidden states carry {q} tokens but {self._next_positions.numel()} "
                    "positions were recorded"
                )
            stream, n_seen = self._next_positions.to(dev), self._next_seen
            self._next_positions = None
        elif q == 1:
            stream = self.seen
        else:
            stream = torch.arange(self.seen, self.seen + q, device=dev)
        self.q_delta = None
        start = self.length + self.rot_offset
        if self._rot is not None:
            extra = kwargs.get("kwargs") or {}
            applied = extra.get("position_ids") if isinstance(extra, dict) else None
            if q == 1:  # a decode step: one shift for the key and the query, angles memoised
                if d := start - (int(stream) if applied is None else int(applied.reshape(-1)[-1])):
                    assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
                    key_states = self.cache.rotary.rotate_by(key_states, d)
                    self.q_delta = d
            else:
                assert isinstance(stream, torch.Tensor)
                applied = stream.unsqueeze(0) if applied is None else applied.reshape(-1, q)[-1:].to(dev)
                delta = torch.arange(start, start + q, device=dev).unsqueeze(0) - applied
                if bool((delta != 0).any()):
                    assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
                    key_states = self.cache.rotary.rotate(key_states, delta.unsqueeze(1))
                    self.q_delta = delta
        self._reserve(q)
        sl = slice(self.length, self.length + q)
        self._k[:, :, sl] = key_states
        self._v[:, :, sl] = value_states
        self._pos[:, :, sl] = stream
        if self._rot is not None:
            self._rot[:, :, sl] = start if q == 1 else torch.arange(start, start + q, device=dev)
        for t in self.token_state.values():
            t[:, :, sl] = 0
        self.phase = "prefill" if self.seen == 0 else ("decode" if q == 1 else "turn")
        self.n_new = q
        self.length += q
        self.seen += n_seen
        self.awaiting_attention = True
        return self.keys, self.values

    def expect_positions(self, positions: torch.Tensor, seen: int) -> None:
        """The next ``update()`` carries the tokens at stream indices ``positions`` (``[n]``, ascending)
        of a forward that covers ``seen`` tokens: the others were dropped from the hidden states
        before this layer (``kvtrim.integrations.pruning``), yet the layer has seen them all."""
        self._next_positions = positions
        self._next_seen = int(seen)

    def incoming_tokens(self, n_new: int) -> int:
        """Tokens the forward feeding ``n_new`` tokens to this layer covers (more when pruned)."""
        return self._next_seen if self._next_positions is not None else n_new

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, self.seen - self.length

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx)  # type: ignore[misc]  # reset = re-run __init__: every field back to its start

    def offload(self):  # pragma: no cover - CPU/GPU offloading is not supported
        raise KVTrimError("KVTrimCache does not support offloading")

    def prefetch(self):  # pragma: no cover
        raise KVTrimError("KVTrimCache does not support offloading")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVTrimError("KVTrimCache does not support beam search (num_beams > 1); use greedy or sampling.")

    # --- storage management ------------------------------------------------------------------
    def _realloc(self, cap: int) -> None:
        def grow(t: torch.Tensor) -> torch.Tensor:
            new = t.new_empty(*t.shape[:2], cap, *t.shape[3:])
            new[:, :, : self.length] = t[:, :, : self.length]
            return new

        assert self._k is not None and self._v is not None and self._pos is not None
        self._k, self._v, self._pos = grow(self._k), grow(self._v), grow(self._pos)
        if self._rot is not None:
            self._rot = grow(self._rot)
        self.token_state = {n: grow(t) for n, t in self.token_state.items()}

    def _start(self) -> int:
        """Slots that decode evictions freed before the start of the buffers (``keep_indices``): the
        buffers are views that many slots into their allocation until ``_reserve`` moves them back."""
        return 0 if self._k is None else self._k.storage_offset() // self._k.stride(2)

    def _reserve(self, n: int) -> None:
        if self.length + n <= self.capacity:
            return
        start = self._start()
        if start and self.length + n <= self.capacity + start:
            # move the stored slots back to the beginning of the same allocation (the copy a
            # re-allocation would make, without one): the allocated size changes only as before
            def back(t: torch.Tensor) -> torch.Tensor:
                whole = t.as_strided((*t.shape[:2], t.shape[2] + start, *t.shape[3:]), t.stride(),
                                     t.storage_offset() - start * t.stride(2))
                whole[:, :, : self.length] = t[:, :, : self.length].clone()
                return whole

            assert self._k is not None and self._v is not None and self._pos is not None
            self._k, self._v, self._pos = back(self._k), back(self._v), back(self._pos)
            if self._rot is not None:
                self._rot = back(self._rot)
            self.token_state = {name: back(t) for name, t in self.token_state.items()}
            return
        self._realloc(self.length + n + self.slack(self.length + n))

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Create (or return) a per-token state aligned with the stored tokens: ``[B, H, capacity]``."""
        if name not in self.token_state:
            assert self._k is not None, "per-token state is created after the first update()"
            b, h = self._k.shape[:2]
            start = self._start()  # laid out like the keys (see _start)
            whole = torch.zeros(b, h, self.capacity + start, dtype=dtype, device=self._k.device)
            self.token_state[name] = whole[:, :, start:]
        return self.token_state[name]

    def state_view(self, name: str) -> torch.Tensor:
        """The stored part of a per-token state, ``[B, H, stored]``."""
        return self.token_state[name][:, :, : self.length]

    def keep_indices(self, idx: torch.Tensor, reassign: bool | None = None) -> None:
        """Keep only the slots ``idx`` (``[B, H, K]``, ascending per head); free the rest.

        Under the ``reassigned`` position policy the kept keys are re-rotated to in-cache
        positions: ``0..K-1`` after a prompt or turn; during decoding, ``o..o+K-1`` with the offset
        ``o = rot_offset`` chosen so that the oldest kept key keeps its rotation, or the newest where
        that re-rotates at most a quarter as many keys (attention depends only on the query-key
        position difference, and each new query is rotated by ``o`` too). A decode step that evicts a few
        tokens then re-rotates only the keys on one side of them (StreamingLLM: the sinks; Elastic
        Cache: the tail after its fixed point), not every kept key.

        Without re-allocation only one side of the dropped slots moves, the shorter: the slots before
        the first dropped one (in every head) stay in place and the later kept ones move down, or
        (decoding) the slots after the last dropped one stay and the earlier kept ones move up (the
        buffers then start that many slots later). An eviction near either end of the cache (Elastic
        Cache's fixed point, StreamingLLM's oldest window token after the sinks) copies a few
        rows, not the cache.
        """
        k = idx.shape[-1]
        if k > self.length:
            raise ValueError("cannot keep more tokens than are stored")
        shrink = self.capacity > k + 2 * self.slack(k)
        cap = k + self.slack(k)
        m = self.length - k  # tokens dropped per head

        # one index set shared by every head (an expanded [1, 1, K] index): index_select is ~10x
        # faster than a gather with an expanded index (batch > 1 only: at batch 1 the flat path below)
        shared = idx.shape[0] == 1 and (idx.shape[1] == 1 or idx.stride(1) == 0)
        # Without re-allocation only part of the slots move: either the kept slots after the leading
        # ones that stay in place (``lead``), or the kept slots before the trailing ones that only
        # shift down by m (``tail``): those are then moved up by m and the buffers start m slots later
        # (a view; the m dead slots are freed at the next re-allocation). StreamingLLM drops the
        # token after its sinks: the sinks move, not the window.
        lead, tail = 0, k
        if not shrink and k:
            slots = torch.arange(k, device=idx.device)
            moved = (idx != slots).reshape(-1, k).any(dim=0).to(torch.int8)
            lead = int(moved.argmax()) if bool(moved.any()) else k
            shifted = (idx != slots + m).reshape(-1, k).any(dim=0).to(torch.int8)
            tail = k - int(shifted.flip(0).argmax()) if bool(shifted.any()) else 0
        from_front = self.phase == "decode" and idx.shape[0] == 1 and m > 0 and tail < k - lead
        part = slice(0, tail) if from_front else slice(lead, k)  # the new slots written
        sub = idx[..., part]  # their old slots
        n_sub = sub.shape[-1]

        def take(t: torch.Tensor) -> torch.Tensor:
            if n_sub == 0:
                return t[:, :, m:] if from_front else t
            if idx.shape[0] == 1 and t.stride(-1) == 1:
                # batch 1, per-head or shared index sets: one index_select over the rows of the
                # buffer (several times faster than a gather with an expanded index, and than an
                # index_select along the slot axis of a buffer with spare capacity)
                rows, per = buffer_rows(t)
                h = t.shape[1]
                flat = (sub[0].expand(h, -1) + torch.arange(h, device=idx.device).unsqueeze(1) * per).reshape(-1)
                got = rows.index_select(0, flat).view(1, h, n_sub, *t.shape[3:])
            elif shared:
                got = t[:, :, : self.length].index_select(2, sub[0, 0])
            else:
                ix = sub if t.dim() == 3 else sub.unsqueeze(-1).expand(*sub.shape, t.shape[-1])
                got = torch.gather(t[:, :, : self.length], 2, ix)
            if from_front:
                new = t[:, :, m:]
            else:
                new = t.new_empty(*t.shape[:2], cap, *t.shape[3:]) if shrink else t
            new[:, :, part] = got
            return new

        assert self._k is not None and self._v is not None and self._pos is not None
        self._k = take(self._k)
        self._v = take(self._v)
        self._pos = take(self._pos)
        self.token_state = {n: take(t) for n, t in self.token_state.items()}
        if self._rot is not None:
            self._rot = take(self._rot)
            do_reassign = self.cache.position_policy == "reassigned" if reassign is None else reassign
            if do_reassign:
                rot = self._rot[:, :, :k]
                slots = torch.arange(k, device=idx.device)

                def span(offset: int) -> tuple[int, int, torch.Tensor]:
                    """The slots whose rotation changes for this offset, as a range, and the deltas."""
                    delta = (slots + offset) - rot
                    per_slot = (delta != 0).reshape(-1, k).any(dim=0).to(torch.int8)
                    if not bool(per_slot.any()):
                        return 0, 0, delta
                    return int(per_slot.argmax()), k - int(per_slot.flip(0).argmax()), delta

                # after a prompt: positions 0..K-1; during decoding keep the oldest key's rotation (as
                # before offsets existed: slots before an eviction stay bit for bit), or the newest
                # key's where that re-rotates at most a quarter as many keys (see the docstring)
                offset = 0 if self.phase != "decode" or not k else int(rot[0, 0, 0])
                first, stop, delta = span(offset)
                if self.phase == "decode" and stop > first:
                    newest = int(rot[0, 0, k - 1]) - (k - 1)
                    alt = span(newest)
                    if 4 * (alt[1] - alt[0]) <= stop - first:
                        offset, (first, stop, delta) = newest, alt
                if stop > first:
                    assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
                    span_ = slice(first, stop)
                    self._k[:, :, span_] = self.cache.rotary.rotate(self._k[:, :, span_], delta[:, :, span_])
                    self._rot[:, :, :k] = slots + offset
                self.rot_offset = offset
        self.length = k

    def drop_after_lead(self, lead: int) -> bool:
        """Drop slot ``lead`` (the oldest token after ``lead`` leading ones, in every head) during
        decoding: what ``keep_indices`` does for that index set (StreamingLLM's step: the token after
        the sinks leaves), without analysing an index. The ``lead`` slots move up by one in the same
        allocation and the buffers start one slot later; under ``reassigned`` the later keys keep
        their rotation (``rot_offset`` grows by one) and only the ``lead`` keys are re-rotated by one
        position. Returns False, having changed nothing, where ``keep_indices`` would do otherwise
        (batch > 1, a re-allocation that returns memory, or a lead too long for keep_indices to
        choose the newest key's rotation); the caller then uses ``keep_indices``.
        """
        k = self.length - 1
        if (self._k is None or self._k.shape[0] != 1 or self.phase != "decode" or not 0 <= lead < k
                or self.capacity > k + 2 * self.slack(k)):
            return False
        reassign = self._rot is not None and self.cache.position_policy == "reassigned"
        if reassign and lead and 5 * lead > k:
            return False  # keep_indices keeps the oldest key's rotation here and re-rotates the rest

        def shift(t: torch.Tensor) -> torch.Tensor:
            new = t[:, :, 1:]
            if lead:
                new[:, :, :lead] = t[:, :, :lead].clone()
            return new

        assert self._k is not None and self._v is not None and self._pos is not None
        self._k, self._v, self._pos = shift(self._k), shift(self._v), shift(self._pos)
        self.token_state = {n: shift(t) for n, t in self.token_state.items()}
        if self._rot is not None:
            self._rot = shift(self._rot)
            if reassign:
                if lead:
                    assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
                    self._k[:, :, :lead] = self.cache.rotary.rotate_by(self._k[:, :, :lead], 1)
                    self._rot[:, :, :lead] += 1
                self.rot_offset += 1
        self.length = k
        return True

    def drop_slot(self, slot: int) -> bool:
        """Drop slot ``slot`` (the same one in every head) during decoding and keep the others in
        order: what ``keep_indices`` does for that index set (Elastic Cache's fixed-point eviction),
        without analysing an index. In the front half it is :meth:`drop_after_lead`; otherwise the
        later slots move down by one in the same allocation and, under ``reassigned``, only they are
        re-rotated (one position back), as ``keep_indices`` chooses there. Returns False, having
        changed nothing, where ``keep_indices`` would do otherwise (batch > 1, a re-allocation that
        returns memory); the caller then uses ``keep_indices``.
        """
        k = self.length - 1
        if not 0 <= slot <= k:
            return False
        if 2 * slot < k:
            return self.drop_after_lead(slot)
        if (self._k is None or self._k.shape[0] != 1 or self.phase != "decode"
                or self.capacity > k + 2 * self.slack(k)):
            return False
        assert self._v is not None and self._pos is not None
        if slot < k:
            moved = slice(slot, k)
            buffers = [self._k, self._v, self._pos, *self.token_state.values()]
            if self._rot is not None:
                buffers.append(self._rot)
            for t in buffers:
                t[:, :, moved] = t[:, :, slot + 1: k + 1].clone()
            if self._rot is not None and self.cache.position_policy == "reassigned":
                assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
                self._k[:, :, moved] = self.cache.rotary.rotate_by(self._k[:, :, moved], -1)
                self._rot[:, :, moved] -= 1
        self.length = k
        return True

    def drop_slots(self, drop: torch.Tensor) -> None:
        """Remove the slots ``drop`` (``[1, H, m]``, distinct per head, few) by moving the newest
        stored tokens into the holes: ``m`` rows per head move instead of every token after the
        first hole (``keep_indices``). The kept set is the same; the slots then no longer hold the
        tokens in stream order (``positions`` stays exact per slot), so this is only for the ``true``
        position policy (re-assigned rotations follow the slot order) and for policies that do not
        read meaning into the slot order (``Policy.stream_ordered_slots``).
        """
        if self._rot is not None:
            raise ValueError("drop_slots needs the 'true' position policy (rotations follow the slot order)")
        if drop.shape[0] != 1:
            raise ValueError("drop_slots supports batch 1")
        h, m = drop.shape[1], drop.shape[2]
        n = self.length
        k = n - m
        if m == 1:
            # a decode step's usual eviction: one slot per head. The newest slot of each head moves
            # into that head's hole (onto itself where the newest is the one dropped): the moves the
            # general path below makes, without its masks and nonzero scans
            hole = drop[0, :, 0]
            for t in (self._k, self._v, self._pos, *self.token_state.values()):
                assert t is not None
                t0 = t[0]  # [H, C] or [H, C, D]; slot k of every head is one strided view
                newest = t0[:, k:k + 1].clone()  # a copy: the hole may be slot k itself
                at = hole.view((h, 1) + (1,) * (t0.dim() - 2)).expand_as(newest)
                t0.scatter_(1, at, newest)
            self.length = k
            return
        dropped = torch.zeros(h, n, dtype=torch.bool, device=drop.device).scatter_(-1, drop[0], True)
        holes = dropped[:, :k].nonzero()  # [r, 2] (head, slot), head-major: the same count per head as
        fill = (~dropped[:, k:]).nonzero()  # the kept tokens beyond the new length, also head-major

        def move(t: torch.Tensor) -> None:
            rows, per = buffer_rows(t)
            rows[holes[:, 0] * per + holes[:, 1]] = rows[fill[:, 0] * per + k + fill[:, 1]]

        assert self._k is not None and self._v is not None and self._pos is not None
        for t in (self._k, self._v, self._pos, *self.token_state.values()):
            move(t)
        self.length = k

    def replace(self, keys: torch.Tensor, values: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep slots ``idx`` but overwrite their keys and values (merging methods)."""
        self.keep_indices(idx)
        assert self._k is not None and self._v is not None
        self._k[:, :, : self.length] = keys
        self._v[:, :, : self.length] = values

    def nbytes(self) -> int:
        """Resident bytes of this layer's key and value buffers (allocated capacity, including the
        slots a decode eviction left before the start of a buffer until its next re-allocation)."""
        if self._k is None or self._v is None:
            return 0
        return self._k.untyped_storage().nbytes() + self._v.untyped_storage().nbytes()

    def index_nbytes(self) -> int:
        """Bytes of kvtrim's bookkeeping (positions, rotations, policy state) for this layer."""
        ts = [self._pos, self._rot, *self.token_state.values()]
        return sum(t.untyped_storage().nbytes() for t in ts if t is not None)

    # --- persistence -----------------------------------------------------------------------------
    PHASES = ("prefill", "turn", "decode")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stored part of this layer's tensors, each contiguous (no spare capacity):

        ``keys`` ``[B, H, stored, D]``, ``values`` ``[B, H, stored, Dv]``, ``positions`` (int64
        ``[B, H, stored]``), ``rotations`` (only under the ``reassigned``/``compressed`` position
        policies) and ``state.<name>`` for each per-token policy state. Empty before the first
        update. :meth:`state_meta` holds the rest; :meth:`load_state_dict` takes both.
        """
        k, v = self.keys, self.values
        if k is None or v is None:
            return {}
        out = {"keys": k.contiguous(), "values": v.contiguous(), "positions": self.positions.contiguous()}
        if self._rot is not None:
            out["rotations"] = self.rotations.contiguous()
        for name in sorted(self.token_state):
            out[f"state.{name}"] = self.state_view(name).contiguous()
        return out

    def state_meta(self) -> dict:
        """What :meth:`state_dict` does not hold: counters, the phase, the names of the per-token
        states and the policy's per-layer ``state`` (as is; a caller that writes it as JSON checks it)."""
        return {"initialized": self.is_initialized, "seen": self.seen, "length": self.length, "phase": self.phase,
                "n_new": self.n_new, "token_state": sorted(self.token_state), "state": self.state}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Replace this layer's contents with a :meth:`state_dict` / :meth:`state_meta` pair.

        Buffers are rebuilt with the usual slack on the device of ``tensors["keys"]``. Raises
        ``KVTrimError`` (and leaves the layer reset) for missing or unexpected entries, shapes that
        disagree with each other, with ``meta["length"]`` or with the cache's KV heads, or counters
        that do not fit (``length <= seen``, every stream index ``< seen``).
        """
        where = f"layer {self.layer_idx}"
        missing = [k for k in ("initialized", "seen", "length", "phase", "n_new", "token_state", "state") if k not in meta]
        if missing:
            raise KVTrimError(f"{where}: saved layer state lacks {', '.join(missing)}")
        self.reset()
        try:
            self._load(tensors, meta, where)
        except BaseException:
            self.reset()
            raise

    def _load(self, tensors: dict[str, torch.Tensor], meta: dict, where: str) -> None:
        seen = validate.integer(meta["seen"], f"{where}: seen", minimum=0)
        n = validate.integer(meta["length"], f"{where}: length", minimum=0, maximum=seen)
        n_new = validate.integer(meta["n_new"], f"{where}: n_new", minimum=0)
        phase = validate.choice(meta["phase"], f"{where}: phase", self.PHASES)
        if not isinstance(meta["state"], dict):
            raise KVTrimError(f"{where}: the policy state must be a dict, got {type(meta['state']).__name__}")
        names = list(meta["token_state"])
        rotated = self.cache.position_policy != "true"
        expected = {"keys", "values", "positions", *(("rotations",) if rotated else ()), *(f"state.{x}" for x in names)}
        if not meta["initialized"]:
            expected = set()
            if n or names:
                raise KVTrimError(f"{where}: an uninitialised layer cannot store {n} tokens or token states {names}")
        if set(tensors) != expected:
            lacking, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise KVTrimError(
                f"{where}: saved tensors do not match the layer (position policy {self.cache.position_policy!r}, "
                f"token states {names}): missing {lacking}, unexpected {extra}"
            )
        self.seen, self.phase, self.n_new, self.state = seen, phase, n_new, dict(meta["state"])
        if not meta["initialized"]:
            return
        k, v = tensors["keys"], tensors["values"]
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise KVTrimError(f"{where}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be [batch, kv_heads, stored, dim]")
        b, h = k.shape[:2]
        if k.shape[2] != n:
            raise KVTrimError(f"{where}: {k.shape[2]} stored keys but length {n}")
        if h != self.cache.num_kv_heads:
            raise KVTrimError(f"{where}: {h} KV heads saved, the model has {self.cache.num_kv_heads}")
        dev = k.device
        index = {name: tensors[name].to(dev) for name in ("positions", "rotations") if name in tensors}
        states = {x: tensors[f"state.{x}"].to(dev) for x in names}
        for name, t in [*index.items(), *((f"state.{x}", t) for x, t in states.items())]:
            if tuple(t.shape) != (b, h, n):
                raise KVTrimError(f"{where}: {name} has shape {tuple(t.shape)}, expected {(b, h, n)}")
        for name, t in index.items():
            if t.dtype != torch.long:
                raise KVTrimError(f"{where}: {name} must be int64, got {t.dtype}")
        pos = index["positions"]
        if n and (int(pos.min()) < 0 or int(pos.max()) >= seen):
            raise KVTrimError(f"{where}: stream indices must lie in [0, {seen}) (tokens seen)")
        cap = n + self.slack(n)

        def buf(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty(*t.shape[:2], cap, *t.shape[3:])
            out[:, :, :n] = t
            return out

        self.device = dev
        self._k, self._v, self._pos = buf(k), buf(v.to(dev)), buf(pos)
        self._rot = buf(index["rotations"]) if rotated else None
        if rotated and n and self.cache.position_policy == "reassigned":
            self.rot_offset = int(index["rotations"][0, 0, -1]) - (n - 1)  # the newest key's (keep_indices)
        self.token_state = {x: buf(t) for x, t in states.items()}
        self.length = n
        self.is_initialized = True
        self.awaiting_attention = False


def _layer_nbytes(layer) -> int:
    if isinstance(layer, CompressedLayer):
        return layer.nbytes()
    if getattr(layer, "keys", None) is None:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


@functools.lru_cache(maxsize=1)
def cache_keyword() -> str:
    """The keyword ``generate``/``forward`` take a cache under: ``cache`` from transformers 5.20, else ``past_key_values``."""
    from importlib.metadata import version

    from packaging.version import Version

    return "cache" if Version(version("transformers")) >= Version("5.20") else "past_key_values"


class KVTrimCache(Cache):
    """A transformers cache that compresses itself according to a kvtrim policy.

    Args:
        model: the model (or its config) the cache is for; the model is needed for position
            re-assignment (its rotary frequencies).
        policy: a ``Policy`` instance or a registered method name (see ``kvtrim methods``).
        **policy_kwargs: passed to the policy when ``policy`` is a name (``keep``, ``max_tokens``,
            ``position`` and method parameters).

    Use it inside ``kvtrim.attach(model)`` (or ``kvtrim.compress``), which installs the attention
    function that scores and evicts; the cache refuses to run without it.
    """

    def kwargs(self) -> dict:
        """The cache as the keyword ``generate`` and ``forward`` take it: ``{"cache": self}`` from
        transformers 5.20 (which deprecates ``past_key_values``), ``{"past_key_values": self}`` before.

        Example: ``model.generate(ids, **cache.kwargs(), max_new_tokens=32)`` warns on no supported version.
        """
        return {cache_keyword(): self}

    # narrower than Cache.layers' element type: __init__ builds only these two kinds of layer
    layers: list[CompressedLayer | DynamicSlidingWindowLayer]  # type: ignore[assignment]
    prefill_stats: Callable[[], dict]  # set by kvtrim.compress(prefill=...): the sparse prefill's counters

    def __init__(self, model, policy: "Policy | str" = "full", *, spans=None, **policy_kwargs):
        from kvtrim.registry import create_policy

        if isinstance(policy, str):
            policy = create_policy(policy, **policy_kwargs)
        elif policy_kwargs:
            raise KVTrimError("pass method parameters either in the Policy object or as keywords with a name, not both")
        config = getattr(model, "config", model)
        text_cfg = config.get_text_config(decoder=True)
        self.policy = policy
        self.position_policy = policy.position_policy
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.num_heads = int(text_cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // self.num_heads)
        self.max_context = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
        # the rotary embedding (verified against the model's own RoPE code): needed by the
        # reassigned/compressed policies; under "true" kept when available for policies that
        # re-rotate keys themselves (Elastic Cache's aligned merge)
        self.rotary: Rotary | None = find_rotary(model) if isinstance(model, torch.nn.Module) else None
        if self.position_policy != "true":
            if not isinstance(model, torch.nn.Module):
                raise KVTrimError(f"position policy {self.position_policy!r} needs the model (its rotary embedding), not a config")
            if self.rotary is None:
                has_rope = any(n.endswith("rotary_emb") for n, _ in model.named_modules())
                why = ("this model's RoPE cannot be re-rotated exactly (multimodal or dynamic scaling, or a rotary "
                       "layout kvtrim does not know)") if has_rope else "kvtrim finds no rotary embedding (a rotary_emb module) in this model to re-rotate"
                raise KVTrimError(
                    f"position policy {self.position_policy!r} re-rotates cached RoPE keys, and {why}. "
                    "Use position='true'."
                )
        layer_types = getattr(text_cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        layers: list = []
        for i, lt in enumerate(layer_types):
            if lt == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=int(text_cfg.sliding_window)))
            elif lt == "full_attention":
                layers.append(CompressedLayer(self, i))
            else:
                raise KVTrimError(f"layer type {lt!r} (layer {i}) is not supported; kvtrim supports full and sliding attention layers")
        super().__init__(layers=layers)
        self._last_layer: CompressedLayer | None = None
        # Modality spans of the prompt (kvtrim.spans.SpanSet): given here, set with set_spans(), or
        # found from the prompt's token ids for vision-language models when the prefill runs.
        self.spans: SpanSet | None = None
        self._raw_spans = spans

    @property
    def inv_freq(self) -> torch.Tensor | None:
        """The rotary inverse frequencies (None when the model's RoPE cannot be re-rotated)."""
        return None if self.rotary is None else self.rotary.inv_freq

    def set_spans(self, spans, n_tokens: int | None = None) -> None:
        """Tag prompt positions with modalities (a ``SpanSet`` or ``(start, end, modality)`` items)."""
        from kvtrim.spans import SpanSet, as_span_set

        if isinstance(spans, SpanSet) and n_tokens is None:
            self.spans, self._raw_spans = spans, None
        elif n_tokens is None:
            self._raw_spans = spans  # validated against the prompt length at prefill
        else:
            self.spans, self._raw_spans = as_span_set(spans, n_tokens), None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        last = self._last_layer
        if last is not None and last.awaiting_attention:
            raise KVTrimError(
                "KVTrimCache was used without kvtrim's attention function, so it cannot score or evict. "
                "Wrap the call in `with kvtrim.attach(model):` (or use kvtrim.compress)."
            )
        layer = self.layers[layer_idx]
        if self._raw_spans is not None and isinstance(layer, CompressedLayer) and not layer.is_initialized:
            n = layer.incoming_tokens(key_states.shape[-2])
            self.set_spans(self._raw_spans, n)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if isinstance(layer, CompressedLayer):
            self._last_layer = layer
            ACTIVE.set(LayerBinding(self, layer))
        return out

    def after_attention(self, layer: CompressedLayer, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Called by kvtrim's attention function once the layer's attention output is computed."""
        layer.awaiting_attention = False
        if self.policy.needs_spans and layer.phase == "prefill":
            # the spans are known by now (given, or found for a VLM when the forward started): a span
            # method on a prompt without its targets would run as full, so it is refused
            from kvtrim.registry import spans_error

            if problem := spans_error(self.policy, self.spans):
                raise KVTrimError(problem)
        self.policy.after_attention(layer, query, key, scaling)

    # --- persistence -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every compressed layer's :meth:`CompressedLayer.state_dict`, keys prefixed ``layers.<i>.``.

        Raises ``KVTrimError`` when a sliding-window layer (transformers' own) holds tokens: those are
        not saved.
        """
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, CompressedLayer):
                out.update({f"layers.{i}.{k}": t for k, t in layer.state_dict().items()})
            elif getattr(layer, "keys", None) is not None:
                raise KVTrimError("saving a cache whose model has sliding-window layers is not supported")
        return out

    def state_meta(self) -> list[dict | None]:
        """Per layer, :meth:`CompressedLayer.state_meta` (``None`` for a sliding-window layer)."""
        return [layer.state_meta() if isinstance(layer, CompressedLayer) else None for layer in self.layers]

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: list[dict | None]) -> None:
        """Restore a :meth:`state_dict` / :meth:`state_meta` pair into this (fresh) cache of the same model."""
        if len(meta) != len(self.layers):
            raise KVTrimError(f"saved state has {len(meta)} layers, the model has {len(self.layers)}")
        per_layer: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            head, _, rest = key.partition(".")
            idx, _, name = rest.partition(".")
            if head != "layers" or not idx.isdigit() or not name or int(idx) >= len(self.layers):
                raise KVTrimError(f"unexpected tensor {key!r} in the saved cache (expected layers.<i>.<name>)")
            per_layer.setdefault(int(idx), {})[name] = t
        for i, (layer, m) in enumerate(zip(self.layers, meta)):
            if (m is None) == isinstance(layer, CompressedLayer):
                raise KVTrimError(f"layer {i}: the saved state and the model disagree on whether this layer is compressed "
                                  "(sliding-window layers are not)")
            if isinstance(layer, CompressedLayer) and m is not None:
                layer.load_state_dict(per_layer.get(i, {}), m)
            elif i in per_layer:
                raise KVTrimError(f"layer {i}: tensors saved for a sliding-window layer")
        self._last_layer = None

    # --- reporting -----------------------------------------------------------------------------
    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def seen_tokens(self) -> int:
        return self.get_seq_length()

    def stored_tokens(self) -> list[int]:
        """Stored tokens per layer (for sliding layers, what the window holds)."""
        return [
            layer.length if isinstance(layer, CompressedLayer) else (0 if layer.keys is None else layer.keys.shape[-2])
            for layer in self.layers
        ]

    def kv_bytes(self) -> int:
        """Resident bytes of all key/value buffers (allocated capacity, not just the used part)."""
        return sum(_layer_nbytes(layer) for layer in self.layers)

    def kv_bytes_stored(self) -> int:
        """Bytes of the stored keys and values only (without spare capacity)."""
        per_tok = 2 * self.num_kv_heads * self.head_dim
        total = 0
        for layer, n in zip(self.layers, self.stored_tokens()):
            el = layer.keys.element_size() if layer.keys is not None else 0
            total += n * per_tok * el
        return total

    def index_bytes(self) -> int:
        """Bytes of kvtrim's bookkeeping tensors (positions, rotations, policy state)."""
        return sum(layer.index_nbytes() for layer in self.compressed_layers)

    def kv_bytes_full(self) -> int:
        """What transformers' uncompressed ``DynamicCache`` would hold for the same tokens."""
        seen = self.get_seq_length()
        per_tok = 2 * self.num_kv_heads * self.head_dim
        total = 0
        for layer in self.layers:
            if layer.keys is None:
                continue
            el = layer.keys.element_size()
            n = min(seen, layer.sliding_window - 1) if isinstance(layer, DynamicSlidingWindowLayer) else seen
            total += n * per_tok * el
        return total
