"""Fast CPU sparse prefill: kvtrim's fused C++ kernel, or gathered batched matmuls in PyTorch.

Two paths compute the same thing (both are tested against the explicit-mask reference):

- ``native`` (default where it builds, :mod:`kvtrim.attention.native`): one task per query head
  and 64-row query block walks the listed key blocks (consecutive ones merged, up to 512 keys per
  BLAS call) and the gathered single columns with an online softmax, flash-attention style; tasks
  are shared out dynamically over torch's threads, most expensive first. It runs at about dense
  SDPA's rate per executed score (docs/minference.md), so attention time falls with density. :func:`sparse_attention_heads` sends all sparse heads of a layer, each with its own
  layout, to it in one call.
- ``torch`` (fallback): for every query head and every group of consecutive query blocks, the
  key blocks and single key columns listed in the :class:`~kvtrim.attention.patterns.SparseLayout`
  are gathered into one contiguous ``[chunk, L, head_dim]`` tensor (``L`` = the widest selection
  in the group), and attention runs as ``bmm -> masked exp -> bmm`` with a float32 softmax.
  Padding inside a group is masked out. It is slower per executed score than SDPA (gathers, masks
  and a separate softmax pass); compiled FlexAttention with a BlockMask was slower still and
  compiles per shape (docs/minference.md).

Either way a query block costs ``block_cnt * 64 + col_cnt`` keys instead of all keys before it:
slashes cost whole 64x64 blocks (the layout already lists them that way), verticals one column
each. The reference both must equal is :func:`kvtrim.attention.reference.masked_attention` with
:func:`~kvtrim.attention.reference.layout_to_mask`.

Layouts: ``q`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]``, ``Hq = Hkv * G``; query head ``h``
reads KV head ``h // G`` (no repeated KV heads in memory). Output ``[B, Hq, T, D]``, dtype of ``q``.
"""

from __future__ import annotations

import logging

import torch

from kvtrim.attention.native import NATIVE_BLOCK, kernel_for, native_flat_rows, native_sparse_attention, writable_in_place
from kvtrim.attention.patterns import SparseLayout, check_qkv

__all__ = ["sparse_attention_cpu", "sparse_attention_heads"]

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


