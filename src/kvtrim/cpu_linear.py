"""Pre-packed CPU linears: the model's bfloat16 ``nn.Linear`` weights stored in oneDNN's blocked
layout, so that a decode step's matrix-vector products read the weights at close to the memory
bandwidth.

PyTorch's ``F.linear`` on a bfloat16 CPU tensor multiplies by the weight in its plain layout;
for one row of input (a decode step) that measures about twice as slow as a product with a
weight oneDNN has reordered once for its kernel. oneDNN, which PyTorch ships, does that reorder
(``torch.ops.mkldnn._reorder_linear_weight``, the call PyTorch's own CPU compiler uses when it
freezes a model) and multiplies by the result (``torch.ops.mkldnn._linear_pointwise``); vLLM's
CPU backend packs its weights the same way. It makes a bfloat16 decode step's linears markedly
faster (measured in docs/dtypes.md, "Linear layers on CPU"). The results are the same products
with fp32 accumulation (the tests compare them with ``F.linear``).

:func:`pack_linears` replaces each packable ``nn.Linear`` of a model by a :class:`PackedLinear`
holding only the packed weight (the plain one is freed, so the weights take no more memory);
:func:`unpack_linears` puts plain ``nn.Linear`` modules back with the same weights (unpacked by
a product with the identity: exact, except that a -0.0 comes back as +0.0). A linear whose weight
is shared with another module (an output projection tied to the input embeddings) is packed
only with ``tied=True``: the packed copy is then extra memory (``PackedLinear.extra_bytes``), because the embedding lookup
still needs the plain layout. ``state_dict()`` of a packed module holds the plain weight, so
saving and copying a model keep working.

Only bfloat16 on CPU is packed, and only where oneDNN says this CPU supports it
(:func:`packing_supported`); float32 and float16 weights, and modules on a GPU, are left as they
are. Autograd is not supported through a packed linear (kvtrim runs inference only).
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_linears", "packed_count", "packing_supported", "unpack_linears"]


def packing_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True where linears of ``dtype`` can be packed here: bfloat16, with oneDNN available and
    reporting bfloat16 support for this CPU (AVX-512 or newer)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return bool(ops._is_mkldnn_bf16_supported()) and hasattr(ops, "_reorder_linear_weight") \
            and hasattr(ops, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose bfloat16 weight is held in oneDNN's packed layout (see the module
    docstring). ``forward`` takes and returns what the linear did: ``(..., in_features)`` to
    ``(..., out_features)``, in bfloat16.

    Attributes:
        in_features, out_features: as on the linear.
        bias: the linear's bias (a parameter, or None).
        extra_bytes: memory this module holds beyond the model's own weights (the packed copy of
            a tied weight; 0 for an untied one, whose plain weight was freed).
    """

    def __init__(self, linear: nn.Linear, *, shared: bool = False) -> None:
        super().__init__()
        w = linear.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16:
            raise ValueError(f"PackedLinear packs a bfloat16 weight on the CPU, not {w.dtype} on {w.device}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
        self.register_buffer("packed_weight", packed, persistent=False)
        # A shared (tied) weight stays reachable through the other module, so keeping a reference
        # costs nothing and unpacking returns the very same Parameter.
        self._shared_weight: torch.Tensor | None = w if shared else None
        self.extra_bytes = packed.numel() * packed.element_size() if shared else 0
        self._requires_grad = w.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"PackedLinear takes bfloat16 input, got {x.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def plain_weight(self) -> torch.Tensor:
        """The weight in the plain ``(out_features, in_features)`` layout: the shared Parameter for a
        tied weight, else unpacked by the product with the identity (exact; -0.0 reads as +0.0)."""
        if self._shared_weight is not None:
            return self._shared_weight
        with torch.no_grad():
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            return torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], "").t().contiguous()

    def weight_elements(self, flat_index: torch.Tensor) -> torch.Tensor:
        """Elements of the plain weight at ``flat_index`` (indices into its row-major flattening),
        read without unpacking all of it: one product with the few identity rows they need."""
        if self._shared_weight is not None:
            return self._shared_weight.detach().reshape(-1)[flat_index]
        rows, cols = flat_index // self.in_features, flat_index % self.in_features
        uniq, where = torch.unique(cols, return_inverse=True)
        with torch.no_grad():
            eye = torch.zeros(len(uniq), self.in_features, dtype=torch.bfloat16)
            eye[torch.arange(len(uniq)), uniq] = 1
            out = torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], "")
        return out[where, rows]

    @property
    def weight(self) -> torch.Tensor:
        """Read-only: the plain weight (:meth:`plain_weight`; computed on each read for an untied one)."""
        return self.plain_weight()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.plain_weight() if keep_vars else self.plain_weight().detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        tied = ", tied" if self._shared_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed{tied}"


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {k for k, n in owners.items() if n > 1}


def _linears(model: nn.Module, cls: type) -> list[tuple[nn.Module, str, nn.Module]]:
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is cls:
                out.append((parent, name, child))
    return out


def pack_linears(model: nn.Module, *, tied: bool = False) -> int:
    """Pack the model's bfloat16 CPU ``nn.Linear`` modules in place (:class:`PackedLinear`);
    returns how many were packed. Linears of another dtype or device, subclasses of
    ``nn.Linear`` (quantized or adapter layers) and, unless ``tied``, linears whose weight another
    module shares are left alone. Nothing is packed where :func:`packing_supported` is False.
    Undo with :func:`unpack_linears`."""
    if not packing_supported(torch.bfloat16):
        return 0
    shared = _shared_weights(model)
    n = 0
    for parent, name, lin in _linears(model, nn.Linear):
        w = lin.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            continue
        is_shared = id(w) in shared
        if is_shared and not tied:
            continue
        setattr(parent, name, PackedLinear(cast(nn.Linear, lin), shared=is_shared))
        n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Replace every :class:`PackedLinear` of the model by a plain ``nn.Linear`` with the same
    weight (a tied one gets its shared Parameter back); returns how many were unpacked."""
    n = 0
    for parent, name, mod in _linears(model, PackedLinear):
        pl = cast(PackedLinear, mod)
        lin = nn.Linear(pl.in_features, pl.out_features, bias=pl.bias is not None, device="meta")
        w = pl.plain_weight()
        lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=pl._requires_grad)
        lin.bias = pl.bias
        setattr(parent, name, lin)
        n += 1
    return n


def packed_count(model: nn.Module) -> tuple[int, int]:
    """``(packed linears, extra bytes they hold)`` for a model."""
    mods = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return len(mods), sum(m.extra_bytes for m in mods)
