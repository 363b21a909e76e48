"""Rotary position helpers: re-rotating cached keys (and queries) by a position difference.

RoPE is a rotation per frequency pair, so a vector rotated at position ``p`` is moved to position
``p + delta`` by one more rotation by ``delta``. kvtrim uses this for the ``reassigned`` and
``compressed`` position policies (docs/methods-spec.md): keys are cached after RoPE by the model,
and kvtrim re-rotates them to in-cache positions. Angles are computed in float64 so that large
position values do not lose phase precision.

Two layouts of the rotary pairs exist in transformers' models: ``half`` (``rotate_half``: dim ``i``
pairs with dim ``i + rot_dim/2``; Llama, Qwen, Mistral, Phi, Gemma ...) and ``interleaved``
(dims ``2i`` and ``2i+1`` pair; Cohere, GPT-J-style). :func:`find_rotary` tells which one a
model uses by running the model's own rotary code on a probe vector and checking that kvtrim's
re-rotation reproduces it; a model whose RoPE matches neither is refused rather than corrupted.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

LAYOUTS = ("half", "interleaved")
FULL = "full_attention"  # the layer type kvtrim compresses


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved layout's partner: ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _layout_fns(layout: str):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown rotary layout {layout!r}; known: {', '.join(LAYOUTS)}")
    expand = (lambda a: torch.cat((a, a), dim=-1)) if layout == "half" else (lambda a: a.repeat_interleave(2, dim=-1))
    return expand, (rotate_half if layout == "half" else rotate_pairs)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, partner) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + partner(x) * sin
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((xr * cos + partner(xr) * sin, xp), dim=-1)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate ``x [..., S, D]`` by ``delta [..., S]`` positions (broadcast over leading dims).

    Only the first ``2 * len(inv_freq)`` dims are rotary (partial rotary models keep the rest).
    ``layout`` is ``half`` (``rotate_half`` pairs) or ``interleaved`` (adjacent pairs).
    """
    expand, partner = _layout_fns(layout)
    rot_dim = 2 * inv_freq.shape[-1]
    freq = inv_freq.to(device=x.device, dtype=torch.float64)
    if delta.numel() > 64 and not delta.is_floating_point():
        # a cache's deltas take few distinct values (an eviction shifts every later key by the same
        # amount): the float64 cos/sin are computed once per distinct delta, then indexed
        uniq, inverse = torch.unique(delta.reshape(-1), return_inverse=True)
        ang = expand(uniq.to(torch.float64).unsqueeze(-1) * freq)
        cos = ang.cos().to(x.dtype).index_select(0, inverse).view(*delta.shape, rot_dim)
        sin = ang.sin().to(x.dtype).index_select(0, inverse).view(*delta.shape, rot_dim)
    else:
        ang = expand(delta.to(torch.float64).unsqueeze(-1) * freq)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    return _apply(x, cos, sin, partner)