def sparse_attention_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: list[int],
    layouts: list[SparseLayout],
    scaling: float | None = None,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse attention for some query heads of one batch row, each with its own one-head layout.

    This is how a mixed per-head MInference layer runs on CPU: all its sparse heads (any patterns,
    any sizes, their own A-shape windows) go to the native kernel in one call, so its threads
    share out the whole layer's work; with the PyTorch path they run one by one.

    Args:
        q: ``[1, Hq, T, D]``; k, v: ``[1, Hkv, T, D]`` (any strides: the native kernel reads
            float32, bfloat16 and float16 inputs in place when their last dimension is contiguous,
            computing in float32).
        heads: query-head indices; head ``h`` reads KV head ``h // (Hq // Hkv)``.
        layouts: one ``[1, 1, ...]`` layout per entry of ``heads``.
        out: optional ``[1, Hq, T, D]`` tensor (like ``q``); ``out[0, heads]`` is written and the
            other heads are left as they are. An ``out`` in q's dtype (e.g. a transposed view of
            the ``[1, T, Hq, D]`` buffer a layer returns) is written by the kernel directly; one
            that overlaps itself or q/k/v, or has another dtype, gets the result copied in.

    Returns:
        ``out`` when given, else ``[len(heads), T, D]`` in ``q.dtype``.
    """
    g = check_qkv(q, k, v)
    if q.shape[0] != 1:
        raise ValueError(f"sparse_attention_heads takes one batch row; got B={q.shape[0]}")
    if len(heads) != len(layouts) or not heads:
        raise ValueError("give one layout per head, and at least one head")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out must be shaped like q {tuple(q.shape)}; got {tuple(out.shape)}")
    t, d = q.shape[2], q.shape[3]
    scale = d**-0.5 if scaling is None else scaling
    idx = torch.as_tensor(heads)
    if kernel_for(q, kernel) != "native":
        res = torch.cat([sparse_attention_cpu(q[:, h : h + 1], k[:, h // g : h // g + 1], v[:, h // g : h // g + 1],
                                              lay, scale, kernel="torch")[0] for h, lay in zip(heads, layouts)])
    else:
        for lay in layouts:
            if lay.seq_len != t or lay.block_cnt.shape[:2] != (1, 1):
                raise ValueError("each layout must be a one-head layout for the inputs' T")
            if lay.block_size != NATIVE_BLOCK:
                raise ValueError(f"the native kernel runs block_size={NATIVE_BLOCK}; layout has {lay.block_size}")
        def flat(idx: str, cnt: str) -> torch.Tensor:
            # Every head's rows, entries only (the kernel's flat layout): padding each head to the
            # widest head's rows would cost memory and time in proportion to heads x rows x width.
            # The native copy reads only the entries (a vertical-slash group's column rows are padded
            # to the widest row of all its heads: mostly padding at long T).
            parts = [native_flat_rows(getattr(lay, idx)[0, 0], getattr(lay, cnt)[0, 0]) for lay in layouts]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        window = [lay.n_init is not None and lay.n_local is not None for lay in layouts]
        n_init = [lay.n_init if w else -1 for lay, w in zip(layouts, window)]
        n_local = [lay.n_local if w else -1 for lay, w in zip(layouts, window)]
        direct = out if out is not None and writable_in_place(out, q, k, v) else None
        res = native_sparse_attention(
            q[0], k[0], v[0], idx, idx // g,
            flat("block_idx", "block_cnt"), torch.stack([lay.block_cnt[0, 0] for lay in layouts]),
            flat("col_idx", "col_cnt"), torch.stack([lay.col_cnt[0, 0] for lay in layouts]), n_init, n_local, scale,
            out=None if direct is None else direct[0],
        )
        if direct is not None:
            return direct
    if out is None:
        return res.to(q.dtype)
    out[0, idx] = res.to(out.dtype)
    return out


def sparse_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    scaling: float | None = None,
    chunk_scores: int = _CHUNK_SCORES,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention over the keys a layout selects; equals ``masked_attention(q, k, v, layout_to_mask(layout))``.

    Args:
        q: ``[B, Hq, T, D]``; float32, float16 or bfloat16 (float64 is computed in float64).
        k, v: ``[B, Hkv, T, D]``.
        layout: per query head, from a pattern's ``layout(q, k)``; ``[B or 1, Hq, ...]``.
        scaling: logit scale, default ``D ** -0.5``.
        chunk_scores: score entries per batched matmul of the PyTorch path (memory ~4 bytes each, times ~3).
        kernel: ``"native"`` (the fused C++ kernel, :mod:`kvtrim.attention.native`), ``"torch"``
            (gathered batched matmuls, below) or ``"auto"``: native when it is available, per
            ``KVTRIM_CPU_KERNEL``. Float64 and non-CPU inputs always take the PyTorch path.

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
    if kernel_for(q, kernel) == "native":
        if bs != NATIVE_BLOCK:
            raise ValueError(f"the native kernel runs block_size={NATIVE_BLOCK}; layout has {bs}")
        out = torch.empty_like(q)
        heads = list(range(hq))
        for bi in range(b):
            li = bi if lb == b else 0
            rows = [layout.head(li, h) for h in heads]
            sparse_attention_heads(q[bi : bi + 1], k[bi : bi + 1], v[bi : bi + 1], heads, rows, scale, "native",
                                   out=out[bi : bi + 1])
        return out
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
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
                if layout.n_init is not None and layout.n_local is not None:
                    _window_mask(s, blocks, cols, diag, bs, mb, layout.n_init, layout.n_local)
                o = torch.bmm(torch.softmax(s, dim=-1), vg).nan_to_num_(0.0)  # empty rows -> 0
                out[bi, h, r0:r1] = o.view(-1, d)[: r1 - r0].to(q.dtype)
    return out
