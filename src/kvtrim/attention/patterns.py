"""MInference head patterns and their online index estimation (Jiang et al., 2024, "MInference 1.0").

Each attention head is given one of three patterns offline; at prefill the pattern's indices are
estimated from the head's own ``q`` and ``k`` and turned into a :class:`SparseLayout`, the single
index description that every kernel (CPU, Triton) and the explicit-mask reference consume.

Layouts: ``q`` is ``[batch, q_heads, seq, head_dim]``; ``k`` is ``[batch, kv_heads, seq, head_dim]``
with ``q_heads = kv_heads * group``. **Indices are estimated per query head**, as MInference does:
query head ``h`` gets its own layout, computed against KV head ``h // group`` (the KV heads are
broadcast in the estimation matmuls, never repeated in memory). Every layout therefore has
``q_heads`` rows.

Kernel semantics (what the layout means, and what :func:`~kvtrim.attention.reference.layout_to_mask`
expands): the sequence is cut into query blocks and key blocks of ``block_size`` (64) tokens. For
each query block the layout lists whole key blocks and single key columns; the kernel computes
every listed block in full (only the causal mask, and for A-shape the element-wise sink/local
window, is applied inside it) and every listed column for the 64 rows of the query block. A
vertical-slash layout therefore covers each selected slash by the (at most two) 64x64 blocks it
crosses in every query block, the way MInference's kernel runs slashes, and each selected
vertical by a column unless a selected block already contains it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "SparseLayout",
    "AShape",
    "VerticalSlash",
    "BlockSparse",
    "dense_layout",
    "layout_from_block_mask",
    "vertical_slash_layout",
    "check_qkv",
]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate the prefill GQA layouts and return the group size ``q_heads // kv_heads``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    b, hq, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(f"prefill only: k must be [batch={b}, kv_heads, seq={t}, head_dim={d}]; got {k.shape}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q_heads ({hq}) must be a positive multiple of kv_heads ({hkv})")
    return hq // hkv


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


@dataclass
class SparseLayout:
    """Per query head and query block: the key blocks and single key columns to compute.

    Attributes:
        block_size: rows per query block and keys per key block (64).
        seq_len: ``T``; ``n_blocks = ceil(T / block_size)`` query and key blocks.
        block_idx: ``[B, Hq, n_blocks, max_blocks]`` int32, key-block indices, ascending; only the
            first ``block_cnt`` entries of a row are meaningful, the padding is 0 (in bounds).
        block_cnt: ``[B, Hq, n_blocks]`` int32.
        col_idx: ``[B, Hq, n_blocks, max_cols]`` int32, key positions, ascending, none of them
            inside a listed block and none after the query block's last row; padding 0.
        col_cnt: ``[B, Hq, n_blocks]`` int32.
        n_init, n_local: A-shape only: inside the listed blocks, key ``j`` is visible to query ``i``
            only if ``j < n_init`` or ``i - j < n_local``. ``None`` for the other patterns.
    """

    block_size: int
    seq_len: int
    block_idx: torch.Tensor
    block_cnt: torch.Tensor
    col_idx: torch.Tensor
    col_cnt: torch.Tensor
    n_init: int | None = None
    n_local: int | None = None

    @property
    def n_blocks(self) -> int:
        return math.ceil(self.seq_len / self.block_size)

    def head(self, b: int, h: int) -> "SparseLayout":
        """Row ``[b, h]`` as a one-head layout ``[1, 1, ...]`` (views, no copies)."""
        sl = (slice(b, b + 1), slice(h, h + 1))
        return SparseLayout(self.block_size, self.seq_len, self.block_idx[sl], self.block_cnt[sl],
                            self.col_idx[sl], self.col_cnt[sl], self.n_init, self.n_local)

    def density(self) -> float:
        """Executed work relative to dense causal attention, counted as the kernel runs it.

        A listed block costs ``block_size ** 2`` score entries, a column ``block_size``; dense
        causal costs every block on or below the diagonal. 1.0 = as much as dense, blocked.
        """
        n = self.n_blocks
        dense = n * (n + 1) / 2 * self.block_size**2 * self.block_cnt.shape[0] * self.block_cnt.shape[1]
        work = self.block_cnt.sum().item() * self.block_size**2 + self.col_cnt.sum().item() * self.block_size
        return float(work / dense)


def _pack(selected: torch.Tensor, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact a boolean ``[..., N]`` selection into (ascending indices padded with 0, counts).

    ``values`` (broadcastable to ``selected``) replaces the positions. A cumulative sum gives each
    selected entry its slot; unselected entries are scattered into one spare slot that is dropped.
    """
    cnt = selected.sum(-1)
    width = int(cnt.max().item()) if cnt.numel() else 0
    n = selected.shape[-1]
    src = torch.arange(n, device=selected.device).expand_as(selected) if values is None else values.expand_as(selected)
    slot = torch.where(selected, selected.cumsum(-1) - 1, width)
    out = torch.zeros(*selected.shape[:-1], width + 1, dtype=torch.int64, device=selected.device)
    out.scatter_(-1, slot, src.to(torch.int64))
    return out[..., :width].to(torch.int32), cnt.to(torch.int32)


