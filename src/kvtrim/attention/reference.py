"""Plain-PyTorch causal attention: the oracle every sparse fast path is tested against.

Layouts (all functions here):

- ``q``: ``[batch, q_heads, seq, head_dim]``
- ``k``, ``v``: ``[batch, kv_heads, seq, head_dim]`` with ``q_heads = kv_heads * group``
  (grouped-query attention). Query head ``h`` reads KV head ``h // group``; the KV heads are
  broadcast in the matmul, never repeated in memory.
- ``mask``: boolean ``[batch or 1, q_heads or 1, seq, seq]``, ``True`` = the query row may attend to
  the key column. It is ANDed with the causal mask.

Prefill only: query length equals key length. Softmax is taken in float32 (or float64 when the
inputs are float64); the output has the dtype of ``q``. A row with no allowed key returns zeros
(the sparse paths follow the same convention).

The same module expands a :class:`~kvtrim.attention.patterns.SparseLayout` (the index description
every kernel consumes) into its explicit boolean mask with :func:`layout_to_mask`.
"""

from __future__ import annotations

import torch

from kvtrim.attention.patterns import SparseLayout, check_qkv

__all__ = ["dense_attention", "masked_attention", "layout_to_mask"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Causal softmax attention restricted to ``mask`` (``None`` = dense causal).

    Args:
        q: ``[B, Hq, T, D]``.
        k, v: ``[B, Hkv, T, D]``, ``Hq % Hkv == 0``.
        mask: boolean ``[B or 1, Hq or 1, T, T]``, ANDed with the causal mask.
        scaling: logit scale; default ``D ** -0.5``.
        upcast: ``True`` (default): matmuls and softmax in float32 (float64 for float64 inputs).
            ``False``: the plain low-precision baseline of the tolerance rule (docs/style.md): both
            matmuls in the input dtype, softmax in float32, probabilities cast back to it.

    Returns:
        ``[B, Hq, T, D]`` in ``q.dtype``. Materialises ``[B, Hq, T, T]`` scores: an oracle, not a
        fast path.
    """
    g = check_qkv(q, k, v)
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    cdt = _compute_dtype(q) if upcast else q.dtype
    qg = q.to(cdt).reshape(b, hkv, g, t, d)
    kg = k.to(cdt).unsqueeze(2)  # [B, Hkv, 1, T, D]: broadcast, not repeated
    vg = v.to(cdt).unsqueeze(2)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [B, Hkv, G, T, T]
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    if mask is not None:
        if mask.dim() != 4 or mask.shape[-2:] != (t, t):
            raise ValueError(f"mask must be [B or 1, Hq or 1, {t}, {t}]; got {tuple(mask.shape)}")
        mask = mask.to(torch.bool).expand(b, hq, t, t).reshape(b, hkv, g, t, t)
        allowed = allowed & mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    sdt = torch.float64 if cdt == torch.float64 else torch.float32
    probs = torch.softmax(scores.to(sdt), dim=-1).nan_to_num(0.0).to(cdt)  # all-masked rows -> zeros
    out = torch.matmul(probs, vg)
    return out.reshape(b, hq, t, d).to(q.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Dense causal attention, ``[B, Hq, T, D]`` x ``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]``."""
    return masked_attention(q, k, v, None, scaling)


def layout_to_mask(layout: SparseLayout) -> torch.Tensor:
    """Expand a :class:`SparseLayout` into the explicit boolean mask the kernels compute.

    Returns ``[B, Hq, T, T]`` bool: ``True`` where query row ``i`` attends to key ``j``; the
    union of the listed key blocks (whole ``block_size`` blocks) and the listed single key
    columns of each query block, ANDed with causality and, for A-shape, with the element-wise
    sink/local window. Memory ``B * Hq * T * T`` bytes: for tests and small ``T`` only.
    """
    bs, t = layout.block_size, layout.seq_len
    b, h, nqb, _ = layout.block_idx.shape
    nkb = nqb
    dev = layout.block_idx.device
    slots = torch.arange(layout.block_idx.shape[-1], device=dev)
    valid = slots < layout.block_cnt.unsqueeze(-1)
    bitmap = torch.zeros(b, h, nqb, nkb + 1, dtype=torch.bool, device=dev)
    bitmap.scatter_(-1, torch.where(valid, layout.block_idx.long(), nkb), True)
    dense = bitmap[..., :nkb].repeat_interleave(bs, dim=-2).repeat_interleave(bs, dim=-1)[..., :t, :t]
    cols = torch.zeros(b, h, nqb, t + 1, dtype=torch.bool, device=dev)
    cslots = torch.arange(layout.col_idx.shape[-1], device=dev)
    cvalid = cslots < layout.col_cnt.unsqueeze(-1)
    cols.scatter_(-1, torch.where(cvalid, layout.col_idx.long(), t), True)
    dense = dense | cols[..., :t].repeat_interleave(bs, dim=-2)[..., :t, :]
    i = torch.arange(t, device=dev)
    allowed = i[:, None] >= i[None, :]
    if layout.n_init is not None and layout.n_local is not None:
        allowed = allowed & ((i[None, :] < layout.n_init) | (i[:, None] - i[None, :] < layout.n_local))
    return dense & allowed


def lowbit_decode_reference(query: torch.Tensor, kv, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                            bias: torch.Tensor | None = None, rotation=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of ``kvtrim.attention.lowbit.lowbit_decode_attention``: dequantize every slot of
    ``kv`` (a ``LowBitKV``), append ``keys``/``values``, and take one softmax over all of it, in float32
    (float64 for a float64 query, the codes dequantized in float64 too). Returns ``(out [B, 1, Hq, Dv], probs [B, Hkv, G, 1, S])``."""
    ct = _compute_dtype(query)
    k_q = kv.keys(dtype=ct)  # float64: the exact values the codes stand for
    if rotation is not None and kv.length:  # a KeyRotation: the turn of each key since it was packed
        k_q = rotation.apply(k_q, 0, kv.length)
    k = torch.cat([k_q.to(ct), keys.to(ct)], dim=2)
    v = torch.cat([kv.values(dtype=ct), values.to(ct)], dim=2)
    b, hq, _, d = query.shape
    hkv = k.shape[1]
    g = hq // hkv
    logits = torch.matmul(query.to(ct).reshape(b, hkv, g, d), k.transpose(-1, -2)) * scaling
    if bias is not None:
        logits = logits + bias[:, :, None].to(ct)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, v).reshape(b, hq, 1, v.shape[-1]).transpose(1, 2).to(query.dtype)
    return out, probs.unsqueeze(3).float()
