"""Fused CPU layers: a transformer block's element-wise work done inside the passes that are there anyway.

A profile of the reference model's dense bfloat16 prefill on a CPU (docs/dtypes.md) puts about a
fifth of the forward in element-wise passes over large tensors: the gated MLP's SiLU and product
(two full passes over a ``[tokens, intermediate]`` tensor, 4,864 wide on Qwen2.5-0.5B) and the RMS
norms' float32 round trips (six passes each). Two replacements remove them:

- :class:`FusedGatedMLP` (bfloat16 models whose linears are packed, :mod:`kvtrim.cpu_linear`):
  ``down(silu(gate(x)) * up(x))`` with the SiLU and the product as oneDNN post-operations of the
  gate and up products (``torch.ops.mkldnn._linear_pointwise`` with ``"swish"``, then its
  ``binary`` form with ``"mul"``: the calls PyTorch's own CPU compiler emits for this pattern),
  so the ``[tokens, intermediate]`` tensor is written once and read once, and in slices of
  :data:`MLP_CHUNK_ROWS` tokens, so that it is read back from the cache rather than from memory
  (and a long prompt's MLP needs a slice's intermediate tensor, not the whole prompt's). The SiLU is taken of
  the float32 accumulator instead of the product rounded to bfloat16 first, so results differ
  from transformers' by bfloat16 rounding (measured in the tests and docs/dtypes.md).
- :class:`FusedRMSNorm` (float32 and bfloat16 models): the Llama-family RMS norm in one pass
  (:func:`kvtrim.attention.native.native_rms_norm`; the normalised row is rounded to the model's
  dtype before the weight, as transformers does; a value can differ in its last bit).

:func:`fuse_layers` swaps them in where a module is one of these layers (its structure, then its
output on random rows against the module's own, are checked first: a module that computes
something else, such as Gemma's ``(1 + weight)`` norm, is left alone); :func:`unfuse_layers`
puts the original modules back. ``state_dict()`` keys and values do not change. Inputs the fused
path does not take (another dtype, a GPU tensor) go through the original module.
"""
from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from kvtrim.attention.native import cpu_kernel, load_native
from kvtrim.cpu_linear import PackedLinear

__all__ = ["MLP_CHUNK_ROWS", "FusedGatedMLP", "FusedRMSNorm", "fuse_layers", "fused_count", "unfuse_layers"]

logger = logging.getLogger(__name__)

_SILU_TYPES = ("SiLU", "SiLUActivation")

#: Rows (tokens) of a fused MLP computed together: a long prompt's MLP runs in slices of this many
#: tokens, so each slice's ``[rows, intermediate]`` tensor stays in the core's cache between the
#: products (measured fastest of 128-2,048 on Qwen2.5-0.5B's MLP, docs/dtypes.md).
MLP_CHUNK_ROWS = 512
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _mlp_post_ops_available() -> bool:
    lin = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return lin is not None and hasattr(lin, "binary")