def _causal_blocks(n: int, device: torch.device) -> torch.Tensor:
    r = torch.arange(n, device=device)
    return r[:, None] >= r[None, :]


def layout_from_block_mask(block_mask: torch.Tensor, seq_len: int, block_size: int = 64) -> SparseLayout:
    """A blocks-only layout from a boolean ``[B, Hq, n_blocks, n_blocks]`` block mask.

    Blocks above the diagonal are dropped (causal); nothing else is added.
    """
    _positive("block_size", block_size)
    _positive("seq_len", seq_len)
    n = math.ceil(seq_len / block_size)
    if block_mask.dim() != 4 or block_mask.shape[-2:] != (n, n):
        raise ValueError(f"block_mask must be [B, Hq, {n}, {n}] for seq_len={seq_len}; got {tuple(block_mask.shape)}")
    bm = block_mask.to(torch.bool) & _causal_blocks(n, block_mask.device)
    idx, cnt = _pack(bm)
    b, h = bm.shape[:2]
    empty = torch.zeros(b, h, n, 0, dtype=torch.int32, device=bm.device)
    return SparseLayout(block_size, seq_len, idx, cnt, empty, torch.zeros_like(cnt))


def dense_layout(batch: int, heads: int, seq_len: int, block_size: int = 64, device: torch.device | str = "cpu") -> SparseLayout:
    """Every causal block selected: the sparse kernels must then equal dense attention."""
    n = math.ceil(seq_len / block_size)
    bm = torch.ones(batch, heads, n, n, dtype=torch.bool, device=device)
    return layout_from_block_mask(bm, seq_len, block_size)