class RotationMoments(NamedTuple):
    """Averages over positions of the rotation RoPE applies there, per rotary dim (float64, ``[rot_dim]``,
    laid out like the angles of :func:`rotate`): of ``cos``, ``sin``, cos squared, sin squared and cos * sin."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos2: torch.Tensor
    sin2: torch.Tensor
    cos_sin: torch.Tensor


def partner_of(layout: str):
    """The function that pairs each rotary dim with its partner in ``layout`` (``rotate_half`` or
    ``rotate_pairs``): a vector rotated by angle ``a`` is ``x * cos(a) + partner(x) * sin(a)``."""
    return _layout_fns(layout)[1]


def rotation_moments(inv_freq: torch.Tensor, positions: torch.Tensor, layout: str = "half") -> RotationMoments:
    """:class:`RotationMoments` of the rotations at ``positions [n]``.

    A vector ``q`` rotated at position ``p`` is ``q * cos(p) + partner(q) * sin(p)`` per dim
    (:func:`partner_of`), so the mean of ``q`` rotated over the positions is ``q * cos + partner(q) *
    sin`` and the mean square of one dim is ``q**2 * cos2 + partner(q)**2 * sin2 + 2 * q * partner(q) *
    cos_sin``: what a method that predicts the queries of the next positions needs
    (``kvtrim.policies.expected_attention``)."""
    expand = _layout_fns(layout)[0]
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    c, s = ang.cos(), ang.sin()
    return RotationMoments(*(expand(v.mean(dim=0)) for v in (c, s, c * c, s * s, c * s)))


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding as kvtrim re-rotates it: inverse frequencies and pair layout."""

    inv_freq: torch.Tensor
    layout: str = "half"
    # (delta, dtype, device) -> (cos, sin): rotate_by's angles, the same for every layer of a step
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    # device -> (table, base): turn_table's (cos, sin) of every integer turn from base on
    _turns: dict = field(default_factory=dict, compare=False, repr=False)

    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return rotate(x, delta, self.inv_freq, self.layout)

    def rotate_by(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """``rotate`` with one ``delta`` for every vector of ``x`` (the same result, bit for bit); the
        float64 angles are computed once per ``delta`` and dtype and kept (a decode step rotates
        every layer's new key and query by the same amount)."""
        expand, partner = _layout_fns(self.layout)
        key = (int(delta), x.dtype, x.device)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= 256:
                self._memo.clear()
            ang = expand(torch.tensor(float(delta), dtype=torch.float64, device=x.device).unsqueeze(-1)
                         * self.inv_freq.to(device=x.device, dtype=torch.float64))
            got = self._memo[key] = (ang.cos().to(x.dtype), ang.sin().to(x.dtype))
        return _apply(x, got[0], got[1], partner)

    def turn_table(self, lo: int, hi: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(table, base)``: the float32 ``(cos, sin)`` of every integer turn from ``base`` on, covering
        ``lo..hi`` (row ``t - base`` is turn ``t``; ``[rows, F, 2]`` for the ``F`` frequencies), each from
        its float64 angles rounded once, as :func:`rotate` rounds them. Kept and grown (at least doubled)
        when a later range falls outside, so every layer of a cache and every decode step shares one
        table: a low-bit storage's quantized keys turn by the same few amounts step after step
        (``kvtrim.attention.lowbit.KeyRotation``)."""
        got = self._turns.get(device)
        if got is not None and got[1] <= lo and hi < got[1] + got[0].shape[0]:
            return got
        if got is not None:  # grow to cover both ranges, at least twice as many rows
            old_lo, old_hi = got[1], got[1] + got[0].shape[0] - 1
            lo, hi = min(lo, old_lo), max(hi, old_hi)
            extra = max(0, got[0].shape[0] * 2 - (hi - lo + 1))
            lo, hi = lo - extra // 2, hi + extra - extra // 2
        turns = torch.arange(lo, hi + 1, dtype=torch.float64, device=device).unsqueeze(-1)
        ang = turns * self.inv_freq.to(device=device, dtype=torch.float64)
        table = torch.stack([ang.cos(), ang.sin()], dim=-1).float().contiguous()
        self._turns[device] = (table, lo)
        return table, lo


def find_rotary(model: torch.nn.Module) -> Rotary | None:
    """The model's rotary embedding, verified against the model's own rotary code; None when
    kvtrim cannot re-rotate its keys exactly (no plain RoPE, or a layout kvtrim does not know).

    The check feeds a random head vector through the model's ``rotary_emb`` and its modeling
    module's ``apply_rotary_pos_emb`` at positions ``p`` and ``p + d``, and accepts the layout
    under which kvtrim's rotation by ``d`` maps the first onto the second. The answer is remembered
    per model (an evaluation builds a cache per configuration and sample; the probe runs once).
    """
    if model in _FOUND:
        return _FOUND[model]
    _FOUND[model] = found = _find_rotary(model)
    return found


#: find_rotary's answer per model (weak: forgotten with the model)
_FOUND: "weakref.WeakKeyDictionary[torch.nn.Module, Rotary | None]" = weakref.WeakKeyDictionary()


def _find_rotary(model: torch.nn.Module) -> Rotary | None:
    inv_freq = find_inv_freq(model)
    if inv_freq is None:
        return None
    probe = _rotary_probe(model)
    if probe is None:
        return None
    at_p, at_pd, delta = probe
    for layout in LAYOUTS:
        got = rotate(at_p.double(), delta, inv_freq.double(), layout)
        if torch.allclose(got, at_pd.double(), rtol=1e-4, atol=1e-4 * float(at_pd.abs().max())):
            return Rotary(inv_freq, layout)
    return None


def _rotary_probe(model: torch.nn.Module):
    """``(x rotated at p, x rotated at p + d, d)`` from the model's own rotary code, or None."""
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    apply = None
    for m in model.modules():
        apply = getattr(sys.modules.get(type(m).__module__), "apply_rotary_pos_emb", None)
        if apply is not None:
            break
    if rotary is None or apply is None:
        return None
    p, d = 7, 45
    param = next(model.parameters())
    pos = torch.tensor([[p, p + d]], device=param.device)
    try:
        with torch.no_grad():
            try:
                cos, sin = rotary(torch.zeros(1, device=param.device), pos)
            except TypeError:  # one rotary embedding per layer type (Gemma3): the full-attention layers'
                cos, sin = rotary(torch.zeros(1, device=param.device), pos, FULL)
            # the rotary part only (partial-rotary models split it off before applying RoPE)
            rot_dim = cos.shape[-1]
            g = torch.Generator().manual_seed(0)
            x = torch.randn(1, 1, 1, rot_dim, generator=g).to(param.device).expand(1, 1, 2, rot_dim).contiguous()
            out, _ = apply(x, x, cos.float(), sin.float())
    except Exception:  # noqa: BLE001 - any failure means a rotary interface kvtrim does not know: not re-rotatable
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return out[:, :, :1].float().cpu(), out[:, :, 1:].float().cpu(), torch.tensor([[[d]]])


def find_inv_freq(model: torch.nn.Module) -> torch.Tensor | None:
    """The rotary inverse frequencies of a transformers model (its ``rotary_emb.inv_freq``), or None.

    Models whose RoPE is not a plain per-position rotation (multimodal 3-D RoPE, dynamic scaling
    that changes with length) cannot be re-rotated exactly; callers refuse position re-assignment
    for them.
    """
    cfg = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]  # a transformers model's config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get(FULL), dict):  # per layer type (Gemma3): the full layers' RoPE
        rope = rope[FULL]
    if isinstance(rope, dict):
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype == "dynamic" or "mrope_section" in rope:
            return None
    for name, buf in model.named_buffers():
        # one rotary embedding, or one per layer type (Gemma3: kvtrim compresses the full-attention layers)
        if name.endswith(("rotary_emb.inv_freq", f"rotary_emb.{FULL}_inv_freq")):
            return buf.detach().float()
    return None


def scaling_label(kind: str, factor: float) -> str:
    """A RoPE scaling as ``--rope-scaling`` writes it: ``("yarn", 2.0)`` -> ``"yarn:2"``."""
    return f"{kind}:{float(factor):g}"
