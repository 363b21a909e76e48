"""Sparse prefill attention (MInference): patterns, index estimation, reference and fast paths.

Plain tensors in and out; nothing here knows about transformers or the rest of kvtrim (only
:mod:`kvtrim.errors` and :mod:`kvtrim.validate`; ``tests/test_architecture.py`` checks it). The
hook that runs these kernels inside a transformers model is
:class:`kvtrim.integrations.prefill.SparsePrefill`; the offline pattern search is
:mod:`kvtrim.tools.search_patterns`.

- ``q``: ``[batch, q_heads, seq, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, seq, head_dim]``,
  ``q_heads = kv_heads * group`` (GQA; query head ``h`` reads KV head ``h // group``).
- A pattern (:class:`AShape`, :class:`VerticalSlash`, :class:`BlockSparse`) turns ``q, k`` into a
  :class:`SparseLayout` (per query head); a backend computes attention over it:
  :func:`sparse_attention_cpu` (CPU), ``kvtrim.attention.triton.sparse_attention_triton`` (GPU,
  needs ``triton``), and the oracle ``masked_attention(q, k, v, layout_to_mask(layout))``.

Example::

    layout = VerticalSlash(k_v=1000, k_s=6096).layout(q, k)
    out = sparse_prefill(q, k, v, layout)
"""

from __future__ import annotations

import torch

from kvtrim.attention.cpu import sparse_attention_cpu
from kvtrim.attention.patterns import (
    AShape,
    BlockSparse,
    SparseLayout,
    VerticalSlash,
    dense_layout,
    layout_from_block_mask,
    vertical_slash_layout,
)
from kvtrim.attention.reference import dense_attention, layout_to_mask, masked_attention

__all__ = [
    "AShape",
    "BlockSparse",
    "SparseLayout",
    "VerticalSlash",
    "dense_attention",
    "dense_layout",
    "layout_from_block_mask",
    "layout_to_mask",
    "masked_attention",
    "sparse_attention_cpu",
    "sparse_prefill",
    "vertical_slash_layout",
]


def sparse_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    scaling: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse causal prefill over ``layout``; ``backend`` is ``"auto"`` (Triton on CUDA, else CPU),
    ``"cpu"``, ``"triton"`` or ``"reference"``. Returns ``[B, Hq, T, D]`` in ``q.dtype``."""
    if backend == "auto":
        backend = "triton" if q.is_cuda else "cpu"
    if backend == "cpu":
        return sparse_attention_cpu(q, k, v, layout, scaling)
    if backend == "triton":
        from kvtrim.attention.triton import sparse_attention_triton

        return sparse_attention_triton(q, k, v, layout, scaling)
    if backend == "reference":
        return masked_attention(q, k, v, layout_to_mask(layout).to(q.device), scaling)
    raise ValueError(f"backend must be 'auto', 'cpu', 'triton' or 'reference'; got {backend!r}")