@dataclass
class AShape:
    """A-shape (StreamingLLM-like) head: ``n_init`` sink keys + a local window of ``n_local`` keys.

    Static, no estimation. Query ``i`` sees key ``j <= i`` iff ``j < n_init`` or ``i - j < n_local``,
    applied element-wise inside the key blocks the pattern touches. Defaults 1024 sinks + 4096
    local: the cost target of MInference's kernel-aware search (1k sink + 4k local), so an A-shape
    head costs exactly that budget. Memory and time grow with ``n_init + n_local``, not with ``T``.
    """

    n_init: int = 1024
    n_local: int = 4096
    block_size: int = 64

    def __post_init__(self) -> None:
        _positive("n_init", self.n_init)
        _positive("n_local", self.n_local)
        _positive("block_size", self.block_size)

    def layout(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> SparseLayout:
        """Layout for ``q`` ``[B, Hq, T, D]`` (``k`` only for validation); identical for all heads."""
        check_qkv(q, k, k)
        b, hq, t, _ = q.shape
        bs = self.block_size
        n = math.ceil(t / bs)
        r = torch.arange(n, device=q.device)
        first_local_key = (r * bs - self.n_local + 1).clamp(min=0)  # earliest key the block's first row sees
        sink = (r * bs < self.n_init)[None, :]
        local = r[None, :] >= (first_local_key // bs)[:, None]
        bm = (sink | local) & _causal_blocks(n, q.device)
        lay = layout_from_block_mask(bm.expand(b, hq, n, n), t, bs)
        lay.n_init, lay.n_local = self.n_init, self.n_local
        return lay


@functools.lru_cache(maxsize=4)
def _diagonal_index(t: int, lq: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, lq * t]`` int64: the offset ``i - j`` (0 above the diagonal) of each of the last ``lq`` rows' keys."""
    rows = torch.arange(t - lq, t, device=device)
    return (rows[:, None] - torch.arange(t, device=device)[None, :]).clamp_(min=0).reshape(1, 1, -1)


@dataclass
class VerticalSlash:
    """Vertical-slash head: ``k_v`` key columns ("verticals") + ``k_s`` diagonals ("slashes").

    Estimation (MInference): the last ``last_q`` queries attend to all keys, softmax(q kᵀ * scaling)
    in float32 with the causal mask in the last ``last_q x last_q`` corner. Column sums rank the
    verticals, sums along each diagonal (offset ``i - j``) rank the slashes. The first
    ``keep_first_columns`` (30) columns and the ``keep_near_diagonals`` (100) diagonals nearest the
    main diagonal are always kept (nearest first if the budget is smaller) and count against the
    budget. As in the official code, sizes below the minimum are raised to it (``k_v >= 30``,
    ``k_s >= 50``) and all sizes are clamped to ``T``. Defaults ``k_v=1000, k_s=6096``: the
    official values for heads with no searched config.
    """

    k_v: int = 1000
    k_s: int = 6096
    last_q: int = 64
    keep_first_columns: int = 30
    keep_near_diagonals: int = 100
    block_size: int = 64
    min_k_v: int = 30
    min_k_s: int = 50

    def __post_init__(self) -> None:
        for name in ("k_v", "k_s", "last_q", "keep_first_columns", "keep_near_diagonals", "block_size", "min_k_v", "min_k_s"):
            _positive(name, getattr(self, name))

    def estimate(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(vertical_idx [B, Hq, n_v], slash_offsets [B, Hq, n_s])``, int64, ascending.

        Verticals are key positions ``j``; slashes are offsets ``o = i - j`` (0 = main diagonal).
        """
        vert, slash = self.scores(q, k, scaling, self.last_q)
        return self.select(vert, slash)

    @staticmethod
    def scores(q: torch.Tensor, k: torch.Tensor, scaling: float | None = None, last_q: int = 64,
               native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Column sums and diagonal sums ``[B, Hq, T]`` (float32) of the last ``last_q`` queries' softmax.

        They do not depend on the sizes, so a layer's vertical-slash heads share one call.
        ``native``: the fused C++ version (:mod:`kvtrim.attention.native`; CPU, built), one pass
        per head, heads in parallel; the same sums up to float32 rounding.
        """
        g = check_qkv(q, k, k)
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        scale = d**-0.5 if scaling is None else scaling
        lq = min(last_q, t)
        if native and q.device.type == "cpu" and q.dtype != torch.float64:
            from kvtrim.attention.native import native_vertical_slash_scores

            pairs = [native_vertical_slash_scores(q[i], k[i], scale, lq) for i in range(b)]
            return torch.stack([v for v, _ in pairs]), torch.stack([s for _, s in pairs])
        ql = q[:, :, t - lq :, :].float().reshape(b, hkv, g * lq, d)
        s = torch.matmul(ql, k.float().transpose(-1, -2)).mul_(scale).view(b, hq, lq, t)
        corner = torch.ones(lq, lq, dtype=torch.bool, device=q.device).triu_(1)  # key j > query i
        s[..., t - lq :].masked_fill_(corner, float("-inf"))
        p = torch.softmax(s, dim=-1)
        vert = p.sum(-2)
        slash = torch.zeros(b, hq, t, device=q.device, dtype=torch.float32)
        slash.scatter_add_(-1, _diagonal_index(t, lq, q.device).expand(b, hq, -1), p.reshape(b, hq, -1))
        return vert, slash

    def select(self, vert: torch.Tensor, slash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This head's sizes applied to :meth:`scores`: ``(vertical_idx, slash_offsets)``."""
        t = vert.shape[-1]
        n_v = min(max(self.k_v, self.min_k_v), t)
        n_s = min(max(self.k_s, self.min_k_s), t)
        return self._top(vert, n_v, self.keep_first_columns), self._top(slash, n_s, self.keep_near_diagonals)

    @staticmethod
    def _top(score: torch.Tensor, n: int, n_forced: int) -> torch.Tensor:
        """Indices ``0..min(n_forced, n)-1`` plus the top remaining scores, ``n`` in all, sorted."""
        f = min(n_forced, n)
        b, h, _ = score.shape
        forced = torch.arange(f, device=score.device).expand(b, h, f)
        rest = score[..., f:].topk(n - f, dim=-1).indices + f
        return torch.cat([forced, rest], dim=-1).sort(dim=-1).values

    def layout(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> SparseLayout:
        v_idx, s_idx = self.estimate(q, k, scaling)
        return vertical_slash_layout(v_idx, s_idx, q.shape[2], self.block_size)


def vertical_slash_layout(vertical_idx: torch.Tensor, slash_offsets: torch.Tensor, seq_len: int, block_size: int = 64,
                          native: bool | None = None) -> SparseLayout:
    """Turn verticals and slashes into whole key blocks + leftover columns per query block.

    Args:
        vertical_idx: ``[B, H, n_v]`` key positions in ``[0, T)`` (any order, duplicates allowed).
        slash_offsets: ``[B, H, n_s]`` offsets ``i - j`` in ``[0, T)``.

    In query block ``[qs, qe)`` the slash ``o`` covers keys ``[qs - o, qe - 1 - o]`` clipped at 0
    (nothing if ``qe - 1 - o < 0``); every key block that range touches (at most two) is listed.
    Every vertical ``j <= qe - 1`` is kept: as a column unless a listed block already holds it.
    Unlike the official builder, no vertical is dropped and no index is read past its array.

    ``native``: build it with kvtrim's C++ code (same result, much faster on long prompts; tested
    against this PyTorch version); ``None`` (default): when the native CPU kernel is available.
    """
    _positive("seq_len", seq_len)
    _positive("block_size", block_size)
    for name, x in (("vertical_idx", vertical_idx), ("slash_offsets", slash_offsets)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [B, H, n]; got {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= seq_len):
            raise ValueError(f"{name} must lie in [0, {seq_len}); got range [{int(x.min())}, {int(x.max())}]")
    if vertical_idx.shape[:2] != slash_offsets.shape[:2]:
        raise ValueError(f"vertical_idx and slash_offsets disagree on [B, H]: {tuple(vertical_idx.shape[:2])} vs {tuple(slash_offsets.shape[:2])}")
    b, h = vertical_idx.shape[:2]
    bs, t, dev = block_size, seq_len, vertical_idx.device
    n = math.ceil(t / bs)
    v_sorted = vertical_idx.reshape(b * h, -1).long().sort(dim=-1).values
    if native is None:
        from kvtrim.attention.native import cpu_kernel

        native = dev.type == "cpu" and cpu_kernel() == "native"
    if native:
        from kvtrim.attention.native import native_vertical_slash_layout

        bidx, bcnt, cidx, ccnt = native_vertical_slash_layout(v_sorted, slash_offsets.reshape(b * h, -1), t, bs)
        return SparseLayout(bs, t, bidx.view(b, h, n, -1), bcnt.view(b, h, n), cidx.view(b, h, n, -1), ccnt.view(b, h, n))
    qs = torch.arange(n, device=dev) * bs
    qe = (qs + bs).clamp(max=t)
    bitmap = torch.zeros(b * h, n, n + 1, dtype=torch.bool, device=dev)  # column n = discard
    cols = torch.zeros(b * h, n, vertical_idx.shape[-1], dtype=torch.bool, device=dev)
    for r, o in enumerate(slash_offsets.reshape(b * h, -1).long()):  # one head at a time bounds memory
        hi = qe[:, None] - 1 - o[None, :]  # [n, n_s]
        lo = (qs[:, None] - o[None, :]).clamp(min=0)
        hit = hi >= 0
        bitmap[r].scatter_(-1, torch.where(hit, lo // bs, n), True)
        bitmap[r].scatter_(-1, torch.where(hit, hi.clamp(min=0) // bs, n), True)
        vj = v_sorted[r]
        in_block = torch.gather(bitmap[r], -1, (vj // bs)[None, :].expand(n, -1))
        cols[r] = (vj[None, :] <= (qe[:, None] - 1)) & ~in_block
    # a duplicate vertical must appear once: keep its first occurrence in the sorted list
    if v_sorted.shape[-1] > 1:
        dup = torch.zeros_like(v_sorted, dtype=torch.bool)
        dup[:, 1:] = v_sorted[:, 1:] == v_sorted[:, :-1]
        cols &= ~dup[:, None, :]
    bidx, bcnt = _pack(bitmap[..., :n])
    cidx, ccnt = _pack(cols, v_sorted[:, None, :])
    return SparseLayout(
        bs, t,
        bidx.view(b, h, n, -1), bcnt.view(b, h, n),
        cidx.view(b, h, n, -1), ccnt.view(b, h, n),
    )


@dataclass
class BlockSparse:
    """Block-sparse head: each query block keeps its top ``k_b`` key blocks.

    Estimation (MInference): mean-pool ``q`` and ``k`` over blocks of ``block_size`` (64) tokens
    (the last, partial block over its real tokens), score ``q̂ k̂ᵀ * scaling`` with a causal block
    mask, keep the top ``k_b`` key blocks per query block, the diagonal block always included.
    Default ``k_b = 100`` (official). Cost per query block is at most ``k_b`` full blocks.
    """

    k_b: int = 100
    block_size: int = 64

    def __post_init__(self) -> None:
        _positive("k_b", self.k_b)
        _positive("block_size", self.block_size)

    def layout(self, q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> SparseLayout:
        return self.layout_from_scores(self.block_scores(q, k, scaling, self.block_size), q.shape[2])

    @staticmethod
    def block_scores(q: torch.Tensor, k: torch.Tensor, scaling: float | None = None, block_size: int = 64) -> torch.Tensor:
        """The pooled block scores ``[B, Hq, n, n]`` (float32): ``-inf`` above the diagonal, ``+inf`` on it.

        They do not depend on ``k_b``, so one call serves every size (the pattern search sizes
        ``k_b`` by bisection on them).
        """
        g = check_qkv(q, k, k)
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        bs = block_size
        scale = d**-0.5 if scaling is None else scaling
        n = math.ceil(t / bs)
        counts = (torch.arange(n, device=q.device) * bs).neg_().add_(t).clamp_(max=bs).float()[:, None]

        def pool(x: torch.Tensor) -> torch.Tensor:
            x = torch.nn.functional.pad(x.float(), (0, 0, 0, n * bs - t))
            return x.view(*x.shape[:2], n, bs, d).sum(-2) / counts

        qp = pool(q).view(b, hkv, g * n, d)
        kp = pool(k)
        s = torch.matmul(qp, kp.transpose(-1, -2)).mul_(scale).view(b, hq, n, n)
        causal = _causal_blocks(n, q.device)
        s.masked_fill_(~causal, float("-inf"))
        s.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
        return s

    def blocks_listed(self, n: int) -> int:
        """Key blocks this size lists over ``n`` query blocks (query block ``i`` has ``i + 1`` causal ones)."""
        kk = min(self.k_b, n)
        return kk * (kk + 1) // 2 + (n - kk) * kk

    def layout_from_scores(self, s: torch.Tensor, seq_len: int) -> SparseLayout:
        """This size's layout from :meth:`block_scores`: each query block's top ``k_b`` key blocks."""
        b, hq, n, _ = s.shape
        kk = min(self.k_b, n)
        top = s.topk(kk, dim=-1).indices
        keep = torch.arange(kk, device=s.device)[None, :] < (torch.arange(n, device=s.device) + 1)[:, None]
        bm = torch.zeros(b, hq, n, n, dtype=torch.bool, device=s.device)
        bm.scatter_(-1, top, keep.expand(b, hq, n, kk))
        return layout_from_block_mask(bm, seq_len, self.block_size)
