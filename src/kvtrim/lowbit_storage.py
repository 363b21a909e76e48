"""The low-bit transformers storage: a ``CompressedLayer`` whose keys and values are held in 8, 4 or 2 bits.

A :class:`LowBitLayer` holds a layer's stored tokens in two parts, in slot order:

* the **quantized** slots, a ``kvtrim.attention.lowbit.LowBitKV`` (KIVI's scheme: keys per
  channel in groups of :data:`GROUP` tokens, values per token; each key slot names its group, so a
  slot can be dropped without touching any other);
* the **residual**: the newest tokens in the model's dtype, fewer than :data:`GROUP` once a forward's
  decisions are applied (:meth:`LowBitLayer.settle` quantizes every full group of them).

A forward's new tokens enter the residual, so a prompt's attention, the scores a policy reads at
the prompt, and its decision all see the prompt in full precision; the prompt is quantized after the
decision, from the tokens kept (a group is formed only from survivors, and its scales spend no range
on evicted tokens).

Decisions (``kvtrim.decisions``) are applied as the plain :class:`~kvtrim.decisions.Keep` of the same
slots (``as_keep``): the kept quantized slots are gathered (codes, group ids, value scales; groups
that no slot uses any more are freed), and kept residual tokens stay in the residual. All KV heads
keep the same number of slots but not the same ones, so a head may keep more quantized slots than
another; the quantized part is then as long as the head that keeps fewest, and the other heads' extra
quantized slots move to the residual as their dequantized values (exact: a dequantized value is what
the quantized one stands for) until the next full group is packed with them. A ``Merge`` rewrites
every kept key and value, so they all go to the residual and are packed again.

A decode step's few drops of quantized slots are carried out in place instead, as the plain keep
would leave them: ``DropLead`` (StreamingLLM) and a front-half ``DropSlot`` (Elastic Cache) move the
lead slots and view every per-slot tensor from one slot later (:meth:`LowBitLayer.drop_lead`),
``DropSlots`` (H2O) under ``true`` positions moves each head's last quantized slots into its holes
(:meth:`LowBitLayer.fill_dropped`); a key group whose last slot leaves is freed as the gather frees
it. The freed slots stay in the quantized part's allocation (and in ``nbytes``) until the next group
is packed, which allocates it anew; at most a group's slots (or twice the slack), else the step
gathers and the memory is returned.

Under the ``reassigned`` position policy kept keys are re-rotated after an eviction
(``kvtrim.rerotation``). A quantized key is not re-quantized for that: the layer records the
rotation each quantized key was packed at and turns it to its current rotation when it is read
(``keys``, and block by block in the decode attention), so a stream that evicts every step never
accumulates rounding.

The decode step's attention reads the quantized slots block by block
(``kvtrim.attention.lowbit.lowbit_decode_attention``, called by kvtrim's attention function through
:meth:`LowBitLayer.decode_attention`); ``update()`` then hands the model only the residual. A prompt's
or turn's attention gets every key and value dequantized (its attention reads them all anyway).
"""

from __future__ import annotations

import torch

from kvtrim.attention.lowbit import BITS, KeyRotation, LowBitKV, lowbit_decode_attention, take_slots
from kvtrim.decisions import Decision, Keep, Merge, as_keep
from kvtrim.errors import KVTrimError
from kvtrim.rerotation import reassign_plan
from kvtrim.storage import CompressedLayer, Owner

#: tokens per key group. KIVI's setting: at 2 bits it is the group its authors found to keep quality
#: (larger groups stretch each channel's range over more tokens); a float16 scale and zero point per
#: channel and group then cost 1 bit per key element, and at most 31 tokens wait in the model's
#: dtype for their group.
GROUP = 32


def byte_share(bits: int, head_dim: int) -> float:
    """Bytes per stored token and KV head of a ``bits``-bit layer over a 16-bit one's, from this
    storage's layout: codes of ``2 * head_dim * bits / 8`` bytes, a 4-byte group id and 4 bytes of
    value scale and zero point per token; 4 bytes per key channel per ``GROUP`` tokens (the residual's
    fewer than ``GROUP`` full-precision tokens left out). A float32 model's cache is twice a 16-bit
    one's, so there the share is half this. ``--quality`` ranks (keep, bits) by it where a
    calibration has no measured bytes (``kvtrim.budget``)."""
    d = head_dim
    return (2 * d * bits / 8 + 4 + 4 + 4 * d / GROUP) / (2 * d * 2)


