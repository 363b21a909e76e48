"""Block arithmetic and KV compaction shared by the plugin's scheduler and its attention backend.

No vLLM import: the scheduler (engine-core process) and every worker (one per tensor-parallel
rank) call the same pure functions on the same integers, which is what keeps them in agreement
without messages between them.

A request's KV lives in blocks of ``block_size`` tokens; its block table lists them in *logical*
order (logical block ``i`` holds positions ``i*bs .. i*bs+bs-1``). Compression removes one range
of logical blocks ``[first, stop)`` from every layer and head at once (the table is shared), so:

* the scheduler frees those blocks to vLLM's pool (and puts vLLM's null block in their place, as
  vLLM does for sliding-window layers, so its own block counting is unchanged);
* the workers hand the attention kernel a table without them and a sequence length shortened
  by ``(stop - first) * bs``. Keys are cached after RoPE and new tokens keep their true
  positions, so attention over the remaining keys is exact for what is kept.

``streaming_llm`` drops whole blocks: the first block (sinks) stays, and the range grows with
the stream so that at least ``recent`` tokens before the current one remain. ``snapkv`` selects
tokens, not blocks: at the first decode step each layer and KV head picks its own best
``first * bs`` tokens of the prompt's full blocks by SnapKV's score and moves them, in order,
into the first ``first`` blocks (:func:`compact`); the prompt's last, partial block stays where
it is (its tokens are the most recent ones, inside SnapKV's window). Only the token count is
rounded, up to whole blocks.
"""

from __future__ import annotations

import math

import torch

from kvtrim.integrations.vllm.config import PluginConfig


def snapkv_blocks(cfg: PluginConfig, prompt_len: int, block_size: int) -> int:
    """How many of the prompt's full blocks hold SnapKV's kept tokens (at least 1, at most all)."""
    full = prompt_len // block_size
    if full == 0:
        return 0
    tail = prompt_len - full * block_size
    target = math.ceil(cfg.keep * prompt_len)
    # tokens that must survive inside the full blocks: the sinks and the part of the window before the tail
    forced = min(cfg.sinks, full * block_size) + min(max(0, cfg.window - tail), full * block_size)
    need = max(target - tail, forced, 1)
    return min(full, max(1, math.ceil(need / block_size)))


def evicted_range(cfg: PluginConfig, prompt_len: int, ctx: int, block_size: int) -> tuple[int, int]:
    """Logical blocks ``[first, stop)`` a request holds no longer, once ``ctx`` tokens are cached.

    ``prompt_len`` is the number of cached tokens at the request's first decode step (the prompt,
    or prompt plus earlier output after a recompute). Empty range: ``first == stop``.
    """
    if cfg.method == "snapkv":
        first = snapkv_blocks(cfg, prompt_len, block_size)
        return (first, max(first, prompt_len // block_size))
    if cfg.method == "streaming_llm":
        first = max(1, math.ceil(cfg.sinks / block_size))  # the first block always stays (sinks)
        recent = max(1, math.ceil(cfg.keep * prompt_len) - cfg.sinks)
        stop = max(first, (ctx - recent) // block_size)
        return (first, stop)
    return (0, 0)


def compacted_row(row: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """A block-table row without logical blocks ``[first, stop)`` (the freed ones), padded with zeros."""
    out = torch.zeros_like(row)
    kept = torch.cat([row[:first], row[stop:]])
    out[: kept.numel()] = kept
    return out


def select_tokens(scores: torch.Tensor, n_keep: int, sinks: int, protect_from: int) -> torch.Tensor:
    """Per KV head, the ``n_keep`` best of ``scores [Hkv, F]`` with the first ``sinks`` and every
    index ``>= protect_from`` forced in; ascending ``[Hkv, n_keep]``."""
    s = scores.float().clone()
    s[:, : min(sinks, s.shape[1])] = float("inf")
    if protect_from < s.shape[1]:
        s[:, max(protect_from, 0):] = float("inf")
    idx = torch.topk(s, n_keep, dim=-1).indices
    return idx.sort(dim=-1).values


def token_major(data: torch.Tensor, layout: torch.Tensor | None) -> torch.Tensor:
    """Blocks ``[nb, Hkv, bs, D]`` as stored by the kernel, as ``[nb, Hkv, bs, D]`` token by token.

    ``layout``: where token-major element ``t * D + j`` (token ``t``, channel ``j``) lies in a
    block head's ``bs * D`` stored values (a permutation; ``None``: stored token-major already).
    vLLM's CPU kernel, for example, stores a block's keys channel-major (``[D, bs]``) and its
    values token-major.
    """
    if layout is None:
        return data
    nb, h, bs, d = data.shape
    return data.reshape(nb, h, bs * d)[..., layout].view(nb, h, bs, d)


def stored(data: torch.Tensor, layout: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`token_major`: token-major blocks in the kernel's stored order."""
    if layout is None:
        return data
    nb, h, bs, d = data.shape
    out = torch.empty_like(data).reshape(nb, h, bs * d)
    out[..., layout] = data.reshape(nb, h, bs * d)
    return out.view(nb, h, bs, d)


def compact(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor,
            layouts: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> None:
    """Move each KV head's kept tokens into the request's first blocks, in order (in place).

    ``key_cache``/``value_cache``: ``[num_blocks, Hkv, bs, D]`` (views of vLLM's paged cache);
    ``blocks``: the request's first ``F / bs`` block ids in logical order; ``keep [Hkv, n]``:
    token indices into those blocks' ``F`` tokens, ``n`` a multiple of ``bs``; ``layouts``: how
    the kernel orders a block's keys and values (see :func:`token_major`). After the call,
    logical blocks ``0 .. n/bs - 1`` hold head ``h``'s tokens ``keep[h]``.
    """
    hkv, n = keep.shape
    bs = key_cache.shape[2]
    dst = blocks[: n // bs]
    for cache, layout in zip((key_cache, value_cache), layouts):
        d = cache.shape[-1]
        src = token_major(cache[blocks], layout).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, F, D] (a copy)
        picked = torch.gather(src, 1, keep.unsqueeze(-1).expand(hkv, n, d))  # [Hkv, n, D]
        cache[dst] = stored(picked.reshape(hkv, n // bs, bs, d).permute(1, 0, 2, 3), layout).to(cache.dtype)
