"""Dense causal attention that also returns a KV method's scores, from the same probabilities.

A KV-cache method that scores a prompt by its attention (H2O's and Elastic Cache's per-key column
sums over all queries; kvzip's per-key column maxima, the largest probability any reconstructing
query gives a key; SnapKV's and Inf-MLLM's softmax rows of the last ``window`` queries) would
otherwise compute ``q @ K^T`` and the softmax a second time after the model's attention.
:func:`causal_attention_scores` computes the attention output and those scores in one pass over
each query block (the block's probabilities are formed once, used for ``P @ V``, summed and maxed).

Layouts: ``q [B, Hq, Tq, D]`` are the last ``Tq`` of the ``S`` keys of ``k, v [B, Hkv, S, D]``
(query ``i`` sees keys ``<= S - Tq + i``, bottom-right causal), ``Hq = Hkv * G``, query head ``h``
reads KV head ``h // G``. Outputs: ``out [B, Tq, Hq, D]`` in q's dtype (transformers' attention
layout), ``col_sums [B, Hq, S]``, ``col_max [B, Hq, S]`` and ``window_probs [B, Hq, w, S]``
float32 whatever the input dtype (``w = min(window, Tq)``; entries beyond the keys a row sees are 0;
a key no query sees has column maximum 0).

Backends: ``"native"`` (kvtrim's C++ CPU kernel, ``csrc/fused_scores.cpp``; float32, bfloat16 and
float16 in, float32 arithmetic), ``"triton"`` (``triton/fused.py``, GPU; two sweeps over the keys,
column sums added atomically) and ``"reference"`` (:func:`causal_attention_scores_reference`,
plain PyTorch, materialises ``[Tq, S]`` per head: the oracle). Tolerance rule (tests): the output's
error against a float64 reference is at most twice that of PyTorch's SDPA in the input dtype; the
scores equal :func:`kvtrim.scores.causal_column_sums` / ``window_probs`` (and the reference's
column maxima) within float32 rounding.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from kvtrim.attention.native import NATIVE_DTYPES, kernel_for, native_causal_attention_scores

__all__ = ["FusedAttention", "causal_attention_scores", "causal_attention_scores_reference", "fused_backend"]


class FusedAttention(NamedTuple):
    """``out [B, Tq, Hq, D]`` (q's dtype), ``col_sums [B, Hq, S]``, ``window_probs [B, Hq, w, S]``
    and ``col_max [B, Hq, S]`` (float32, None when not asked for)."""

    out: torch.Tensor
    col_sums: torch.Tensor | None
    window_probs: torch.Tensor | None
    col_max: torch.Tensor | None = None


def fused_backend(q: torch.Tensor) -> str | None:
    """The fast backend for inputs like ``q``: "native" on CPU when kvtrim's C++ kernel is built,
    "triton" on CUDA when triton is installed (float32, bfloat16, float16 in both cases), or None
    where there is none (then a caller keeps its two passes)."""
    if q.dtype not in NATIVE_DTYPES:
        return None
    if q.device.type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else None
    if q.device.type != "cpu":
        return None
    return "native" if kernel_for(q) == "native" else None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, Hq, Tq, D] and k, v [B, Hkv, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, tq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] < tq or tq < 1 or hq % k.shape[1]:
        raise ValueError(f"need k, v [B={b}, Hkv | {hq}, S >= {tq}, D={d}]; got {tuple(k.shape)}")


def causal_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                            column_sums: bool = True, window: int = 0, backend: str = "native",
                            column_max: bool = False) -> FusedAttention:
    """Causal attention and, from the same probabilities, per-key column sums, per-key column
    maxima and/or the last ``window`` probability rows (layouts in the module docstring).

    ``backend``: ``"native"`` (CPU; raises when the kernel is unavailable, see :func:`fused_backend`),
    ``"triton"`` (GPU, or Triton's interpreter on CPU under ``TRITON_INTERPRET=1``) or
    ``"reference"``. Memory beyond the outputs: the native kernel holds one ``[128, S]`` float32
    block of exponentials per thread.
    """
    _check(q, k, v)
    if backend == "reference":
        return causal_attention_scores_reference(q, k, v, scale, column_sums=column_sums, window=window,
                                                 column_max=column_max)
    if backend == "triton":
        from kvtrim.attention.triton.fused import causal_attention_scores_triton

        return FusedAttention(*causal_attention_scores_triton(q, k, v, scale, column_sums, window, column_max))
    if backend != "native":
        raise ValueError(f"backend must be 'native', 'triton' or 'reference'; got {backend!r}")
    b, hq, tq, d = q.shape
    out = torch.empty(b, tq, hq, d, dtype=q.dtype)
    cols, wins, maxes = [], [], []
    for i in range(b):
        _, col, win, cmax = native_causal_attention_scores(q[i], k[i], v[i], scale, column_sums=column_sums,
                                                           window=window, out=out[i].transpose(0, 1),
                                                           column_max=column_max)
        cols.append(col)
        wins.append(win)
        maxes.append(cmax)
    col_sums = torch.stack(cols) if column_sums else None  # type: ignore[arg-type]
    window_probs = torch.stack(wins) if window > 0 else None  # type: ignore[arg-type]
    col_max = torch.stack(maxes) if column_max else None  # type: ignore[arg-type]
    return FusedAttention(out, col_sums, window_probs, col_max)


def causal_attention_scores_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                                      column_sums: bool = True, window: int = 0,
                                      column_max: bool = False) -> FusedAttention:
    """Plain PyTorch :func:`causal_attention_scores`: the whole ``[Tq, S]`` softmax per head, in
    float32 (float64 for float64 inputs)."""
    _check(q, k, v)
    hq, tq, s = q.shape[1], q.shape[2], k.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = hq // k.shape[1]
    kk, vv = k.to(ct).repeat_interleave(g, 1), v.to(ct).repeat_interleave(g, 1)
    logits = (q.to(ct) @ kk.transpose(-1, -2)) * scale
    visible = torch.ones(tq, s, dtype=torch.bool, device=q.device).tril(s - tq)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    out = (probs @ vv).transpose(1, 2).to(q.dtype)
    w = min(window, tq)
    return FusedAttention(out, probs.sum(dim=-2).to(torch.float32) if column_sums else None,
                          probs[:, :, tq - w:].to(torch.float32) if w > 0 else None,
                          probs.amax(dim=-2).to(torch.float32) if column_max else None)