class LowBitLayer(CompressedLayer):
    """One full-attention layer's KV storage in ``bits`` (8, 4 or 2) bits (see the module docstring).

    Bookkeeping (stream indices, rotations, per-token policy states) is kept per slot as in
    ``CompressedLayer``; keys and values are the quantized part followed by the residual.
    """

    def __init__(self, cache: Owner, layer_idx: int, bits: int = 4, group: int = GROUP):
        if bits not in BITS:
            raise KVTrimError(f"kv_bits must be one of 16, {', '.join(map(str, BITS))}; got {bits!r}")
        self.bits = bits
        self.group = group
        super().__init__(cache, layer_idx)
        self.lowbit: LowBitKV | None = None
        self._rk: torch.Tensor | None = None  # residual keys [B, H, Cr, D], slots 0:n_res valid
        self._rv: torch.Tensor | None = None
        self.n_res = 0
        # rotated layers: the rotation each quantized key was packed at, [B, H, Lq]
        self._qrot: torch.Tensor | None = None

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx, self.bits, self.group)  # type: ignore[misc]  # reset = re-run __init__

    # --- views -------------------------------------------------------------------------------------
    @property
    def n_quantized(self) -> int:
        return 0 if self.lowbit is None else self.lowbit.length

    @property
    def keys(self) -> torch.Tensor | None:
        """Every stored key in the model's dtype, ``[B, H, stored, D]`` (dequantized: a copy)."""
        if self.lowbit is None or self._rk is None:
            return None
        if not self.lowbit.length:  # a prompt before its decision: the residual itself, no copy
            return self._rk[:, :, : self.n_res]
        return torch.cat([self.quantized_keys(self._rk.dtype), self._rk[:, :, : self.n_res]], dim=2)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("LowBitLayer.keys is read-only")

    @property
    def values(self) -> torch.Tensor | None:
        """Every stored value in the model's dtype, ``[B, H, stored, Dv]`` (dequantized: a copy)."""
        if self.lowbit is None or self._rv is None:
            return None
        if not self.lowbit.length:
            return self._rv[:, :, : self.n_res]
        return torch.cat([self.lowbit.values(dtype=self._rv.dtype), self._rv[:, :, : self.n_res]], dim=2)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("LowBitLayer.values is read-only")

    @property
    def residual(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest tokens, held in the model's dtype: ``([B, H, R, D], [B, H, R, Dv])``."""
        assert self._rk is not None and self._rv is not None
        return self._rk[:, :, : self.n_res], self._rv[:, :, : self.n_res]

    def rerotate(self, k: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Dequantized keys of quantized slots ``start:stop`` turned to their current rotation."""
        if self._qrot is None or self._rot is None or stop <= start:
            return k
        delta = self._rot[:, :, start:stop] - self._qrot[:, :, start:stop]
        if not bool(delta.any()):
            return k
        assert self.cache.rotary is not None  # found whenever keys are re-rotated (_rot exists)
        return self.cache.rotary.rotate(k, delta)

    def quantized_keys(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.lowbit is not None
        return self.rerotate(self.lowbit.keys(), 0, self.lowbit.length).to(dtype)

    @property
    def capacity(self) -> int:
        return 0 if self._pos is None else self._pos.shape[2]

    def _start(self) -> int:
        return 0

    # --- writing -----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        try:
            self.lowbit = LowBitKV.empty(self.bits, b, h, d, value_states.shape[-1], key_states.device)
        except ValueError as e:
            raise KVTrimError(f"kv_bits={self.bits}: {e}") from None
        self.device = key_states.device
        self._rk = key_states.new_empty(b, h, 0, d)
        self._rv = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self._pos = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        if self.cache.position_policy != "true":
            self._rot = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
            self._qrot = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def _reserve(self, n: int) -> None:
        if self.length + n > self.capacity:
            self._realloc_meta(self.length + n + self.slack(self.length + n))
        assert self._rk is not None
        if self.n_res + n > self._rk.shape[2]:
            self._resize_residual(max(self.n_res + n, self.group))

    def _realloc_meta(self, cap: int) -> None:
        def grow(t: torch.Tensor) -> torch.Tensor:
            new = t.new_empty(*t.shape[:2], cap)
            new[:, :, : self.length] = t[:, :, : self.length]
            return new

        assert self._pos is not None
        self._pos = grow(self._pos)
        if self._rot is not None:
            self._rot = grow(self._rot)
        self.token_state = {n: grow(t) for n, t in self.token_state.items()}

    def _resize_residual(self, cap: int) -> None:
        assert self._rk is not None and self._rv is not None
        rk = self._rk.new_empty(*self._rk.shape[:2], cap, self._rk.shape[-1])
        rv = self._rv.new_empty(*self._rv.shape[:2], cap, self._rv.shape[-1])
        rk[:, :, : self.n_res] = self._rk[:, :, : self.n_res]
        rv[:, :, : self.n_res] = self._rv[:, :, : self.n_res]
        self._rk, self._rv = rk, rv

    def write_new(self, slots: slice, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        assert self._rk is not None and self._rv is not None
        q = key_states.shape[-2]
        self._rk[:, :, self.n_res: self.n_res + q] = key_states
        self._rv[:, :, self.n_res: self.n_res + q] = value_states
        self.n_res += q

    def attention_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A decode step gets the residual only: kvtrim's attention function reads the quantized slots
        itself (:meth:`decode_attention`), or, where it cannot, takes :attr:`keys` and :attr:`values`.
        A prompt or turn gets every key and value, dequantized."""
        if self.n_new == 1 and self.phase == "decode":
            return self.residual
        return self.keys, self.values

    def stored_attention(self, query: torch.Tensor, scaling: float,
                         bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.n_new == 1 and self.phase == "decode":
            return self.decode_attention(query, scaling, bias)
        return None

    def attention_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_new == 1 and self.phase == "decode":  # the model was handed the residual only
            keys, values = self.keys, self.values
            assert keys is not None and values is not None
            return keys, values
        return key, value

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in self.token_state:
            assert self._pos is not None, "per-token state is created after the first update()"
            b, h = self._pos.shape[:2]
            self.token_state[name] = torch.zeros(b, h, self.capacity, dtype=dtype, device=self._pos.device)
        return self.token_state[name]

    def settle(self) -> None:
        """Quantize every full group of the residual (its oldest tokens) into the quantized part."""
        if self.lowbit is None or self.n_res < self.group:
            return
        assert self._rk is not None and self._rv is not None
        n = (self.n_res // self.group) * self.group
        lq = self.lowbit.length
        try:
            self.lowbit.append_groups(self._rk[:, :, :n], self._rv[:, :, :n], self.group)
        except ValueError as e:
            raise KVTrimError(f"layer {self.layer_idx}: kv_bits={self.bits}: {e}") from None
        if self._qrot is not None and self._rot is not None:
            self._qrot = torch.cat([self._qrot, self._rot[:, :, lq: lq + n]], dim=2)
        rest = self.n_res - n  # < group: room for the decode steps until the next group is full
        rk = self._rk.new_empty(*self._rk.shape[:2], self.group, self._rk.shape[-1])
        rv = self._rv.new_empty(*self._rv.shape[:2], self.group, self._rv.shape[-1])
        rk[:, :, :rest] = self._rk[:, :, n: self.n_res]
        rv[:, :, :rest] = self._rv[:, :, n: self.n_res]
        self._rk, self._rv, self.n_res = rk, rv, rest

    # --- applying decisions ------------------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        """Carry out one decision as the plain keep of its slots (``kvtrim.decisions.as_keep``)."""
        if isinstance(decision, Merge):
            self.keep_indices(decision.idx)
            self._replace(decision.keys, decision.values)
            self.write_states(decision.states)
        elif isinstance(decision, Keep):
            self.keep_indices(decision.idx)
            self.write_states(decision.states)
        elif not self.drop_in_place(decision):
            assert self._pos is not None
            self.keep_indices(as_keep(decision, self.length, self._pos.shape[0], self._pos.shape[1],
                                      self._pos.device).idx)
        self.settle()

    # --- in-place drops ------------------------------------------------------------------------------
    def _in_place_ok(self, dropped: int) -> bool:
        """Whether a decode step may drop ``dropped`` quantized slots in place: batch 1, and the freed
        slots the quantized part's allocation would then hold beyond its kept ones at most a group (what
        the residual holds anyway; a method that drops a slot per step packs a group, which allocates
        the quantized part anew and frees them, every ``group`` steps) or twice the slack
        ``CompressedLayer`` keeps; otherwise ``keep_indices`` gathers the kept slots into a new
        allocation and the memory is returned."""
        kv = self.lowbit
        if kv is None or self._pos is None or self._pos.shape[0] != 1 or self.phase != "decode" or dropped < 1:
            return False
        kept = kv.length - dropped
        return kept >= 0 and kv.allocated() - kept <= max(self.group, 2 * self.slack(kept))

    def drop_lead(self, lead: int, count: int) -> bool:
        """Drop slots ``lead:lead + count`` (in every head) during decoding, in place: what
        ``keep_indices`` does for that index set (StreamingLLM's step: the oldest tokens after the sinks
        leave), without gathering the quantized part. The ``lead`` first slots move up by ``count`` and
        every per-slot tensor (codes, group ids, value scales and zero points, packed rotations, stream
        indices, rotations, policy states) becomes a view that starts ``count`` slots later in the same
        allocation (``LowBitKV.drop_lead``); a key group no slot uses any more is freed, as the gather
        frees it. Under ``reassigned`` the later keys keep their rotation (``rot_offset`` grows by
        ``count``) and the ``lead`` keys' recorded rotation grows by ``count`` (quantized keys turn when
        read, none is re-quantized), which is the offset ``keep_indices`` chooses when ``5 * lead`` is
        at most what stays. Returns False, having changed nothing, where that does not hold, where a
        dropped or lead slot is in the residual, or where :meth:`_in_place_ok` says no; the caller then
        uses ``keep_indices``."""
        if not self._in_place_ok(count) or lead < 0:
            return False
        assert self.lowbit is not None and self._pos is not None
        k = self.length - count
        if lead + count > self.lowbit.length:
            return False
        reassign = self._rot is not None and self.cache.position_policy == "reassigned"
        if reassign and lead and 5 * lead > k:
            return False  # keep_indices keeps the oldest key's rotation here and turns the rest

        def shift(t: torch.Tensor) -> torch.Tensor:
            new = t[:, :, count:]
            if lead:
                new[:, :, :lead] = t[:, :, :lead].clone()
            return new

        self.lowbit.drop_lead(lead, count)
        if self._qrot is not None:
            self._qrot = shift(self._qrot)
        self._pos = shift(self._pos)
        self.token_state = {n: shift(t) for n, t in self.token_state.items()}
        if self._rot is not None:
            self._rot = shift(self._rot)
            if reassign:
                if lead:
                    self._rot[:, :, :lead] += count
                self.rot_offset += count
        self.length = k
        return True

    def drop_after_lead(self, lead: int) -> bool:
        """``drop_lead(lead, 1)`` (the name ``CompressedLayer`` gives this step)."""
        return self.drop_lead(lead, 1)

    def drop_slot(self, slot: int) -> bool:
        """Drop slot ``slot`` (the same in every head) in place where it is in the front half of the
        stored slots (:meth:`drop_lead`); else False (``keep_indices`` then gathers)."""
        k = self.length - 1
        return slot >= 0 and 2 * slot < k and self.drop_lead(slot, 1)

    def fill_dropped(self, drop: torch.Tensor) -> bool:
        """Remove the quantized slots ``drop`` (``[1, H, m]``, distinct per head, each before the
        residual) during decoding by moving each head's last quantized slots into its holes
        (``LowBitKV.fill_holes``; the stream indices and policy states move with them), and the
        residual's bookkeeping down by ``m``. The kept set and the quantized part's length per head
        are those ``keep_indices`` leaves (every head drops quantized slots only, so none moves to the
        residual); the slots no longer hold the quantized tokens in stream order, so this is for a
        ``DropSlots`` decision (its policy reads no meaning into the slot order) under the ``true``
        position policy (re-assigned rotations follow the slot order), as ``CompressedLayer.drop_slots``.
        Returns False, having changed nothing, where that does not hold (a drop in the residual,
        rotated keys) or where :meth:`_in_place_ok` says no."""
        m = int(drop.shape[-1])
        if self._rot is not None or drop.shape[0] != 1 or not self._in_place_ok(m):
            return False
        assert self.lowbit is not None and self._pos is not None
        lq = self.lowbit.length
        if bool((drop >= lq).any()):
            return False
        meta = (self._pos, *self.token_state.values())
        self.lowbit.fill_holes(drop, also=meta)
        n = self.length
        if n > lq:  # the residual's slots follow the quantized part's
            for t in meta:
                t[:, :, lq - m: n - m] = t[:, :, lq:n].clone()
        self.length = n - m
        return True

    def _replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every stored key and value replaced (``[B, H, stored, D]``): all of them go to the residual."""
        assert self.lowbit is not None
        self.lowbit = self.lowbit.take(torch.zeros(*keys.shape[:2], 0, dtype=torch.long, device=keys.device))
        self.lowbit.compact()
        if self._qrot is not None:
            self._qrot = self._qrot[:, :, :0]
        self._rk = keys.contiguous().clone()
        self._rv = values.contiguous().clone()
        self.n_res = keys.shape[2]

    def keep_indices(self, idx: torch.Tensor, reassign: bool | None = None) -> None:
        """Keep only the slots ``idx`` (``[B, H, K]``, ascending per head); free the rest (see the
        module docstring for which part each kept slot lands in)."""
        assert self.lowbit is not None and self._rk is not None and self._rv is not None and self._pos is not None
        k = idx.shape[-1]
        if k > self.length:
            raise ValueError("cannot keep more tokens than are stored")
        lq = self.lowbit.length
        new_lq = int((idx < lq).sum(-1).min()) if k else 0
        q_idx, r_idx = idx[..., :new_lq], idx[..., new_lq:]
        old_q, old_rot, old_qrot = self.lowbit, self._rot, self._qrot
        # the residual: kept residual tokens, and the quantized slots beyond the shortest head's, dequantized
        rk, rv = self.residual
        at = (r_idx - lq).clamp(min=0)
        new_rk, new_rv = take_slots(rk, at), take_slots(rv, at)
        from_q = r_idx < lq
        if lq and bool(from_q.any()):
            slots = r_idx.clamp(max=lq - 1)
            part = old_q.take(slots)
            dk = part.keys()
            if old_qrot is not None and old_rot is not None:
                delta = take_slots(old_rot, slots) - take_slots(old_qrot, slots)
                if bool(delta.any()):
                    assert self.cache.rotary is not None
                    dk = self.cache.rotary.rotate(dk, delta)
            new_rk = torch.where(from_q.unsqueeze(-1), dk.to(new_rk.dtype), new_rk)
            new_rv = torch.where(from_q.unsqueeze(-1), part.values(dtype=new_rv.dtype), new_rv)
        n_res = k - new_lq  # settle() packs it down to fewer than a group and leaves room for decoding
        if n_res < self.group:
            new_rk = torch.cat([new_rk, new_rk.new_empty(*new_rk.shape[:2], self.group - n_res, new_rk.shape[-1])], dim=2)
            new_rv = torch.cat([new_rv, new_rv.new_empty(*new_rv.shape[:2], self.group - n_res, new_rv.shape[-1])], dim=2)
        self._rk, self._rv = new_rk, new_rv
        self.n_res = n_res
        self.lowbit = old_q.take(q_idx)
        self.lowbit.compact()
        if old_qrot is not None:
            self._qrot = take_slots(old_qrot, q_idx)
        # per-slot bookkeeping, with the usual slack
        cap = k + self.slack(k)

        def take(t: torch.Tensor) -> torch.Tensor:
            new = t.new_empty(*t.shape[:2], cap)
            new[:, :, :k] = take_slots(t, idx)  # the whole buffer: its rows are read by index
            return new

        self._pos = take(self._pos)
        self.token_state = {n: take(t) for n, t in self.token_state.items()}
        if self._rot is not None:
            self._rot = take(self._rot)
            do_reassign = self.cache.position_policy == "reassigned" if reassign is None else reassign
            if do_reassign:
                rot = self._rot[:, :, :k]
                offset, first, stop, delta = reassign_plan(rot, self.phase == "decode")
                if stop > first:
                    a = max(first, new_lq)  # quantized keys only change their recorded rotation
                    if stop > a:
                        assert self.cache.rotary is not None
                        part_k = self._rk[:, :, a - new_lq: stop - new_lq]
                        self._rk[:, :, a - new_lq: stop - new_lq] = self.cache.rotary.rotate(part_k, delta[:, :, a:stop])
                    rot.copy_(torch.arange(k, device=rot.device) + offset)
                self.rot_offset = offset
        self.length = k

    # --- reporting ---------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Resident bytes of the keys and values: codes, group ids, scales and zero points of the
        quantized part, and the residual's buffers (allocated capacity)."""
        if self.lowbit is None or self._rk is None or self._rv is None:
            return 0
        return self.lowbit.nbytes() + self._rk.untyped_storage().nbytes() + self._rv.untyped_storage().nbytes()

    def stored_nbytes(self) -> int:
        if self.lowbit is None or self._rk is None or self._rv is None:
            return 0
        b, h = self._rk.shape[:2]
        res = b * h * self.n_res * (self._rk.shape[-1] + self._rv.shape[-1]) * self._rk.element_size()
        return sum(t.numel() * t.element_size() for t in self.lowbit.tensors().values()) + res

    def element_size(self) -> int:
        return 0 if self._rk is None else self._rk.element_size()

    def index_nbytes(self) -> int:
        extra = 0 if self._qrot is None else self._qrot.untyped_storage().nbytes()
        return super().index_nbytes() + extra

    # --- decode attention --------------------------------------------------------------------------
    def decode_attention(self, query: torch.Tensor, scaling: float,
                         bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode query's attention over every stored token, reading the quantized slots block by
        block (``lowbit_decode_attention``); returns ``(out [B, 1, Hq, Dv], probs [B, Hkv, G, 1, S])``."""
        assert self.lowbit is not None
        rk, rv = self.residual
        rotation = None
        if self._qrot is not None and self._rot is not None and self.lowbit.length:
            rotary = self.cache.rotary
            assert rotary is not None  # found whenever keys are re-rotated (_rot exists)
            # (cos, sin) per turn from one table kept on the rotary embedding for every layer and step
            delta = self._rot[:, :, : self.lowbit.length] - self._qrot
            rotation = KeyRotation.from_kept(delta, lambda lo, hi: rotary.turn_table(lo, hi, delta.device),
                                             rotary.layout == "interleaved")
        return lowbit_decode_attention(query, self.lowbit, rk, rv, scaling, bias=bias, rotation=rotation)

    # --- what persistence reads and restores -----------------------------------------------------------
    def lowbit_state(self) -> dict[str, torch.Tensor]:
        """The quantized part's tensors (``LowBitKV`` fields, and ``packed_rotations`` where keys are
        re-rotated), contiguous."""
        assert self.lowbit is not None
        out = {name: t.contiguous() for name, t in self.lowbit.tensors().items()}
        if self._qrot is not None:
            out["packed_rotations"] = self._qrot.contiguous()
        return out

    def restore_lowbit(self, lowbit: LowBitKV, packed_rotations: torch.Tensor | None) -> None:
        """After :meth:`restore` of the residual and the bookkeeping of every slot: the quantized part,
        whose slots come first (the caller has checked the shapes)."""
        self.lowbit = lowbit
        self._qrot = packed_rotations if self._rot is not None else None

    def restore(self, keys, values, positions, rotations, states, *, seen, phase, n_new, state) -> None:
        """Restore the residual ``keys``/``values`` and the bookkeeping of all ``positions.shape[2]``
        slots; :meth:`restore_lowbit` then sets the quantized slots."""
        n = positions.shape[2]
        cap = n + self.slack(n)
        dev = keys.device

        def buf(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty(*t.shape[:2], cap)
            out[:, :, :n] = t.to(dev)
            return out

        self.seen, self.phase, self.n_new, self.state = seen, phase, n_new, state
        self.device = dev
        r = keys.shape[2]
        room = max(self.group - r, 0)
        self._rk = torch.cat([keys, keys.new_empty(*keys.shape[:2], room, keys.shape[-1])], dim=2)
        self._rv = torch.cat([values.to(dev), values.new_empty(*values.shape[:2], room, values.shape[-1]).to(dev)], dim=2)
        self.n_res = r
        self._pos = buf(positions)
        self._rot = buf(rotations) if rotations is not None else None
        if rotations is not None and n and self.cache.position_policy == "reassigned":
            self.rot_offset = int(rotations[0, 0, -1]) - (n - 1)
        self.token_state = {x: buf(t) for x, t in states.items()}
        self.length = n
        self.is_initialized = True
        self.awaiting_attention = False
