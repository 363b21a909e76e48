"""Attention scores computed from ``q`` and ``k``, for the rows a method needs (plain PyTorch).

These helpers recompute only an observation window of queries, or one decode row, or all prompt
rows in chunks (so a T-token prompt never materialises a T x T matrix per head), after the
model's own attention. Where kvtrim's attention function computes the prefill attention itself
(``kvtrim.attention.fused``, ``Policy.wants_prefill_scores``) the policy receives the same scores
from it (``PromptScores``) and these are not called. Everything runs in float32.

Layouts: ``query [B, Hq, q, D]`` (post-RoPE), ``key [B, Hkv, S, D]`` where the last ``q`` keys
belong to the queries (the cache's past keys come first), ``Hq = Hkv * G``.
Returned scores are per KV head, ``[B, Hkv, S]``, reduced over the ``G`` query heads of each
group with ``group_reduce`` ("sum" or "mean").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ScoreRequest(NamedTuple):
    """What a method reads from a prompt's attention probabilities (``Policy.wants_prefill_scores``):
    the per-key column sums over all queries, the softmax rows of the last ``window`` queries, and/or
    the per-key column maxima (the largest probability any query gives a key)."""

    column_sums: bool = False
    window: int = 0
    column_max: bool = False


class PromptScores(NamedTuple):
    """Scores an attention function computed from a prefill's own probabilities (fused scoring),
    float32: ``column_sums [B, Hkv, G, S]`` (what ``causal_column_sums`` returns),
    ``window_probs [B, Hkv, G, w, S]`` (what ``window_probs(query, key, scaling, w)`` returns) and
    ``column_max [B, Hkv, G, S]`` (each key's largest probability over the forward's queries);
    None where not computed."""

    column_sums: torch.Tensor | None = None
    window_probs: torch.Tensor | None = None
    column_max: torch.Tensor | None = None

    def window(self, w: int, n_queries: int) -> torch.Tensor | None:
        """``window_probs(query, key, scaling, w)`` for ``n_queries`` queries, when the handed rows cover it."""
        w = min(w, n_queries)
        if self.window_probs is None or self.window_probs.shape[-2] < w:
            return None
        return self.window_probs[..., self.window_probs.shape[-2] - w:, :]


def grouped_queries(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[B, Hq, q, D]`` -> ``[B, Hkv, G, q, D]`` (a view): query heads grouped by the KV head they read."""
    b, hq, q, d = query.shape
    return query.reshape(b, n_kv, hq // n_kv, q, d)


def window_probs(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over all keys, causal: ``[B, Hkv, G, w, S]``.

    Query ``i`` of the window (absolute index ``S - w + i`` among the keys) sees keys ``<= S - w + i``.
    """
    s = key.shape[-2]
    w = min(window, query.shape[-2])
    qg = grouped_queries(query[:, :, -w:].float(), key.shape[1])
    if w == 1:  # one row (a decode step's): the last query sees every key, no mask
        logits = torch.matmul(qg.squeeze(3), key.float().transpose(-1, -2)).unsqueeze(3) * scaling
        return torch.softmax(logits, dim=-1)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, key.float()) * scaling
    qi = torch.arange(s - w, s, device=key.device).unsqueeze(1)
    kj = torch.arange(s, device=key.device).unsqueeze(0)
    logits = logits.masked_fill(kj > qi, float("-inf"))
    return torch.softmax(logits, dim=-1)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query over all keys, with its probabilities.

    ``query [B, Hq, 1, D]``, ``key [B, Hkv, S, D]``, ``value [B, Hkv, S, Dv]`` (no mask: one query
    sees every stored key). Returns ``(out, probs)``: ``out [B, 1, Hq, Dv]`` in the query's dtype
    (transformers' attention-function layout) and ``probs [B, Hkv, G, 1, S]`` float32, exactly
    ``window_probs(query, key, scaling, 1)``, so a method that scores a decode step from these
    probabilities keeps the tokens it kept when it recomputed them. Both products run in float32;
    like SDPA for one query row it reads every key and value once.
    """
    probs = window_probs(query, key, scaling, 1)
    out = torch.matmul(probs.squeeze(3), value.float())  # [B, Hkv, G, Dv]
    b, hq, q, _ = query.shape
    return out.reshape(b, hq, q, value.shape[-1]).transpose(1, 2).contiguous().to(query.dtype), probs


def causal_prob_chunks(query: torch.Tensor, key: torch.Tensor, scaling: float, chunk: int = 256):
    """Causal softmax rows of all ``q`` queries, ``chunk`` queries at a time.

    Yields ``(start, stop, probs)`` with ``probs [B, Hkv, G, stop - start, kmax]``, ``kmax = S - q + stop``:
    each chunk is computed against the keys up to its last query only (the masked upper triangle
    beyond it is never computed), and only the chunk's trailing ``chunk x chunk`` block is masked.
    Memory is two ``[chunk, S]`` float32 blocks per head, allocated once per call and reused by
    every chunk: ``probs`` is a view that the next chunk overwrites (use it, or copy it, before
    asking for the next one). One allocation of a fixed size instead of two growing ones per
    chunk keeps the allocator's heap from fragmenting over a long or chunked prefill.
    """
    b, hq, q = query.shape[:3]
    n_kv, s = key.shape[1], key.shape[-2]
    g, off = hq // n_kv, s - q
    kf = key.float()
    rows = min(chunk, q)
    work = torch.empty(2, b * hq * rows * s, dtype=torch.float32, device=key.device)  # logits, probs
    upper = torch.ones(rows, rows, dtype=torch.bool, device=key.device).triu(1)
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        n, kmax = stop - start, off + stop
        qg = query[:, :, start:stop].float().reshape(b, n_kv, g * n, -1)  # a KV head's query heads, stacked
        logits = work[0, : b * hq * n * kmax].view(b, n_kv, g * n, kmax)
        torch.matmul(qg, kf[:, :, :kmax].transpose(-1, -2), out=logits)
        logits.mul_(scaling)
        logits = logits.view(b, n_kv, g, n, kmax)
        # query i of the chunk sees keys <= off + start + i: only the last n columns hold later keys
        logits[..., off + start:].masked_fill_(upper[:n, :n], float("-inf"))
        yield start, stop, torch.softmax(logits, dim=-1, out=work[1, : logits.numel()].view(logits.shape))


def causal_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, chunk: int = 256) -> torch.Tensor:
    """Sum over all ``q`` queries of their causal softmax rows: ``[B, Hkv, G, S]`` (see ``causal_prob_chunks``)."""
    b, hq = query.shape[:2]
    n_kv, s = key.shape[1], key.shape[-2]
    out = torch.zeros(b, n_kv, hq // n_kv, s, dtype=torch.float32, device=key.device)
    for _, _, probs in causal_prob_chunks(query, key, scaling, chunk):
        out[..., :probs.shape[-1]] += probs.sum(dim=-2)
    return out


def group_reduce(x: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """Reduce the query-group axis (dim 2) of ``[B, Hkv, G, ...]``: "mean" or "sum"."""
    if how == "mean":
        return x.mean(dim=2)
    if how == "sum":
        return x.sum(dim=2)
    raise ValueError(f"unknown group reduction {how!r}; allowed: 'mean', 'sum'")


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str = "max") -> torch.Tensor:
    """``kernel``-wide pooling of ``[B, H, S]`` scores along the keys ("max" or "avg", an average
    over the keys inside the sequence), so a token's neighbours rank with it; ``kernel`` 1 returns
    the scores unchanged."""
    if kernel == 1:
        return scores
    b, h, n = scores.shape
    flat = scores.reshape(b * h, 1, n)
    pad = kernel // 2
    if pooling == "avg":
        flat = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=False)
    elif pooling == "max":
        flat = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        raise ValueError(f"unknown pooling {pooling!r}; allowed: 'avg', 'max'")
    return flat.reshape(b, h, n)


def chunk_priority(scores: torch.Tensor, chunk: int, protected: torch.Tensor | None = None) -> torch.Tensor:
    """Priorities ``[B, H, S]`` (float32) whose top-k keeps whole chunks of ``chunk`` consecutive slots.

    The slots are cut into chunks ``[0, chunk), [chunk, 2 chunk), ...``; a chunk's score is the
    highest score among its tokens that are not ``protected`` (those are kept by rule anyway, so a
    chunk holding the attention sinks does not ride on them). Tokens are ranked by their chunk's
    score (ties: the earlier chunk), then by their own score, and get priorities ``S, S - 1, ..., 1``
    in that order. The top ``k`` of the priorities are therefore whole chunks, best first, plus
    the best-scored tokens of one partly kept chunk; a budget is still met exactly.
    """
    b, h, s = scores.shape
    x = scores.float()
    if chunk <= 1:
        return x
    own = x if protected is None else x.masked_fill(protected, float("-inf"))
    n_chunks = -(-s // chunk)
    padded = torch.nn.functional.pad(own, (0, n_chunks * chunk - s), value=float("-inf"))
    per_chunk = padded.reshape(b, h, n_chunks, chunk).amax(dim=-1)
    chunk_id = torch.arange(s, device=x.device) // chunk
    # lexicographic order by stable sorts, least significant key first: own score, chunk index, chunk score
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort(chunk_id[order], dim=-1, stable=True).indices)
    by_chunk = per_chunk.gather(-1, chunk_id[order])
    order = order.gather(-1, torch.sort(by_chunk, dim=-1, descending=True, stable=True).indices)
    rank = torch.arange(s, 0, -1, device=x.device, dtype=torch.float32).expand(b, h, s)
    return torch.empty_like(x).scatter_(-1, order, rank)


def heads_shared(scores: torch.Tensor, layer=None) -> torch.Tensor:
    """``scores [B, H, S]`` averaged over the heads and broadcast back, ``[B, H, S]`` (a view with
    stride 0 over the heads): one ranking for every head (a policy's ``per_head=False``). With
    ``layer`` (a :class:`~kvtrim.decisions.LayerView`) the mean is its
    :meth:`~kvtrim.decisions.LayerView.head_mean`, so under tensor parallelism (vLLM, each rank
    holding some of the heads) every rank ranks by the mean over all ranks' heads and keeps the same
    tokens; without, the mean over the heads given, and a view already broadcast from one row
    (stride 0 over several heads) is returned as it is."""
    if layer is None:
        if scores.shape[1] > 1 and scores.stride(1) == 0:
            return scores
        return scores.mean(dim=1, keepdim=True).expand_as(scores)
    return layer.head_mean(scores.unsqueeze(2)).unsqueeze(1).expand_as(scores)


def chunk_selection(scores: torch.Tensor, protected: torch.Tensor | None, chunk: int,
                    per_head: bool = True) -> torch.Tensor:
    """``chunk_priority`` for a policy's ``select``: with ``per_head=False`` (one token set per
    layer) the head mean of ``scores`` (:func:`heads_shared`; a policy passes its
    :meth:`~kvtrim.policies.base.Policy.shared` scores, already averaged over every
    tensor-parallel rank's heads) is chunked once and broadcast, so every head ranks the same chunks."""
    if chunk <= 1:
        return scores
    if not per_head:
        row = heads_shared(scores.float())[:, :1]
        if protected is not None:
            protected = protected.any(dim=1, keepdim=True)
        return chunk_priority(row, chunk, protected).expand_as(scores)
    return chunk_priority(scores, chunk, protected)

