"""GPU (Triton) sparse-prefill kernels; ``triton`` is imported only when a kernel is called.

One kernel (:mod:`.kernels`) serves all three MInference patterns, because every pattern is
expressed as a :class:`~kvtrim.attention.patterns.SparseLayout`: block-sparse and A-shape as key
blocks (A-shape with its element-wise sink/local window on), vertical-slash as the blocks its
slashes cross plus gathered vertical columns. Install the ``triton`` package (GPU wheels bundle it
with CUDA torch); on CPU set ``TRITON_INTERPRET=1`` before triton is first imported to run the
kernel in Triton's interpreter (slow; tests only).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtrim.attention.patterns import SparseLayout

__all__ = ["triton_available", "sparse_attention_triton", "vertical_slash_attention_triton", "block_sparse_attention_triton", "a_shape_attention_triton"]


def triton_available() -> bool:
    """True if the ``triton`` package can be imported (it says nothing about a GPU)."""
    return importlib.util.find_spec("triton") is not None


def sparse_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float | None = None
) -> torch.Tensor:
    """Sparse causal prefill on the Triton kernel; see :func:`.kernels.sparse_attention_triton`."""
    if not triton_available():
        raise ImportError("the Triton kernels need the 'triton' package: pip install triton")
    from kvtrim.attention.triton.kernels import sparse_attention_triton as run

    return run(q, k, v, layout, scaling)


def _check_kind(layout: SparseLayout, want_window: bool, want_cols: bool | None, name: str) -> None:
    has_window = layout.n_init is not None and layout.n_local is not None
    if has_window != want_window or (want_cols is False and layout.col_idx.shape[-1] > 0):
        raise ValueError(f"{name} got a layout of another pattern (window={has_window}, columns={layout.col_idx.shape[-1] > 0})")


def vertical_slash_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float | None = None
) -> torch.Tensor:
    """Vertical-slash prefill: slash blocks + vertical columns (layout from ``VerticalSlash.layout``)."""
    _check_kind(layout, want_window=False, want_cols=None, name="vertical_slash_attention_triton")
    return sparse_attention_triton(q, k, v, layout, scaling)


def block_sparse_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float | None = None
) -> torch.Tensor:
    """Block-sparse prefill (layout from ``BlockSparse.layout``)."""
    _check_kind(layout, want_window=False, want_cols=False, name="block_sparse_attention_triton")
    return sparse_attention_triton(q, k, v, layout, scaling)


def a_shape_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float | None = None
) -> torch.Tensor:
    """A-shape prefill: sink + local blocks with the element-wise window (``AShape.layout``)."""
    _check_kind(layout, want_window=True, want_cols=False, name="a_shape_attention_triton")
    return sparse_attention_triton(q, k, v, layout, scaling)
