"""Triton kernel: dense causal attention plus a KV method's prompt scores (GPU side of
:mod:`kvtrim.attention.fused`).

One program per (query block of ``BLOCK_M`` rows, batch x query head), two sweeps over the keys
the block sees: the first finds each row's softmax maximum and normaliser (online, exp2), the
second forms the final probabilities of each key tile once and uses them up to four ways: ``p @ v``
into the output, their column sums added atomically into ``col [B, Hq, S]`` (float32; the order
of the additions across query blocks is not fixed, so the sums are equal to float32 rounding,
not bit for bit), their column maxima raised atomically into ``cmax [B, Hq, S]`` and, for the last
``window`` query rows, stored into ``win [B, Hq, w, S]``.
The second sweep recomputes ``q @ k`` (as flash-attention's backward pass does) instead of
keeping a ``[BLOCK_M, S]`` tile: on a GPU that is cheaper than the memory traffic.

Queries are the last ``Tq`` of ``S`` keys (query ``i`` sees keys ``<= S - Tq + i``). Dtypes:
float16, bfloat16 or float32 inputs, float32 accumulation and scores, the output in the input
dtype; on CPU (Triton's interpreter, tests) operands are widened to float32 before each product,
as in :mod:`.kernels`. ``D`` must be a power of two >= 16. Imports triton at import time: go
through :func:`kvtrim.attention.fused.causal_attention_scores` (``backend="triton"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k_base, offs_n, offs_m, offs_d, s_kt, S, OFF, Tq, qk_scale, UPCAST_DOT: tl.constexpr):
    """``qk [BLOCK_M, BLOCK_N]`` in log2 units with invisible entries at -inf, and the visibility mask."""
    key_ok = offs_n < S
    k = tl.load(k_base + offs_n[None, :] * s_kt + offs_d[:, None], mask=key_ok[None, :], other=0.0)
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale
    else:
        qk = tl.dot(q, k) * qk_scale
    mask = key_ok[None, :] & (offs_n[None, :] <= OFF + offs_m[:, None]) & (offs_m[:, None] < Tq)
    return tl.where(mask, qk, float("-inf")), mask


@triton.jit
def _fused_scores_fwd(
    Q, K, V, O, COL, CMAX, WIN,  # noqa: E741 - O is the output, as in the attention equations
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot,
    Tq, S, H, G, qk_scale, W,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_COL: tl.constexpr,
    HAS_WIN: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_CMAX: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    OFF = S - Tq
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + b * s_kb + kvh * s_kh
    v_base = V + b * s_vb + kvh * s_vh
    n_keys = tl.minimum(OFF + (qb + 1) * BLOCK_M, S)  # keys the block's last row sees

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        qk, mask = _scores(q, k_base, start + tl.arange(0, BLOCK_N), offs_m, offs_d, s_kt, S, OFF, Tq, qk_scale, UPCAST_DOT)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(qk - m_safe[:, None]), 1)
        m_i = m_new

    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        qk, mask = _scores(q, k_base, offs_n, offs_m, offs_d, s_kt, S, OFF, Tq, qk_scale, UPCAST_DOT)
        p = tl.where(mask, tl.math.exp2(qk - m_safe[:, None]) * inv_l[:, None], 0.0)
        v = tl.load(v_base + offs_n[:, None] * s_vt + offs_d[None, :], mask=offs_n[:, None] < S, other=0.0)
        if UPCAST_DOT:
            acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc += tl.dot(p.to(v.dtype), v)
        if HAS_COL:
            tl.atomic_add(COL + bh * S + offs_n, tl.sum(p, 0), mask=offs_n < S)
        if HAS_CMAX:
            tl.atomic_max(CMAX + bh * S + offs_n, tl.max(p, 0), mask=offs_n < S)
        if HAS_WIN:
            w_row = offs_m - (Tq - W)
            w_ok = (w_row[:, None] >= 0) & row_ok[:, None] & (offs_n[None, :] < S)
            tl.store(WIN + (bh * W + w_row[:, None]) * S + offs_n[None, :], p, mask=w_ok)
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def causal_attention_scores_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, column_sums: bool,
                                   window: int, column_max: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``q [B, Hq, Tq, D]``, ``k, v [B, Hkv, S, D]`` (one dtype, last dimension contiguous) ->
    ``(out [B, Tq, Hq, D], col [B, Hq, S] | None, win [B, Hq, w, S] | None, cmax [B, Hq, S] | None)``;
    shapes checked by the caller."""
    b, hq, tq, d = q.shape
    s = k.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernel; got {d}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    w = min(window, tq)
    out = torch.empty(b, tq, hq, d, dtype=q.dtype, device=q.device)
    o = out.transpose(1, 2)  # [B, Hq, Tq, D] view of transformers' [B, Tq, Hq, D] layout
    col = torch.zeros(b, hq, s, dtype=torch.float32, device=q.device)
    # probabilities are >= 0, so 0 starts the maxima; one element stands in when not asked for
    cmax = torch.zeros((b, hq, s) if column_max else (1,), dtype=torch.float32, device=q.device)
    win = torch.zeros(b, hq, max(w, 1), s, dtype=torch.float32, device=q.device)
    block_m, block_n = 64, 64
    grid = (triton.cdiv(tq, block_m), b * hq)
    _fused_scores_fwd[grid](
        q, k, v, o, col, cmax, win,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        tq, s, hq, hq // k.shape[1], scale * _LOG2E, w,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, HAS_COL=column_sums, HAS_WIN=w > 0,
        UPCAST_DOT=q.device.type == "cpu",  # CPU = the interpreter (see kernels.py)
        HAS_CMAX=column_max,
    )
    return out, (col if column_sums else None), (win if w > 0 else None), (cmax if column_max else None)
