"""Low-bit KV storage: quantizing and packing keys and values, and decode attention over them.

The scheme is KIVI's (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
2024): asymmetric (min/max) integer codes of ``bits`` in {8, 4, 2},

* **keys per channel**: the tokens of a key are quantized in groups; a group shares one scale and
  one zero point *per channel* (pre-RoPE and post-RoPE keys have outlier channels, whose range a
  per-token scale would spread over every other channel);
* **values per token**: one scale and zero point per token and head (the attention output mixes
  values across tokens, so an error in one token's channels stays that token's).

Codes are packed ``8 // bits`` to a byte along the head dimension. Scales and zero points are float16.

Tensors in, tensors out; nothing here knows about caches (the storage is ``kvtrim.lowbit_storage``).
Layouts: ``[B, H, S, D]`` per stored token (``B`` sequences, ``H`` KV heads, ``S`` tokens).

:class:`LowBitKV` is one layer's quantized tokens. Each stored key slot carries the id of the
group whose scale it uses (``key_group``), so a slot can be dropped or moved without touching any
other slot's codes: eviction frees a token's codes and, once no slot of a group is left, the
group's scales (``LowBitKV.compact``).

:func:`lowbit_decode_attention` is one decode query's attention over a :class:`LowBitKV` plus the
newest tokens still held in the model's dtype, dequantizing ``block`` slots at a time with an online
softmax: no full-precision copy of the cache exists at any time. Its plain reference is
``kvtrim.attention.reference.lowbit_decode_reference`` (dequantize everything, then softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtrim.attention.native import kernel_for, native_lowbit_decode

#: the bit widths a low-bit storage takes (16: the model's dtype, no quantization)
BITS = (8, 4, 2)
#: dtype of every scale and zero point
SCALE_DTYPE = torch.float16
#: the largest magnitude a scale or zero point may take (float16's finite range)
SCALE_MAX = float(torch.finfo(torch.float16).max)

__all__ = ["BITS", "KeyRotation", "LowBitKV", "dequantize", "lowbit_decode_attention", "pack", "quantize", "take_slots",
           "unpack"]


def _per_byte(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}; got {bits!r}")
    return 8 // bits


def take_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t [B, H, C, ...]`` at slots ``idx [B, H, K]`` (each ``< C``), as a new tensor. Where ``t`` is a
    buffer with its slots as rows (the trailing dims contiguous, every head the same number of rows
    apart: a contiguous tensor or a prefix of one along the slots), one ``index_select`` over those
    rows (several times faster than a gather with an expanded index); else a gather."""
    b, h, c = t.shape[:3]
    rest = t.shape[3:]
    width = 1
    for n in rest:
        width *= n
    k = idx.shape[-1]
    dense = t.dim() == 3 or (t.stride(-1) == 1 and all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1]
                                                        for i in range(3, t.dim() - 1)))
    if dense and t.stride(2) == width and t.stride(1) % width == 0 and t.stride(0) == h * t.stride(1) and b * h * c:
        per = t.stride(1) // width
        rows = t.as_strided(((b * h - 1) * per + c, width), (width, 1))
        flat = (idx + (torch.arange(b * h, device=idx.device) * per).view(b, h, 1)).reshape(-1)
        return rows.index_select(0, flat).view(b, h, k, *rest)
    ix = idx if t.dim() == 3 else idx.view(b, h, k, *([1] * len(rest))).expand(b, h, k, *rest)
    return torch.gather(t, 2, ix)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., D]`` (uint8, each ``< 2**bits``) ``8 // bits`` to a byte: ``[..., D * bits / 8]``.
    Code ``j`` of a byte sits at bits ``j * bits``; ``D`` must be a multiple of ``8 // bits``."""
    n = _per_byte(bits)
    if n == 1:
        return codes.to(torch.uint8)
    d = codes.shape[-1]
    if d % n:
        raise ValueError(f"a packed dimension must be a multiple of {n}; got {d}")
    c = codes.to(torch.uint8).view(*codes.shape[:-1], d // n, n)
    out = c[..., 0].clone()
    for j in range(1, n):
        out |= c[..., j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`pack` packed: ``[..., P]`` uint8 -> ``[..., P * 8 / bits]`` uint8."""
    n = _per_byte(bits)
    if n == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` reduced over ``dim``: ``(codes, scale, zero)`` with
    ``x ~ codes * scale + zero``; ``codes`` uint8 (unpacked), ``scale``/``zero`` float16 with ``dim``
    kept as size 1. The range is taken from the float16 zero point, so the rounding of the zero point
    itself is inside the codes' half-step error. Raises ``ValueError`` beyond float16's range."""
    levels = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        raise ValueError("cannot quantize keys or values that are not finite")
    if float(lo.abs().max()) > SCALE_MAX or float(hi.abs().max()) > SCALE_MAX:
        raise ValueError("keys or values beyond float16's range cannot be quantized (use 16 bits)")
    zero = lo.to(SCALE_DTYPE)
    # a zero point that float16 rounds up would clip the bottom code: one step down
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    z = zero.float()
    scale = ((hi - z) / levels).to(SCALE_DTYPE)
    # a scale that float16 rounds down would clip the top code; one step up never clips
    s = scale.float()
    short = (z + s * levels) < hi
    if bool(short.any()):
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
        s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.clamp(torch.round((xf - z) / safe), 0, levels).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale + zero`` (broadcast) in float32, returned in ``dtype``."""
    return (codes.float() * scale.float() + zero.float()).to(dtype)


@dataclass
class LowBitKV:
    """One layer's quantized tokens (``bits`` in :data:`BITS`), ``S`` slots per head.

    * ``key_codes`` ``[B, H, S, D * bits / 8]`` uint8, ``key_group`` ``[B, H, S]`` int32: the group
      whose per-channel ``key_scale``/``key_zero`` (``[B, H, NG, D]`` float16) a slot's key uses;
    * ``value_codes`` ``[B, H, S, Dv * bits / 8]`` uint8, ``value_scale``/``value_zero`` ``[B, H, S]`` float16.
    """

    bits: int
    key_codes: torch.Tensor
    key_group: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor

    #: the per-slot tensors, which move with their slots
    SLOT_FIELDS = ("key_codes", "key_group", "value_codes", "value_scale", "value_zero")
    #: every tensor field
    FIELDS = (*SLOT_FIELDS, "key_scale", "key_zero")

    @classmethod
    def empty(cls, bits: int, batch: int, heads: int, head_dim: int, value_dim: int, device) -> "LowBitKV":
        n = _per_byte(bits)
        if head_dim % n or value_dim % n:
            raise ValueError(f"head dims {head_dim}, {value_dim} must be multiples of {n} to pack {bits}-bit codes")
        u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=SCALE_DTYPE, device=device)
        return cls(bits, torch.empty(batch, heads, 0, head_dim // n, **u8),
                   torch.empty(batch, heads, 0, dtype=torch.int32, device=device),
                   torch.empty(batch, heads, 0, head_dim, **f16), torch.empty(batch, heads, 0, head_dim, **f16),
                   torch.empty(batch, heads, 0, value_dim // n, **u8), torch.empty(batch, heads, 0, **f16),
                   torch.empty(batch, heads, 0, **f16))

    @property
    def length(self) -> int:
        return int(self.key_codes.shape[2])

    @property
    def groups(self) -> int:
        return int(self.key_scale.shape[2])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def nbytes(self) -> int:
        """Bytes of every tensor (codes, group ids, scales, zero points)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())

    # --- writing ------------------------------------------------------------------------------------
    def append_groups(self, keys: torch.Tensor, values: torch.Tensor, group: int) -> None:
        """Quantize ``n`` new tokens (``keys [B, H, n, D]``, ``values [B, H, n, Dv]``, ``n`` a multiple
        of ``group``) as ``n / group`` new key groups and append them after the stored slots."""
        b, h, n, d = keys.shape
        g = n // group
        kc, ks, kz = quantize(keys.reshape(b, h, g, group, d), 3, self.bits)  # scales [B, H, g, 1, D]
        vc, vs, vz = quantize(values, 3, self.bits)
        ids = (self.groups + torch.arange(g, device=keys.device, dtype=torch.int32)).repeat_interleave(group)
        self.key_codes = torch.cat([self.key_codes, pack(kc.reshape(b, h, n, d), self.bits)], dim=2)
        self.key_group = torch.cat([self.key_group, ids.view(1, 1, n).expand(b, h, n)], dim=2)
        self.key_scale = torch.cat([self.key_scale, ks.squeeze(3)], dim=2)
        self.key_zero = torch.cat([self.key_zero, kz.squeeze(3)], dim=2)
        self.value_codes = torch.cat([self.value_codes, pack(vc, self.bits)], dim=2)
        self.value_scale = torch.cat([self.value_scale, vs.squeeze(-1)], dim=2)
        self.value_zero = torch.cat([self.value_zero, vz.squeeze(-1)], dim=2)

    def take(self, idx: torch.Tensor) -> "LowBitKV":
        """The slots ``idx`` (``[B, H, K]``, each ``< length``) in that order, as new tensors (the groups'
        scales are shared until :meth:`compact`)."""
        return LowBitKV(self.bits, take_slots(self.key_codes, idx), take_slots(self.key_group, idx), self.key_scale,
                        self.key_zero, take_slots(self.value_codes, idx), take_slots(self.value_scale, idx),
                        take_slots(self.value_zero, idx))

    def allocated(self) -> int:
        """Slots per head that the per-slot tensors' allocation holds: :attr:`length`, or more after
        :meth:`drop_lead` / :meth:`fill_holes` (dropped in place, freed by the next :meth:`append_groups`
        or :meth:`take`, which allocate anew)."""
        b, h, _, w = self.key_codes.shape
        return self.key_codes.untyped_storage().nbytes() // max(1, b * h * w)

    def drop_lead(self, lead: int, count: int) -> None:
        """Drop slots ``lead:lead + count`` of every head in place, the others kept in order: the
        ``lead`` first slots move up by ``count`` and every per-slot tensor becomes a view that starts
        ``count`` slots later in its allocation (``take`` of the same slots, without copying the
        rest); then the groups no slot uses any more are freed (:meth:`compact`)."""
        for name in self.SLOT_FIELDS:
            t = getattr(self, name)
            new = t[:, :, count:]
            if lead:
                new[:, :, :lead] = t[:, :, :lead].clone()  # a copy: the two ranges overlap when count < lead
            setattr(self, name, new)
        self.compact()

    def fill_holes(self, drop: torch.Tensor, also: Sequence[torch.Tensor] = ()) -> None:
        """Drop the slots ``drop`` (``[1, H, m]``, distinct per head, each ``< length``) in place by
        moving each head's last kept slots into its holes (the slot order changes; the kept set is that
        of ``take``); the per-slot tensors become their first ``length - m`` slots (views of the same
        allocation), and groups no slot uses any more are freed (:meth:`compact`). ``also``: the
        caller's own per-slot tensors (``[1, H, C]``, their first ``length`` slots these), whose slots
        move the same way (they are not narrowed)."""
        h, m = drop.shape[1], drop.shape[2]
        n = self.length
        k = n - m
        fields = [getattr(self, name) for name in self.SLOT_FIELDS]
        if m == 1:
            # a decode step's usual drop: each head's last slot moves into its hole (onto itself where
            # it is the one dropped), one scatter per tensor
            hole = drop[0, :, 0]
            for t in (*fields, *also):
                t0 = t[0]
                last = t0[:, k:k + 1].clone()
                t0.scatter_(1, hole.view((h, 1) + (1,) * (t0.dim() - 2)).expand_as(last), last)
        else:
            dropped = torch.zeros(h, n, dtype=torch.bool, device=drop.device).scatter_(-1, drop[0], True)
            holes = dropped[:, :k].nonzero()  # [r, 2] (head, slot), head-major; per head as many as
            fill = (~dropped[:, k:]).nonzero()  # kept slots at or after k, also head-major
            if len(holes):
                for t in (*fields, *also):
                    t[0, holes[:, 0], holes[:, 1]] = t[0, fill[:, 0], fill[:, 1] + k]
        for name, t in zip(self.SLOT_FIELDS, fields):
            setattr(self, name, t[:, :, :k])
        self.compact()

    def compact(self) -> None:
        """Drop the groups no slot uses any more (their scales and zero points), renumbering the rest
        in order. Heads that keep fewer groups than the most pad their tables with unused rows."""
        b, h, ng = self.key_scale.shape[:3]
        if ng == 0:
            return
        used = torch.zeros(b, h, ng, dtype=torch.bool, device=self.key_group.device)
        used.scatter_(2, self.key_group.long(), True)
        live = int(used.sum(-1).max()) if self.length else 0
        if live == ng:
            return
        new_id = (used.cumsum(-1) - 1).to(torch.int32)  # [B, H, NG]: a used group's new number
        order = torch.sort((~used).to(torch.int8), dim=-1, stable=True).indices[..., :live]  # used groups first, in order
        ix = order.unsqueeze(-1).expand(b, h, live, self.key_scale.shape[-1])
        self.key_scale = torch.gather(self.key_scale, 2, ix)
        self.key_zero = torch.gather(self.key_zero, 2, ix)
        # written in place: the ids may be a view into a larger allocation (drop_lead, fill_holes)
        self.key_group.copy_(torch.gather(new_id, 2, self.key_group.long()))

    # --- reading -----------------------------------------------------------------------------------
    def key_table(self) -> torch.Tensor:
        """Every key group's scale and zero point as rows of one float32 table ``[B * H * NG, 2 * D]``
        (scale, then zero point), which :meth:`keys` reads by ``index_select`` (several times faster
        than a gather with an expanded index)."""
        b, h, ng, d = self.key_scale.shape
        return torch.cat([self.key_scale, self.key_zero], dim=-1).float().reshape(b * h * ng, 2 * d)

    def keys(self, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.float32,
             table: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized keys of slots ``start:stop``, ``[B, H, n, D]`` in ``dtype`` (as quantized: the
        rotation a storage may add is its own), computed in float32 (float64 for ``dtype`` float64: the
        exact values the codes stand for); ``table``: :meth:`key_table`, when at hand."""
        codes = unpack(self.key_codes[:, :, start:stop], self.bits)
        b, h, n, d = codes.shape
        if table is None:
            table = self.key_table()
        ng = self.key_scale.shape[2]
        rows = self.key_group[:, :, start:stop].long() + (torch.arange(b * h, device=codes.device) * ng).view(b, h, 1)
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        sz = table.index_select(0, rows.reshape(-1)).view(b, h, n, 2 * d).to(ct)
        return torch.addcmul(sz[..., d:], codes.to(ct), sz[..., :d]).to(dtype)

    def values(self, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized values of slots ``start:stop``, ``[B, H, n, Dv]`` in ``dtype`` (computed as :meth:`keys`)."""
        codes = unpack(self.value_codes[:, :, start:stop], self.bits)
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        return torch.addcmul(self.value_zero[:, :, start:stop, None].to(ct), codes.to(ct),
                             self.value_scale[:, :, start:stop, None].to(ct)).to(dtype)


#: slots dequantized at a time by :func:`lowbit_decode_attention`
DECODE_BLOCK = 512


@dataclass(frozen=True)
class KeyRotation:
    """How far each quantized key has turned (RoPE) since it was packed, for a storage that re-rotates
    kept keys without re-quantizing them.

    ``index [B, H, S]`` int32: the row of ``table`` a slot's key turns by, or -1 (not turned);
    ``table [U, F, 2]`` float32: ``(cos, sin)`` of each distinct turn for the ``F`` rotary frequencies;
    ``interleaved``: the rotary pairs are ``(2i, 2i + 1)`` instead of ``(i, i + F)`` (the first ``2F``
    dims rotate; partial rotary models keep the rest). A key ``x`` turns to ``x * cos + partner(x) * sin``
    as ``kvtrim.rope.rotate`` turns it (its float64 angles rounded to float32 once)."""

    index: torch.Tensor
    table: torch.Tensor
    interleaved: bool

    @classmethod
    def from_turns(cls, delta: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> "KeyRotation | None":
        """The rotation for per-slot turns ``delta [B, H, S]`` (int64 positions) of a rotary embedding
        with ``inv_freq [F]``; None when no key turned."""
        turned = delta != 0
        if not bool(turned.any()):
            return None
        uniq, inverse = torch.unique(delta[turned], return_inverse=True)
        ang = uniq.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=delta.device, dtype=torch.float64)
        index = torch.full(delta.shape, -1, dtype=torch.int32, device=delta.device)
        index[turned] = inverse.to(torch.int32)
        return cls(index, torch.stack([ang.cos(), ang.sin()], dim=-1).float().contiguous(), interleaved)

    @classmethod
    def from_kept(cls, delta: torch.Tensor, turn_table: Callable[[int, int], tuple[torch.Tensor, int]],
                  interleaved: bool) -> "KeyRotation | None":
        """:meth:`from_turns` read from a kept table of every integer turn: ``turn_table(lo, hi)`` returns
        ``(table, base)`` covering the turns ``lo..hi`` (row ``t - base`` is turn ``t``;
        ``kvtrim.rope.Rotary.turn_table``). No distinct turns to find and no angles to compute each
        decode step, the same ``(cos, sin)`` per key; None when no key turned."""
        lo, hi = (int(v) for v in torch.aminmax(delta))
        if lo == hi == 0:
            return None
        table, base = turn_table(lo, hi)
        index = torch.where(delta != 0, delta - base, -1).to(torch.int32)
        return cls(index, table, interleaved)

    def apply(self, k: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Keys ``k [B, H, n, D]`` (float32) of slots ``start:stop``, turned."""
        idx = self.index[:, :, start:stop]
        turned = idx >= 0
        if not bool(turned.any()):
            return k
        f = self.table.shape[1]
        cs = self.table.index_select(0, idx.clamp(min=0).reshape(-1).long()).view(*idx.shape, f, 2)
        cos = torch.where(turned.unsqueeze(-1), cs[..., 0], 1.0)
        sin = torch.where(turned.unsqueeze(-1), cs[..., 1], 0.0)
        a, b = (slice(0, 2 * f, 2), slice(1, 2 * f, 2)) if self.interleaved else (slice(0, f), slice(f, 2 * f))
        out = k.clone()
        x1, x2 = k[..., a], k[..., b]
        out[..., a] = x1 * cos - x2 * sin
        out[..., b] = x2 * cos + x1 * sin
        return out


def _native_applies(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and kernel_for(query) == "native"


def _triton_applies(query: torch.Tensor, kv: LowBitKV) -> bool:
    import importlib.util

    if not query.is_cuda or importlib.util.find_spec("triton") is None:
        return False
    d, dv = query.shape[-1], kv.value_codes.shape[-1] * 8 // kv.bits
    return all(x >= 16 and not x & (x - 1) for x in (d, dv))


def lowbit_decode_attention(query: torch.Tensor, kv: LowBitKV, keys: torch.Tensor, values: torch.Tensor,
                            scaling: float, *, bias: torch.Tensor | None = None,
                            rotation: KeyRotation | None = None,
                            block: int = DECODE_BLOCK, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query's attention over the quantized slots ``kv`` followed by ``keys``/``values``
    (``[B, Hkv, R, D]``, the newest tokens in the model's dtype), with its probabilities.

    ``query [B, Hq, 1, D]``; ``bias [B, Hkv, S]`` (``S = kv.length + R``) is added to each key's logit;
    ``rotation`` turns the dequantized keys into the keys the query sees (a storage whose keys were
    re-rotated after they were quantized, :class:`KeyRotation`). The quantized
    slots are read ``block`` at a time, dequantized to float32, and folded into a running softmax
    (max, sum and weighted values per query head); the logits are kept (``[B, Hq, S]`` float32, a few
    bytes per key) to return the probabilities. Returns ``(out [B, 1, Hq, Dv]`` in the query's dtype,
    ``probs [B, Hkv, G, 1, S]`` float32), as ``kvtrim.scores.decode_attention`` does for a plain cache.

    ``backend``: ``"torch"`` (the loop above, any device), ``"native"`` (the quantized slots in
    kvtrim's C++ CPU kernel, ``csrc/lowbit_decode.cpp``: two passes reading each code once, 64 slots
    at a time with one matrix product each, nothing larger than 64 keys in float32), ``"triton"`` (the quantized slots in one Triton kernel,
    ``kvtrim.attention.triton.lowbit``; head dims powers of two >= 16) or ``"auto"`` (default: Triton
    on a CUDA device where it applies, the native kernel on CPU where it is built, else torch).
    """
    if backend not in ("auto", "torch", "native", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch', 'native' or 'triton'; got {backend!r}")
    if backend == "auto":
        backend = "triton" if _triton_applies(query, kv) else "native" if _native_applies(query) else "torch"
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    g = hq // hkv
    lq, r = kv.length, keys.shape[2]
    s = lq + r
    qf = query.float().reshape(b, hkv, g, d)
    logits = torch.empty(b, hkv, g, s, dtype=torch.float32, device=query.device)
    run_max = torch.full((b, hkv, g, 1), float("-inf"), dtype=torch.float32, device=query.device)
    run_sum = torch.zeros(b, hkv, g, 1, dtype=torch.float32, device=query.device)
    acc = torch.zeros(b, hkv, g, values.shape[-1], dtype=torch.float32, device=query.device)

    def fold(k: torch.Tensor, start: int, stop: int, weigh) -> None:
        """Fold slots ``start:stop`` (keys ``k``, float32) into the running softmax; ``weigh(w)`` is
        the probability-weighted sum of their values for unnormalised weights ``w [B, Hkv, G, n]``."""
        nonlocal run_max, run_sum, acc
        part = logits[..., start:stop]
        torch.matmul(qf, k.transpose(-1, -2), out=part)
        part.mul_(scaling)
        if bias is not None:
            part.add_(bias[:, :, None, start:stop].float())
        new_max = torch.maximum(run_max, part.amax(dim=-1, keepdim=True))
        keep = torch.exp(run_max - new_max)
        w = torch.exp(part - new_max)
        run_sum = run_sum * keep + w.sum(dim=-1, keepdim=True)
        acc = acc * keep + weigh(w)
        run_max = new_max

    if backend == "triton" and lq:
        from kvtrim.attention.triton.lowbit import lowbit_decode_triton

        run_max, run_sum, acc = lowbit_decode_triton(query, kv, logits, scaling,
                                                     None if bias is None else bias[..., :lq], rotation)
        lq_loop = 0
    elif backend == "native" and lq:
        run_max, run_sum, acc = native_lowbit_decode(query, kv, logits, scaling, None if bias is None else bias[..., :lq],
                                                     rotation)
        lq_loop = 0
    else:
        lq_loop = lq
    table = kv.key_table() if lq_loop else None
    for start in range(0, lq_loop, block):
        stop = min(lq, start + block)
        k = kv.keys(start, stop, table=table)
        if rotation is not None:
            k = rotation.apply(k, start, stop)
        # the values dequantized (one rounding each): weighing the codes by p * scale and adding p . zero
        # apart would cancel two large float32 sums against each other
        v = kv.values(start, stop)

        def weigh(w: torch.Tensor, v=v) -> torch.Tensor:
            return torch.matmul(w, v)

        fold(k, start, stop, weigh)
    if r:
        vf = values.float()
        fold(keys.float(), lq, s, lambda w: torch.matmul(w, vf))
    out = (acc / run_sum).reshape(b, hq, 1, values.shape[-1]).transpose(1, 2).contiguous().to(query.dtype)
    probs = torch.exp(logits - run_max).div_(run_sum).unsqueeze(3)
    return out, probs
