"""The transformers storage for per-head budgets: a layer whose KV heads store different numbers of tokens.

``RaggedLayer`` is a :class:`~kvtrim.storage.CompressedLayer` (one rectangular ``[1, H, C, D]``
buffer per layer) until its policy returns a :class:`~kvtrim.decisions.KeepHeads` whose heads keep
different counts (``kvtrim.policies.head_budgets``). From then on it holds one buffer per KV head:

* ``keys[h]`` ``[C_h, D]``, ``values[h]`` ``[C_h, Dv]``, ``positions[h]`` ``[C_h]`` int64 (the
  stream index of each stored token), of which the first ``head_lengths[h]`` slots are stored, in
  stream order; ``C_h`` is the head's count plus the usual slack (``CompressedLayer.slack``), so the
  memory of the dropped tokens is returned, not masked: ``nbytes`` and ``stored_nbytes`` are sums
  over the heads' own buffers.
* A forward's new tokens are appended to every head (``update``); ``length`` is the longest head
  (what a rectangular mask of the forward must cover; transformers builds one from it).
* Attention (:meth:`RaggedLayer.attend`) runs one SDPA call per KV head: the ``G`` query heads of
  its group are laid out as ``G * q`` rows against that head's keys (no copy of the keys), with the
  bottom-right causal mask of the head's own length repeated for each query head; a decode step
  (``q = 1``) needs no mask. The reference it is tested against is SDPA over the heads padded to
  the longest and masked (``tests/test_ragged_storage.py``).
* The policy reads it through :class:`RaggedView`: ``head_lengths`` and ``head(h)``, a one-head
  rectangular view per head.

What it does not hold, each refused with one ``KVTrimError`` line: per-token states (``LOGIT_BIAS``
and others: no method with per-head budgets keeps them), re-assigned rotations (the ``true``
position policy only), batch > 1 (as ``CompressedLayer``), hidden-state pruning, and decisions
other than ``Keep`` / ``KeepHeads`` once ragged. Saving it is refused by ``kvtrim.persistence``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtrim.decisions import Decision, Keep, KeepHeads, LayerView
from kvtrim.errors import KVTrimError
from kvtrim.storage import CompressedLayer, StorageView


def causal_rows(n: int, m: int, groups: int, device) -> torch.Tensor:
    """Boolean ``[groups * n, m]`` (True = may attend): the bottom-right causal mask of ``n`` queries
    that are the last ``n`` of ``m`` keys, once per query head of a group (rows head-major)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n).repeat(groups, 1)


