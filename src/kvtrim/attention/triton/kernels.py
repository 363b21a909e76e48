"""Triton sparse-prefill kernel: one program per (query block, batch x query head).

Each program loads its 64 query rows once, then streams the key blocks listed in the
:class:`~kvtrim.attention.patterns.SparseLayout` (whole 64-key blocks: block-sparse, A-shape, and
the blocks vertical-slash slashes cross) followed by the listed single key columns (vertical-slash
verticals, gathered 64 at a time), with an online softmax in float32 (running max and sum, exp2).
The causal mask is applied in every tile; ``WINDOW`` adds A-shape's element-wise sink/local window.

Dtypes: float16, bfloat16 or float32 inputs; both products take the input dtype's operands
(``p`` is rounded to it before ``p @ v``, as flash-attention does) and accumulate in float32; the
output is written in the input dtype. Triton's CPU interpreter (3.9) multiplies bfloat16 operands
wrongly in ``tl.dot`` (a 16x16 product came out off by 2e10), so on CPU bfloat16 operands are
widened to float32 just before each product (``UPCAST_DOT``): exact, since a bf16 x bf16 product
fits a float32, so the interpreter computes what the GPU's bf16 dot with float32 accumulation does.

Layouts: ``q``/``o`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]`` (any strides), ``Hq = Hkv * G``;
query head ``h`` reads KV head ``h // G``. ``D`` must be a power of two (64, 128).
Reference: :func:`kvtrim.attention.reference.masked_attention` with
:func:`~kvtrim.attention.reference.layout_to_mask`.

This module imports ``triton`` at import time; import it through :mod:`kvtrim.attention.triton`,
which does so lazily. Runs on GPU, or on CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtrim.attention.patterns import SparseLayout, check_qkv

_LOG2E = 1.4426950408889634


@triton.jit
def _tile_update(q, k, v, mask, qk_scale, m_i, l_i, acc, UPCAST_DOT: tl.constexpr):
    """Online-softmax update with one key tile; ``k`` is ``[D, N]``, ``v`` ``[N, D]``."""
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale
    else:
        qk = tl.dot(q, k) * qk_scale
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _sparse_prefill_fwd(
    Q, K, V, O, BIDX, BCNT, CIDX, CCNT,  # noqa: E741 - O is the output, as in the attention equations
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot,
    s_bib, s_bih, s_bin, s_bcb, s_bch, s_cib, s_cih, s_cin, s_ccb, s_cch,
    T, H, G, qk_scale, n_init, n_local,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, HAS_COLS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // G
    offs_m = qb * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + b * s_kb + kvh * s_kh
    v_base = V + b * s_vb + kvh * s_vh
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    n_blk = tl.load(BCNT + b * s_bcb + h * s_bch + qb)
    bidx_row = BIDX + b * s_bib + h * s_bih + qb * s_bin
    for i in range(0, n_blk):
        kb = tl.load(bidx_row + i)
        keys = kb * BLOCK + offs_n
        key_ok = keys < T
        k = tl.load(k_base + keys[None, :] * s_kt + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None] * s_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        mask = key_ok[None, :] & (keys[None, :] <= offs_m[:, None])
        if WINDOW:
            mask = mask & ((keys[None, :] < n_init) | (offs_m[:, None] - keys[None, :] < n_local))
        m_i, l_i, acc = _tile_update(q, k, v, mask, qk_scale, m_i, l_i, acc, UPCAST_DOT)

    if HAS_COLS:
        n_col = tl.load(CCNT + b * s_ccb + h * s_cch + qb)
        cidx_row = CIDX + b * s_cib + h * s_cih + qb * s_cin
        for start in range(0, n_col, BLOCK):
            slot_ok = start + offs_n < n_col
            keys = tl.load(cidx_row + start + offs_n, mask=slot_ok, other=0)
            k = tl.load(k_base + keys[None, :] * s_kt + offs_d[:, None], mask=slot_ok[None, :], other=0.0)
            v = tl.load(v_base + keys[:, None] * s_vt + offs_d[None, :], mask=slot_ok[:, None], other=0.0)
            mask = slot_ok[None, :] & (keys[None, :] <= offs_m[:, None])
            m_i, l_i, acc = _tile_update(q, k, v, mask, qk_scale, m_i, l_i, acc, UPCAST_DOT)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows with no key -> 0
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


def sparse_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float | None = None
) -> torch.Tensor:
    """Run the kernel: ``[B, Hq, T, D]`` x ``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` in ``q.dtype``
    (float16, bfloat16 or float32; k and v in the same dtype; float32 accumulation).

    The last dimension of q, k, v must be contiguous; the layout must have ``block_size`` 16..128,
    a power of two, and ``[B or 1, Hq]`` rows (a batch-1 layout is broadcast).
    """
    g = check_qkv(q, k, v)
    b, hq, t, d = q.shape
    bs = layout.block_size
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernel; got {d}")
    if bs & (bs - 1) or not 16 <= bs <= 128:
        raise ValueError(f"block_size must be a power of two in [16, 128]; got {bs}")
    if layout.seq_len != t:
        raise ValueError(f"layout is for seq_len={layout.seq_len}, inputs have T={t}")
    lb, lh = layout.block_cnt.shape[:2]
    if lh != hq or lb not in (1, b):
        raise ValueError(f"layout rows [{lb}, {lh}] do not match [B={b}, Hq={hq}]")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    dev = q.device
    bidx, bcnt = layout.block_idx.to(dev, torch.int32).contiguous(), layout.block_cnt.to(dev, torch.int32).contiguous()
    cidx, ccnt = layout.col_idx.to(dev, torch.int32).contiguous(), layout.col_cnt.to(dev, torch.int32).contiguous()
    has_cols = cidx.shape[-1] > 0
    if bidx.shape[-1] == 0:  # keep a valid pointer; the counts are all zero
        bidx = torch.zeros(*bidx.shape[:-1], 1, dtype=torch.int32, device=dev)
    if not has_cols:
        cidx = torch.zeros(*cidx.shape[:-1], 1, dtype=torch.int32, device=dev)
    bstride = 0 if lb == 1 else 1  # broadcast a batch-1 layout
    o = torch.empty_like(q)
    scale = d**-0.5 if scaling is None else scaling
    window = layout.n_init is not None and layout.n_local is not None
    grid = (layout.n_blocks, b * hq)
    _sparse_prefill_fwd[grid](
        q, k, v, o, bidx, bcnt, cidx, ccnt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        bidx.stride(0) * bstride, bidx.stride(1), bidx.stride(2), bcnt.stride(0) * bstride, bcnt.stride(1),
        cidx.stride(0) * bstride, cidx.stride(1), cidx.stride(2), ccnt.stride(0) * bstride, ccnt.stride(1),
        t, hq, g, scale * _LOG2E,
        layout.n_init if window else 0, layout.n_local if window else 0,
        BLOCK=bs, HEAD_DIM=d, WINDOW=window, HAS_COLS=has_cols,
        UPCAST_DOT=q.dtype == torch.bfloat16 and dev.type == "cpu",  # CPU = the interpreter (see the module doc)
    )
    return o
