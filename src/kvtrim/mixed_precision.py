"""Mixed precision on a CPU without bfloat16 arithmetic: weights and KV stored in bfloat16, a long
forward (a prompt, a long turn) computed in float32, a decode step in bfloat16.

Where the CPU has no bfloat16 instructions (no AVX-512 BF16, no AMX), PyTorch computes a bfloat16
matrix product by converting its operands, and a compute-bound prefill runs slower than in float32
(2.9x on a 7.3k prompt on an AVX2-only CPU), while a memory-bound decode step still gains from
reading half the bytes (1.7x there). :func:`install` gives a bfloat16 model both: in a forward of
more than ``min_rows`` token rows,

- the input embeddings' output is widened to float32, so the residual stream, the norms, the
  rotary tables and the attention run in float32;
- each ``nn.Linear`` (replaced by a :class:`MixedLinear` holding the very same parameters)
  multiplies in float32 by its weight widened for that one product: one layer's float32 weight
  exists at a time, on top of the bfloat16 model, and is freed right after;
- the keys and values are rounded to bfloat16 when kvtrim's cache stores them
  (``KVTrimCache`` reads :func:`storage_dtype`), and kvtrim's attention function widens the stored
  ones back to the query's float32 for the attention itself.

A forward of ``min_rows`` rows or fewer (a decode step, a short turn) runs in bfloat16 as in a plain
bfloat16 model; a linear that receives float32 rows there (the output projection reading the last
position of a long forward) rounds them to bfloat16 first. Nothing happens at import: only a model
:func:`install` was called on (``kvtrim.load_model(dtype="auto")`` on such a CPU) is changed, and
:func:`remove` puts plain ``nn.Linear`` modules back and removes the hook.

:func:`bf16_matmul_fast` is the one-time measurement behind ``dtype="auto"``: whether a bfloat16
product of a prefill's shape is at least as fast as the float32 one on this CPU.
"""
from __future__ import annotations

import functools
import time
import weakref
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MIN_ROWS", "MixedLinear", "bf16_matmul_fast", "install", "installed", "remove", "storage_dtype"]

#: a forward of more than this many token rows computes in float32 (a prompt, a long turn): at 64
#: rows a product's arithmetic already outweighs widening its weight once (64 multiply-adds per
#: weight element against one conversion), and below it a step is about reading the weights
MIN_ROWS = 64

# models install() was called on -> their storage dtype; weak, so a model that is gone leaves no entry
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, tuple[torch.dtype, list]] = weakref.WeakKeyDictionary()


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1]) if x.dim() else 0


class MixedLinear(nn.Module):
    """An ``nn.Linear`` with a bfloat16 (or float16) weight that computes an input of more than
    ``min_rows`` rows in float32 (the weight widened for that product only) and returns float32,
    and a shorter input in the weight's dtype (a float32 input rounded to it first).

    It holds the linear's own ``weight`` and ``bias`` parameters (a tied weight stays tied;
    ``state_dict()`` keys are unchanged). ``(..., in_features)`` to ``(..., out_features)``.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = int(min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rows(x) > self.min_rows:
            w = self.weight.float()
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), w, b)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float32 above {self.min_rows} rows")


def _linears(model: nn.Module, cls: type) -> list[tuple[nn.Module, str, nn.Module]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is cls]


def install(model: nn.Module, min_rows: int = MIN_ROWS) -> int:
    """Make ``model`` (bfloat16 or float16 weights, on the CPU) compute forwards of more than
    ``min_rows`` token rows in float32, as the module docstring says; returns how many linears now
    do. Subclasses of ``nn.Linear`` (quantized or adapter layers) and linears of another dtype are
    left alone. Installing twice is refused; :func:`remove` undoes it."""
    if model in _INSTALLED:
        raise ValueError("mixed precision is already installed on this model")
    first = next(model.parameters(), None)
    dtype = torch.float32 if first is None else first.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mixed precision widens bfloat16 or float16 weights, not {dtype}")
    n = 0
    for parent, name, lin in _linears(model, nn.Linear):
        if lin.weight.dtype == dtype:
            setattr(parent, name, MixedLinear(cast(nn.Linear, lin), min_rows))
            n += 1
    handles = []
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embed, nn.Module):
        def widen(module, args, output):
            if isinstance(output, torch.Tensor) and output.is_floating_point() and _rows(output) > min_rows:
                return output.float()
            return None

        handles.append(embed.register_forward_hook(widen))
    _INSTALLED[model] = (dtype, handles)
    return n


def remove(model: nn.Module) -> int:
    """Undo :func:`install`: plain ``nn.Linear`` modules with the same parameters, the hook removed;
    returns how many linears were put back (0 for a model it was never installed on)."""
    entry = _INSTALLED.pop(model, None)
    if entry is None:
        return 0
    for h in entry[1]:
        h.remove()
    n = 0
    for parent, name, mod in _linears(model, MixedLinear):
        ml = cast(MixedLinear, mod)
        lin = nn.Linear(ml.in_features, ml.out_features, bias=ml.bias is not None, device="meta")
        lin.weight = ml.weight
        lin.bias = ml.bias
        setattr(parent, name, lin)
        n += 1
    return n


def installed(model: nn.Module) -> bool:
    """Whether :func:`install` is in effect on ``model``."""
    return model in _INSTALLED


def storage_dtype(model) -> torch.dtype | None:
    """The dtype kvtrim's cache stores keys and values in for ``model`` when it computes long
    forwards in float32 (:func:`install`): its weights' dtype; None for every other model (the cache
    then stores what the model hands it, as it always did)."""
    if not isinstance(model, nn.Module):
        return None
    entry = _INSTALLED.get(model)
    return None if entry is None else entry[0]


#: the probe's product: 128 prompt rows times a 1024 x 1024 weight (about 0.13 G multiply-adds,
#: a few milliseconds in float32 on one core)
PROBE_SHAPE = (128, 1024, 1024)


@functools.cache
def bf16_matmul_fast(threads: int) -> bool:
    """Whether a bfloat16 matrix product of a prefill's shape (:data:`PROBE_SHAPE`) runs at least as
    fast as the float32 one here, with ``threads`` torch threads (the caller passes
    ``torch.get_num_threads()``; measured once per process and thread count): one warm-up of each,
    then the best of three of each, alternating. Stops early once bfloat16 is 3x slower."""
    m, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    with torch.inference_mode():
        for rep in range(4):
            for dt, (a, b) in ((torch.float32, (a32, b32)), (torch.bfloat16, (a16, b16))):
                t0 = time.perf_counter()
                torch.mm(a, b)
                if rep:
                    best[dt] = min(best[dt], time.perf_counter() - t0)
            if best[torch.bfloat16] > 3 * best[torch.float32]:
                break
    return best[torch.bfloat16] <= best[torch.float32]