class RaggedLayer(CompressedLayer):
    """A full-attention layer whose KV heads may store different numbers of tokens (module docstring)."""

    def __init__(self, cache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.view = RaggedView(self)
        # None while rectangular (the CompressedLayer buffers); per KV head once ragged
        self.head_k: list[torch.Tensor] | None = None
        self.head_v: list[torch.Tensor] = []
        self.head_pos: list[torch.Tensor] = []
        self.head_len: list[int] = []

    @property
    def ragged(self) -> bool:
        return self.head_k is not None

    @property
    def head_lengths(self) -> tuple[int, ...] | None:
        """Tokens stored per KV head once ragged, else None (every head stores ``length``)."""
        return tuple(self.head_len) if self.ragged else None

    def _refuse_rectangular(self, what: str):
        raise KVTrimError(f"layer {self.layer_idx} keeps a different number of tokens per KV head (per-head budgets): "
                          f"it has no rectangular {what}")

    @property
    def keys(self) -> torch.Tensor | None:
        return self._refuse_rectangular("keys") if self.ragged else super().keys

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("RaggedLayer.keys is read-only")

    @property
    def values(self) -> torch.Tensor | None:
        return self._refuse_rectangular("values") if self.ragged else super().values

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("RaggedLayer.values is read-only")

    @property
    def positions(self) -> torch.Tensor:
        return self._refuse_rectangular("positions") if self.ragged else super().positions

    @property
    def rotations(self) -> torch.Tensor:
        return self._refuse_rectangular("rotations") if self.ragged else super().rotations

    def head_tensors(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head ``h``'s stored keys ``[S_h, D]``, values ``[S_h, Dv]`` and positions ``[S_h]`` (views)."""
        assert self.head_k is not None
        n = self.head_len[h]
        return self.head_k[h][:n], self.head_v[h][:n], self.head_pos[h][:n]

    # --- transformers' side -------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the forward's tokens; once ragged, to every head's buffer, and hand the model the new
        keys and values only (the attention is :meth:`attend`'s, over each head's own buffer)."""
        if not self.ragged:
            return super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[0] != 1:
            return super().update(key_states, value_states, *args, **kwargs)  # CompressedLayer's batch refusal
        if self._next_positions is not None:
            raise KVTrimError("per-head budgets do not combine with hidden-state pruning (fastv, hae)")
        assert self.head_k is not None
        q = key_states.shape[-2]
        stream = torch.arange(self.seen, self.seen + q, device=key_states.device)
        for h in range(len(self.head_k)):
            n = self.head_len[h]
            if n + q > self.head_k[h].shape[0]:
                self._realloc_head(h, n + q + self.slack(n + q))
            self.head_k[h][n:n + q] = key_states[0, h]
            self.head_v[h][n:n + q] = value_states[0, h]
            self.head_pos[h][n:n + q] = stream
            self.head_len[h] = n + q
        self.q_delta = None
        self.phase = "decode" if q == 1 else "turn"
        self.n_new = q
        self.length = max(self.head_len)
        self.seen += q
        self.awaiting_attention = True
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of this forward's queries (``[1, Hq, q, D]``, the newest ``q`` tokens of every head)
        over each head's stored keys and values, causal: ``[1, q, Hq, Dv]`` (transformers'
        attention-function layout), in the query's dtype. One SDPA call per KV head."""
        assert self.head_k is not None
        n_kv, n = len(self.head_k), query.shape[-2]
        g = query.shape[1] // n_kv
        outs = []
        for h in range(n_kv):
            k, v, _ = self.head_tensors(h)
            q = query[0, h * g:(h + 1) * g].reshape(1, 1, g * n, -1)  # [1, 1, G*q, D]: rows head-major
            mask = None if n == 1 else causal_rows(n, k.shape[0], g, query.device)
            o = F.scaled_dot_product_attention(q, k.to(query.dtype)[None, None], v.to(query.dtype)[None, None],
                                               attn_mask=mask, scale=scaling)
            outs.append(o.view(g, n, -1))
        return torch.cat(outs).transpose(0, 1).unsqueeze(0)  # [1, q, Hq, Dv]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, self.seen - self.length

    # --- decisions ------------------------------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        if isinstance(decision, KeepHeads):
            self.keep_heads(decision.idx)
            return
        if not self.ragged:
            super().apply(decision)
            return
        if isinstance(decision, Keep) and not decision.states:
            self.keep_heads(tuple(decision.idx[0]))
            return
        raise KVTrimError(f"layer {self.layer_idx} keeps a different number of tokens per KV head; it applies Keep "
                          f"and KeepHeads (without per-token states) only, not {type(decision).__name__}")

    def keep_heads(self, idx: tuple[torch.Tensor, ...]) -> None:
        """Keep, in head ``h``, its slots ``idx[h]`` (``[K_h]``, ascending); each head's buffer is
        re-allocated at its own count plus slack where that returns memory. The first such keep turns
        the rectangular buffers into per-head ones (and frees them)."""
        if self.token_state:
            raise KVTrimError(f"layer {self.layer_idx}: per-head budgets do not hold per-token states "
                              f"({', '.join(sorted(self.token_state))})")
        if self._rot is not None:
            raise KVTrimError("per-head budgets need the 'true' position policy")
        if not self.ragged:
            assert self._k is not None and self._v is not None and self._pos is not None
            if self._k.shape[0] != 1:
                raise KVTrimError("per-head budgets keep one sequence per cache (batch 1)")
            if len(idx) != self._k.shape[1]:
                raise ValueError(f"KeepHeads gives {len(idx)} heads; the layer has {self._k.shape[1]}")
            keys, values, pos = self._k[0, :, : self.length], self._v[0, :, : self.length], self._pos[0, :, : self.length]
            self.head_k, self.head_v, self.head_pos = [keys[h] for h in range(len(idx))], \
                [values[h] for h in range(len(idx))], [pos[h] for h in range(len(idx))]
            self.head_len = [self.length] * len(idx)
            self._k = self._v = self._pos = None  # the rectangular buffers go once every head is copied out
            force = True
        else:
            force = False
        assert self.head_k is not None
        if len(idx) != len(self.head_k):
            raise ValueError(f"KeepHeads gives {len(idx)} heads; the layer has {len(self.head_k)}")
        for h, ix in enumerate(idx):
            n, k = self.head_len[h], int(ix.shape[-1])
            if k > n:
                raise ValueError("cannot keep more tokens than a head stores")
            cap = k + self.slack(k)
            kb, vb, pb = self.head_k[h], self.head_v[h], self.head_pos[h]
            if force or kb.shape[0] > k + 2 * self.slack(k):  # a new allocation of the kept size
                new_k, new_v, new_p = kb.new_empty(cap, kb.shape[-1]), vb.new_empty(cap, vb.shape[-1]), pb.new_empty(cap)
            else:
                new_k, new_v, new_p = kb, vb, pb
            # index_select copies the kept rows out first, so writing them back in place is safe
            new_k[:k] = kb[:n].index_select(0, ix)
            new_v[:k] = vb[:n].index_select(0, ix)
            new_p[:k] = pb[:n].index_select(0, ix)
            self.head_k[h], self.head_v[h], self.head_pos[h], self.head_len[h] = new_k, new_v, new_p, k
        self.length = max(self.head_len)

    def _realloc_head(self, h: int, cap: int) -> None:
        assert self.head_k is not None
        n = self.head_len[h]

        def grow(t: torch.Tensor) -> torch.Tensor:
            new = t.new_empty(cap, *t.shape[1:])
            new[:n] = t[:n]
            return new

        self.head_k[h], self.head_v[h], self.head_pos[h] = grow(self.head_k[h]), grow(self.head_v[h]), grow(self.head_pos[h])

    def drop_in_place(self, decision: Decision) -> bool:
        return False if self.ragged else super().drop_in_place(decision)

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.ragged:
            raise KVTrimError(f"layer {self.layer_idx}: per-head budgets do not hold per-token states ({name})")
        return super().new_token_state(name, dtype)

    # --- bytes ------------------------------------------------------------------------------------------
    def element_size(self) -> int:
        return self.head_k[0].element_size() if self.head_k else super().element_size()

    def stored_nbytes(self) -> int:
        """Bytes of the stored keys and values: the sum over the heads of their count times a token's."""
        if not self.head_k:
            return super().stored_nbytes()
        per = (self.head_k[0].shape[-1] + self.head_v[0].shape[-1]) * self.head_k[0].element_size()
        return sum(self.head_len) * per

    def nbytes(self) -> int:
        """Resident bytes of the heads' key and value buffers (their allocated capacity)."""
        if not self.head_k:
            return super().nbytes()
        return sum(t.untyped_storage().nbytes() for t in (*self.head_k, *self.head_v))

    def index_nbytes(self) -> int:
        if not self.head_k:
            return super().index_nbytes()
        return sum(t.untyped_storage().nbytes() for t in self.head_pos)

    def stored_per_head(self) -> int:
        """Tokens stored per KV head, the mean over the heads rounded up (``length`` while rectangular)."""
        if not self.head_len:
            return self.length
        return -(-sum(self.head_len) // len(self.head_len))

    def restore(self, *args, **kwargs) -> None:
        self.head_k, self.head_v, self.head_pos, self.head_len = None, [], [], []
        super().restore(*args, **kwargs)


class RaggedView(StorageView):
    """The :class:`~kvtrim.decisions.LayerView` of a :class:`RaggedLayer`: once ragged, ``head_lengths``
    and one-head views (:meth:`head`)."""

    __slots__ = ()

    def head(self, h: int) -> LayerView:
        if not self._layer.ragged:
            return super().head(h)
        return HeadView(self._layer, h)


class HeadView(StorageView):
    """KV head ``h`` of a ragged layer as a rectangular view of one head (``[1, 1, S_h, ...]``); the
    counters, phase, policy state and cache's settings are the layer's."""

    __slots__ = ("_h",)

    def __init__(self, layer: RaggedLayer, h: int):
        super().__init__(layer)
        self._h = h

    keys = property(lambda self: self._layer.head_tensors(self._h)[0][None, None])
    values = property(lambda self: self._layer.head_tensors(self._h)[1][None, None])
    positions = property(lambda self: self._layer.head_tensors(self._h)[2][None, None])
    rotations = positions
    length = property(lambda self: self._layer.head_len[self._h])
    head_lengths = property(lambda self: None)
    attention_scores = property(lambda self: None)  # the layer's prompt scores cover every head together
    decode_probs = property(lambda self: None)

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise KVTrimError("per-head budgets do not hold per-token states")

    def round_budget(self, budget: int) -> int:
        return budget
