"""The transformers storage of kvtrim's cache: one full-attention layer's keys and values.

``CompressedLayer`` physically holds only the kept tokens (evicted keys and values leave the
tensors; the memory is freed, not masked), per KV head: tensors are ``[batch, kv_heads, stored,
head_dim]`` and each KV head may keep a different set of tokens (all heads keep the same number, so
the tensors stay rectangular). Each stored token carries its stream index (``positions``); under the
``reassigned`` and ``compressed`` position policies also the position its key is rotated at
(``rotations``, ``kvtrim.rerotation``).

A policy never touches it: its hooks read :attr:`CompressedLayer.view` (a read-only
``kvtrim.decisions.LayerView``) and return decisions, which :meth:`CompressedLayer.apply` carries
out, picking the cheapest way by the decision's kind:

* :class:`~kvtrim.decisions.Keep` - gather the kept slots; only the shorter side of the dropped
  slots moves (``keep_indices``);
* :class:`~kvtrim.decisions.DropLead` of one token - the lead slots move up by one in the same
  allocation (``drop_after_lead``);
* :class:`~kvtrim.decisions.DropSlot` - the shorter side of one slot moves (``drop_slot``);
* :class:`~kvtrim.decisions.DropSlots` under ``true`` positions - the newest tokens fill the holes
  (``drop_slots``); re-rotated keys follow the slot order, so there it is a keep;
* :class:`~kvtrim.decisions.Merge` - keep, then write the merged keys and values.

Each fast path does what the plain keep of the same slots does (``kvtrim.decisions.as_keep``), and
falls back to it where it cannot (batch > 1, a re-allocation that returns memory).

The layer belongs to a cache (``kvtrim.cache.KVTrimCache``), from which it reads the position
policy, the rotary embedding, the KV head count and the prompt's spans (:class:`Owner`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from kvtrim.decisions import Decision, DropLead, DropSlot, DropSlots, Keep, LayerView, Merge, ViewOf, as_keep, paged_kept
from kvtrim.errors import KVTrimError
from kvtrim.rerotation import reassign_kept, rotate_incoming
from kvtrim.rope import Rotary
from kvtrim.scores import PromptScores
from kvtrim.spans import SpanSet


class Owner(Protocol):
    """What a layer reads from the cache it belongs to."""

    position_policy: str
    rotary: Rotary | None
    num_kv_heads: int
    spans: SpanSet | None
    layers: list
    block_size: int | None


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

    def __init__(self, cache: Owner, layer_idx: int):
        self.cache = cache
        self.view: LayerView = StorageView(self)
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

    @property
    def head_lengths(self) -> tuple[int, ...] | None:
        """Tokens stored per KV head where the heads hold different numbers, else None (here always
        None; ``kvtrim.ragged_storage``)."""
        return None

    def stored_per_head(self) -> int:
        """Tokens stored per KV head (``length``; for heads of different lengths their mean, rounded up)."""
        return self.length

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
        assert self._pos is not None
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
        start = self.length + self.rot_offset
        self.q_delta = None
        if self._rot is not None:
            extra = kwargs.get("kwargs") or {}
            applied = extra.get("position_ids") if isinstance(extra, dict) else None
            key_states, self.q_delta = rotate_incoming(self.cache.rotary, key_states, start, stream, applied)
        self._reserve(q)
        sl = slice(self.length, self.length + q)
        self.write_new(sl, key_states, value_states)
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
        return self.attention_inputs()

    def write_new(self, slots: slice, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store a forward's new keys and values at ``slots`` (room reserved)."""
        assert self._k is not None and self._v is not None
        self._k[:, :, slots] = key_states
        self._v[:, :, slots] = value_states

    def attention_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What ``update()`` hands the model's attention: every stored key and value."""
        return self.keys, self.values

    def stored_attention(self, query: torch.Tensor, scaling: float,
                         bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's attention computed by the storage over the form it stores, ``(out [B, 1, Hq,
        Dv], probs [B, Hkv, G, 1, S])``, for a call SDPA would compute (no mask); or None: the model's
        attention runs over what :meth:`attention_inputs` handed it. Here always None (it handed every
        key and value); a low-bit storage reads its quantized slots block by block."""
        return None

    def attention_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored key and value for an attention call :meth:`stored_attention` does not compute
        (``key``, ``value``: what :meth:`attention_inputs` handed the model): here they are."""
        return key, value

    def settle(self) -> None:
        """Storage work once a forward's decisions for this layer are applied (a low-bit storage
        packs its full groups, ``kvtrim.lowbit_storage``); nothing here."""

    def element_size(self) -> int:
        """Bytes of one key or value element in the model's dtype."""
        return 0 if self._k is None else self._k.element_size()

    def stored_nbytes(self) -> int:
        """Bytes of the stored keys and values alone (no spare capacity)."""
        if self._k is None or self._v is None:
            return 0
        b, h = self._k.shape[:2]
        return b * h * self.length * (self._k.shape[-1] + self._v.shape[-1]) * self._k.element_size()

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

        # one index set shared by every head (an expanded [1, 1, K] index): index_select is much
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
                self.rot_offset = reassign_kept(self.cache.rotary, self._k[:, :, :k], self._rot[:, :, :k],
                                                self.phase == "decode")
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

    # --- applying a policy's decisions ------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        """Carry out one decision of this layer's policy (see the module docstring for the paths)."""
        if self.drop_in_place(decision):
            return
        if isinstance(decision, Merge):
            self.keep_indices(decision.idx)
            assert self._k is not None and self._v is not None
            self._k[:, :, : self.length] = decision.keys
            self._v[:, :, : self.length] = decision.values
            self.write_states(decision.states)
            return
        elif isinstance(decision, Keep):
            self.keep_indices(decision.idx)
            self.write_states(decision.states)
            return
        assert self._k is not None
        self.keep_indices(as_keep(decision, self.length, self._k.shape[0], self._k.shape[1], self._k.device).idx)

    def drop_in_place(self, decision: Decision) -> bool:
        """Carry out a drop decision by this storage's fast path for its kind (``DropLead``,
        ``DropSlot``, ``DropSlots``: :meth:`drop_lead`, :meth:`drop_slot`, :meth:`fill_dropped`, which
        a subclass overrides with its own layout's); False, having changed nothing, where the path
        does not apply (any other decision too): the caller then keeps the plain keep of its slots."""
        if isinstance(decision, DropLead):
            return self.drop_lead(decision.lead, decision.count)
        if isinstance(decision, DropSlot):
            return self.drop_slot(decision.slot)
        if isinstance(decision, DropSlots):
            return self.fill_dropped(decision.slots)
        return False

    def drop_lead(self, lead: int, count: int) -> bool:
        """Slots ``lead:lead + count`` dropped in place: one slot (:meth:`drop_after_lead`); else False."""
        return count == 1 and self.drop_after_lead(lead)

    def fill_dropped(self, drop: torch.Tensor) -> bool:
        """:meth:`drop_slots` where it applies (batch 1, no re-assigned rotations); else False."""
        if self._rot is not None or drop.shape[0] != 1:
            return False
        self.drop_slots(drop)
        return True

    def write_states(self, states) -> None:
        """Set per-token states ``{name: [B, H, stored]}`` (created where new)."""
        for name, t in states.items():
            self.new_token_state(name, t.dtype)
            self.state_view(name)[:] = t

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

    # --- what persistence reads and restores ------------------------------------------------------
    @property
    def rotated(self) -> bool:
        """Whether the layer keeps each key's rotation apart from its stream index."""
        return self._rot is not None or (not self.is_initialized and self.cache.position_policy != "true")

    def restore(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                rotations: torch.Tensor | None, states: dict[str, torch.Tensor], *, seen: int, phase: str,
                n_new: int, state: dict) -> None:
        """Rebuild the buffers from stored tensors (``kvtrim.persistence`` has checked them), with the
        usual slack, on the device of ``keys``."""
        n = keys.shape[2]
        cap = n + self.slack(n)
        dev = keys.device

        def buf(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty(*t.shape[:2], cap, *t.shape[3:])
            out[:, :, :n] = t
            return out

        self.seen, self.phase, self.n_new, self.state = seen, phase, n_new, state
        self.device = dev
        self._k, self._v, self._pos = buf(keys), buf(values.to(dev)), buf(positions.to(dev))
        self._rot = buf(rotations.to(dev)) if rotations is not None else None
        if rotations is not None and n and self.cache.position_policy == "reassigned":
            self.rot_offset = int(rotations[0, 0, -1]) - (n - 1)  # the newest key's (keep_indices)
        self.token_state = {x: buf(t.to(dev)) for x, t in states.items()}
        self.length = n
        self.is_initialized = True
        self.awaiting_attention = False


class StorageView(ViewOf):
    """The read-only :class:`~kvtrim.decisions.LayerView` of a :class:`CompressedLayer` that its
    policy's hooks receive."""

    __slots__ = ()

    keys = property(lambda self: self._layer.keys)
    values = property(lambda self: self._layer.values)
    rotations = property(lambda self: self._layer.rotations)
    position_policy = property(lambda self: self._layer.cache.position_policy)
    rotary = property(lambda self: self._layer.cache.rotary)
    spans = property(lambda self: self._layer.cache.spans)
    n_layers = property(lambda self: len(self._layer.cache.layers))

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._layer.new_token_state(name, dtype)

    def state_view(self, name: str) -> torch.Tensor:
        return self._layer.state_view(name)

    def has_token_state(self, name: str) -> bool:
        return name in self._layer.token_state

    def round_budget(self, budget: int) -> int:
        bs = self._layer.cache.block_size  # contiguous buffers hold any count, unless asked to round as blocks
        return budget if bs is None else paged_kept(budget, self._layer.length, bs)

    def other(self, layer_idx: int) -> LayerView | None:
        layer = self._layer.cache.layers[layer_idx]
        return layer.view if isinstance(layer, CompressedLayer) else None

