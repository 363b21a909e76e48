"""Fast CPU sparse prefill: gather the selected keys of each query block, one batched matmul.

For every query head and every group of consecutive 64-row query blocks, the key blocks and
single key columns listed in the :class:`~kvtrim.attention.patterns.SparseLayout` are gathered
into one contiguous ``[chunk, L, head_dim]`` tensor (``L`` = the widest selection in the group),
and attention runs as ``bmm -> masked exp -> bmm`` with a float32 softmax. Work therefore falls
with density: a query block costs ``block_cnt * 64 + col_cnt`` keys instead of all keys before
it. Slashes cost whole 64x64 blocks (the layout already lists them that way), verticals one
gathered column each. Padding inside a group is masked out.

Measured on a 2-core CPU (see ``benchmarks/bench_sparse_kernel.py``): compiled FlexAttention
with a BlockMask was ~1.4x slower than dense SDPA at full density and compiles per shape
(~20 s). This path ran ~125 GFLOP/s of executed work on an idle machine (about SDPA's rate), i.e.
it beat SDPA at 8k for density 0.44 (0.47 s vs 0.60 s), but it loses badly when the cores are
shared with other processes (many medium ops, each a thread barrier). The reference it must
equal is :func:`kvtrim.attention.reference.masked_attention` with
:func:`~kvtrim.attention.reference.layout_to_mask`.

Layouts: ``q`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]``, ``Hq = Hkv * G``; query head ``h``
reads KV head ``h // G`` (no repeated KV heads in memory). Output ``[B, Hq, T, D]``, dtype of ``q``.
"""

from __future__ import annotations

import logging

import torch

from kvtrim.attention.patterns import SparseLayout
from kvtrim.attention.reference import check_qkv

__all__ = ["sparse_attention_cpu"]

logger = logging.getLogger(__name__)

# Upper bound on score entries (chunk * 64 * L) per batched matmul: ~2 MB of float32 scores,
# small enough to stay in the last-level cache's neighbourhood, big enough to amortise Python.
_CHUNK_SCORES = 1 << 19


def _chunks(block_cnt: list[int], col_cnt: list[int], bs: int, budget: int) -> list[tuple[int, int, int, int]]:
    """Group consecutive query blocks: ``(start, end, max_blocks, max_cols)`` within ``budget``."""
    out = []
    start, mb, mc = 0, 0, 0
    for i, (nb, nc) in enumerate(zip(block_cnt, col_cnt)):
        nmb, nmc = max(mb, nb), max(mc, nc)
        if i > start and (i + 1 - start) * bs * (nmb * bs + nmc) > budget:
            out.append((start, i, mb, mc))
            start, nmb, nmc = i, nb, nc
        mb, mc = nmb, nmc
    out.append((start, len(block_cnt), mb, mc))
    return out