class FusedGatedMLP(nn.Module):
    """A gated MLP (``down(silu(gate(x)) * up(x))``) over packed linears, SiLU and product fused
    into the products (module docstring). Holds the original module's three linears under their
    names (``state_dict`` unchanged); :meth:`original` is the module it replaced."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj = cast(PackedLinear, mlp.gate_proj)
        self.up_proj = cast(PackedLinear, mlp.up_proj)
        self.down_proj = cast(PackedLinear, mlp.down_proj)
        self._original = (mlp,)  # a tuple: not registered as a child

    def original(self) -> nn.Module:
        return self._original[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not all(isinstance(p, PackedLinear) for p in projs):
            # transformers' computation, through the linears held now (unpack_linears may have
            # replaced them by plain ones)
            act = cast(Any, self._original[0]).act_fn
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MLP_CHUNK_ROWS:
            return self._rows(rows).view(*x.shape[:-1], -1)
        out = torch.empty(rows.shape[0], self.down_proj.out_features, dtype=x.dtype)
        for i in range(0, rows.shape[0], MLP_CHUNK_ROWS):
            out[i : i + MLP_CHUNK_ROWS] = self._rows(rows[i : i + MLP_CHUNK_ROWS])
        return out.view(*x.shape[:-1], -1)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        lin = torch.ops.mkldnn._linear_pointwise
        g = lin(x, self.gate_proj.packed_weight, self.gate_proj.bias, "swish", [], "")
        h = lin.binary(x, g, self.up_proj.packed_weight, self.up_proj.bias, "mul")
        return self.down_proj(h)


class FusedRMSNorm(nn.Module):
    """A Llama-family RMS norm in one pass (module docstring); ``weight`` is the original's
    Parameter, :meth:`original` the module it replaced."""

    def __init__(self, norm: nn.Module, eps: float) -> None:
        super().__init__()
        if not load_native():  # forward calls the native op directly, without asking again
            raise RuntimeError("FusedRMSNorm needs kvtrim's native CPU kernel, which could not be built here")
        self.weight = cast(nn.Parameter, norm.weight)
        self.variance_epsilon = float(eps)
        self._original = (norm,)

    def original(self) -> nn.Module:
        return self._original[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return self._original[0](x)
        # kvtrim.attention.native.native_rms_norm without its per-call build check (done in __init__):
        # this runs twice per layer at every decode step
        return torch.ops.kvtrim_native.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


def _norm_eps(mod: nn.Module) -> float | None:
    """The epsilon of a module shaped like a Llama-family RMS norm (one 1-D ``weight``, a float
    epsilon, nothing else), else None."""
    if not type(mod).__name__.endswith("RMSNorm") or any(True for _ in mod.children()) or any(True for _ in mod.buffers()):
        return None
    params = dict(mod.named_parameters(recurse=False))
    w = params.get("weight")
    if set(params) != {"weight"} or w is None or w.dim() != 1 or w.device.type != "cpu":
        return None
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def _is_gated_mlp(mod: nn.Module) -> bool:
    kids = dict(mod.named_children())
    return set(kids) == _MLP_CHILDREN and all(isinstance(kids[n], PackedLinear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and type(kids["act_fn"]).__name__ in _SILU_TYPES


@torch.inference_mode()
def _agrees(original: nn.Module, fused: nn.Module, width: int, dtype: torch.dtype, rtol: float) -> bool:
    """Whether ``fused`` gives ``original``'s output on a few random rows (relative error of the
    whole output at most ``rtol``)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, width, generator=g) * 2).to(dtype)
    want, got = original(x).float(), fused(x).float()
    if want.shape != got.shape or not torch.isfinite(got).all():
        return False
    return float((want - got).norm() / want.norm().clamp(min=1e-12)) <= rtol


def fuse_layers(model: nn.Module) -> int:
    """Replace the model's gated MLPs over packed bfloat16 linears by :class:`FusedGatedMLP` and its
    float32/bfloat16 RMS norms by :class:`FusedRMSNorm` (module docstring), in place; returns how
    many modules were replaced. The native kernel is built on first use; where it cannot be (or
    ``KVTRIM_CPU_KERNEL=torch`` asks for the PyTorch path), the norms are left alone. Undo with
    :func:`unfuse_layers`."""
    native = cpu_kernel() == "native"  # KVTRIM_CPU_KERNEL=torch: no native code, so the norms stay as they are
    post_ops = _mlp_post_ops_available()
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if post_ops and _is_gated_mlp(child):
                cand = FusedGatedMLP(child)
                new = cand if _agrees(child, cand, cand.gate_proj.in_features, torch.bfloat16, 2e-2) else None
            elif native and (eps := _norm_eps(child)) is not None:
                weight = cast(torch.Tensor, child.weight)
                if weight.dtype not in (torch.float32, torch.bfloat16):
                    continue
                cand_norm = FusedRMSNorm(child, eps)
                # one unit in the last place of the dtype, relative: the only difference allowed
                tol = 2.0 ** -7 if weight.dtype == torch.bfloat16 else 1e-6
                new = cand_norm if _agrees(child, cand_norm, int(weight.shape[0]), weight.dtype, tol) else None
            if new is None:
                continue
            setattr(parent, name, new)
            n += 1
    if n:
        logger.info("fused %d CPU layers (kvtrim.cpu_layers)", n)
    return n


def unfuse_layers(model: nn.Module) -> int:
    """Put back the original module of every :class:`FusedGatedMLP` and :class:`FusedRMSNorm` (with
    the linears the fused one holds now); returns how many were put back."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedGatedMLP):
                orig = child.original()
                for attr in ("gate_proj", "up_proj", "down_proj"):
                    setattr(orig, attr, getattr(child, attr))
            elif isinstance(child, FusedRMSNorm):
                orig = child.original()
            else:
                continue
            setattr(parent, name, orig)
            n += 1
    return n


def fused_count(model: nn.Module) -> dict[str, int]:
    """How many fused modules of each kind a model holds: ``{"mlp": ..., "rms_norm": ...}``."""
    mods = list(model.modules())
    return {"mlp": sum(isinstance(m, FusedGatedMLP) for m in mods), "rms_norm": sum(isinstance(m, FusedRMSNorm) for m in mods)}
