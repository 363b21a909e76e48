"""Rotary position helpers: re-rotating cached keys (and queries) by a position difference.

RoPE is a rotation per frequency pair, so a vector rotated at position ``p`` is moved to position
``p + delta`` by one more rotation by ``delta``. kvtrim uses this for the ``reassigned`` and
``compressed`` position policies (METHODS.md §0): keys are cached after RoPE by the model, and
kvtrim re-rotates them to in-cache positions. Angles are computed in float64 so that large
position values do not lose phase precision.

Layout conventions follow transformers' ``rotate_half`` (the two halves of the rotary dims hold
the cos and sin partners).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, D]`` by ``delta [..., S]`` positions (broadcast over leading dims).

    Only the first ``2 * len(inv_freq)`` dims are rotary (partial rotary models keep the rest).
    """
    rot_dim = 2 * inv_freq.shape[-1]
    freq = inv_freq.to(device=x.device, dtype=torch.float64)
    if delta.numel() > 64 and not delta.is_floating_point():
        # a cache's deltas take few distinct values (an eviction shifts every later key by the same
        # amount): the float64 cos/sin are computed once per distinct delta, then indexed
        uniq, inverse = torch.unique(delta.reshape(-1), return_inverse=True)
        ang = uniq.to(torch.float64).unsqueeze(-1) * freq
        ang = torch.cat((ang, ang), dim=-1)
        cos = ang.cos().to(x.dtype).index_select(0, inverse).view(*delta.shape, rot_dim)
        sin = ang.sin().to(x.dtype).index_select(0, inverse).view(*delta.shape, rot_dim)
    else:
        ang = delta.to(torch.float64).unsqueeze(-1) * freq
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    if rot_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def find_inv_freq(model: torch.nn.Module) -> torch.Tensor | None:
    """The rotary inverse frequencies of a transformers model (its ``rotary_emb.inv_freq``), or None.

    Models whose RoPE is not a plain per-position rotation (multimodal 3-D RoPE, dynamic scaling
    that changes with length) cannot be re-rotated exactly; callers refuse position re-assignment
    for them.
    """
    cfg = cast("PretrainedConfig", model.config).get_text_config(decoder=True)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict):
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype == "dynamic" or "mrope_section" in rope:
            return None
    for name, buf in model.named_buffers():
        if name.endswith("rotary_emb.inv_freq"):
            return buf.detach().float()
    return None