def _window_mask(s, blocks, cols, diag, bs: int, mb: int, n_init: int, n_local: int) -> None:
    """A-shape's element-wise window: hide key ``j`` from row ``i`` when ``j >= n_init`` and ``i - j >= n_local``.

    Only gathered blocks that hold a key past the sinks *and* at least ``n_local`` before the
    chunk's last row can hold a hidden key (at most three per query block: the block straddling
    ``n_init`` and the two under the window's lower edge), so the mask is built and applied on
    those slots only, instead of over every score.
    """
    nrow = s.shape[0]
    last_row = diag[:, -1:]  # [nrow, 1]
    if cols.shape[1]:  # generic (not produced by AShape): mask everything
        keys = torch.cat([(blocks * bs).repeat_interleave(bs, dim=1) + torch.arange(bs).repeat(1 + mb), cols], dim=1)
        keys = torch.where(keys >= n_init, keys, 1 << 40)[:, None, :]
        s.masked_fill_(keys <= (diag - n_local)[:, :, None], float("-inf"))
        return
    start = blocks * bs
    need = (start <= last_row - n_local) & (start + bs - 1 >= n_init)  # [nrow, 1 + mb]
    width = int(need.sum(1).max())
    if width == 0:
        return
    slots = torch.sort((~need).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # needing slots first
    ar = torch.arange(bs)
    idx = (slots[:, :, None] * bs + ar).reshape(nrow, 1, width * bs).expand(nrow, bs, width * bs)
    sub = s.gather(2, idx)
    keys = (torch.gather(blocks, 1, slots)[:, :, None] * bs + ar).reshape(nrow, 1, width * bs)
    keys = torch.where(keys >= n_init, keys, 1 << 40)  # sinks are never hidden
    sub.masked_fill_(keys <= (diag - n_local)[:, :, None], float("-inf"))
    s.scatter_(2, idx, sub)


def sparse_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    scaling: float | None = None,
    chunk_scores: int = _CHUNK_SCORES,
) -> torch.Tensor:
    """Causal attention over the keys a layout selects; equals ``masked_attention(q, k, v, layout_to_mask(layout))``.

    Args:
        q: ``[B, Hq, T, D]``; float32, float16 or bfloat16 (float64 is computed in float64).
        k, v: ``[B, Hkv, T, D]``.
        layout: per query head, from a pattern's ``layout(q, k)``; ``[B or 1, Hq, ...]``.
        scaling: logit scale, default ``D ** -0.5``.
        chunk_scores: score entries per batched matmul (memory ~4 bytes each, times ~3).

    Returns:
        ``[B, Hq, T, D]`` in ``q.dtype``; rows with no selected key are zero.
    """
    g = check_qkv(q, k, v)
    b, hq, t, d = q.shape
    if layout.seq_len != t:
        raise ValueError(f"layout is for seq_len={layout.seq_len}, inputs have T={t}")
    lb, lh = layout.block_cnt.shape[:2]
    if lh != hq or lb not in (1, b):
        raise ValueError(f"layout rows [{lb}, {lh}] do not match [B={b}, Hq={hq}]")
    bs = layout.block_size
    scale = d**-0.5 if scaling is None else scaling
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    window = layout.n_init is not None and layout.n_local is not None
    out = torch.empty_like(q)
    n = layout.n_blocks
    ar = torch.arange(bs, device=q.device)
    tril = ar[:, None] >= ar[None, :]
    for bi in range(b):
        li = bi if lb == b else 0
        for h in range(hq):
            if h % g == 0:  # one padded block view per KV head, shared by its query group
                pad = (0, 0, 0, n * bs - t)
                kh, vh = k[bi, h // g].to(cdt), v[bi, h // g].to(cdt)
                kblk = torch.nn.functional.pad(kh, pad).view(n, bs, d)
                vblk = torch.nn.functional.pad(vh, pad).view(n, bs, d)
            qh = q[bi, h]
            bidx_all, cidx_all = layout.block_idx[li, h].long(), layout.col_idx[li, h].long()
            bcnt, ccnt = layout.block_cnt[li, h].long(), layout.col_cnt[li, h].long()
            # Lists are ascending and causal, so the diagonal block, if listed, is the last entry.
            # It goes first in the gathered keys: the only block that needs a (fixed) causal mask.
            qb = torch.arange(len(bcnt), device=q.device)
            last = torch.gather(bidx_all, 1, (bcnt - 1).clamp(min=0)[:, None])[:, 0] if bidx_all.shape[1] else qb - 1
            has_diag = (bcnt > 0) & (last == qb)
            off_cnt = bcnt - has_diag.long()
            for c0, c1, mb, mc in _chunks((off_cnt + 1).tolist(), ccnt.tolist(), bs, chunk_scores):
                nrow, mb = c1 - c0, mb - 1
                r0, r1 = c0 * bs, min(c1 * bs, t)
                diag = torch.arange(r0, r0 + nrow * bs, device=q.device).view(nrow, bs)
                blocks = torch.cat([qb[c0:c1, None], bidx_all[c0:c1, :mb]], dim=1)  # [chunk, 1 + mb]
                slot_ok = torch.cat([has_diag[c0:c1, None], torch.arange(mb)[None, :] < off_cnt[c0:c1, None]], dim=1)
                slot_ok = slot_ok.repeat_interleave(bs, dim=1)
                if (c1 == n) and (t % bs):  # keys past T in the last (partial) block
                    slot_ok &= (blocks * bs).repeat_interleave(bs, dim=1) + ar.repeat(1 + mb) < t
                kg = kblk.index_select(0, blocks.reshape(-1)).view(nrow, -1, d)
                vg = vblk.index_select(0, blocks.reshape(-1)).view(nrow, -1, d)
                cols = cidx_all[c0:c1, :mc]
                if mc:
                    kg = torch.cat([kg, kh.index_select(0, cols.reshape(-1)).view(nrow, mc, d)], dim=1)
                    vg = torch.cat([vg, vh.index_select(0, cols.reshape(-1)).view(nrow, mc, d)], dim=1)
                    slot_ok = torch.cat([slot_ok, torch.arange(mc)[None, :] < ccnt[c0:c1, None]], dim=1)
                qc = qh[r0:r1].to(cdt) * scale
                if r1 - r0 < nrow * bs:
                    qc = torch.nn.functional.pad(qc, (0, 0, 0, nrow * bs - (r1 - r0)))
                s = torch.bmm(qc.view(nrow, bs, d), kg.transpose(1, 2))
                if not bool(slot_ok.all()):
                    s.add_(torch.zeros(slot_ok.shape, dtype=cdt).masked_fill_(~slot_ok, float("-inf"))[:, None, :])
                s[:, :, :bs].masked_fill_(~tril, float("-inf"))
                if mc:
                    s[:, :, bs + mb * bs :].masked_fill_(cols[:, None, :] > diag[:, :, None], float("-inf"))
                if window:
                    _window_mask(s, blocks, cols, diag, bs, mb, layout.n_init, layout.n_local)
                o = torch.bmm(torch.softmax(s, dim=-1), vg).nan_to_num_(0.0)  # empty rows -> 0
                out[bi, h, r0:r1] = o.view(-1, d)[: r1 - r0].to(q.dtype)
    return out
