"""kvtrim's storage over vLLM's paged KV cache: a policy's decisions carried out on blocks.

No vLLM import: the backend (``kvtrim.integrations.vllm.backend``) hands in vLLM's cache tensors
and the blocks a request holds. One :class:`PagedLayer` per request and attention layer, on each
worker (its tensor-parallel rank's KV heads), keeps what the transformers storage keeps beside its
buffers -- each stored token's stream index per KV head, the policy's per-layer and per-token state,
the counters -- and gives the policy the same read-only view (``kvtrim.decisions.LayerView``), so
the same policy classes decide in both engines. The keys and values themselves stay in vLLM's
blocks: stored slot ``s`` is token ``s % bs`` of the ``s // bs``-th block the request holds (in the
order of its block table), and the view reads them from there when a hook asks.

A hook's decisions (one or several) are composed into one :class:`Compaction` -- the kept slots per
KV head, merged keys and values where a merge made them, the per-token states to write -- and
applied at the request's next step, before vLLM writes its new tokens (:meth:`PagedLayer.compact`):
the kept tokens, in order, fill the blocks the request keeps, and only blocks whose content changes
are written (dropping the tokens after the sinks rewrites the first block only). Every decision
kind goes this way; the block arithmetic is the same for all (``kvtrim.integrations.vllm.plan``).

vLLM's fp8 KV caches (``kv_cache_dtype`` ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) hold one byte per
element. A :class:`CacheFormat` says how to read them: a moved token keeps its bytes (compaction
never re-quantizes), a hook reads keys and values dequantized with the layer's own scale, and a
merged token is quantized by vLLM's own cache-write op (the backend hands that in as ``encode``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtrim.decisions import Decisions, Merge, ViewOf, as_keep, as_list, paged_kept
from kvtrim.errors import KVTrimError
from kvtrim.integrations.vllm.plan import phase_of, stored, token_major

if TYPE_CHECKING:
    from kvtrim.rope import Rotary
    from kvtrim.spans import SpanSet


#: vLLM's fp8 ``kv_cache_dtype`` kinds and the float8 format of their bytes (``fp8`` is e4m3 in vLLM's CPU kernel)
FP8_KINDS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class CacheFormat:
    """How one attention layer's keys and values are held in vLLM's cache.

    ``fp8=None``: in the model's dtype, exactly as the kernel reads them. Otherwise (vLLM's fp8
    ``kv_cache_dtype`` kinds) one byte per element: the bits of ``fp8`` (``torch.float8_e4m3fn`` or
    ``torch.float8_e5m2``) for ``value / scale``, one scale per layer for keys and one for values
    (vLLM's ``_k_scale_float`` / ``_v_scale_float``: 1.0 unless the checkpoint ships scales).
    ``dtype``: the model's dtype, which :meth:`decode` returns. ``encode``: token-major keys and
    values ``[H, K, D]`` in the model's dtype -> their bytes as vLLM's cache-write op writes them
    (round toward zero on the CPU build, not torch's round-to-nearest); needed for merged tokens
    only, since a moved token keeps its bytes.
    """

    fp8: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    encode: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, compare=False)

    @property
    def quantized(self) -> bool:
        return self.fp8 is not None

    def decode(self, raw: torch.Tensor, which: str) -> torch.Tensor:
        """Stored elements (``which``: ``"keys"`` or ``"values"``) as the values the kernel attends to."""
        if self.fp8 is None:
            return raw
        scale = self.k_scale if which == "keys" else self.v_scale
        return (raw.view(self.fp8).to(torch.float32) * scale).to(self.dtype)


PLAIN = CacheFormat()


@dataclass
class Compaction:
    """A hook's decisions as one: keep slots ``idx [1, H, K]`` of the ``length`` stored tokens; where a
    merge made them, the kept tokens' keys and values ``[1, H, K, D]``; per-token states to write."""

    idx: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    states: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return int(self.idx.shape[-1])


def compose(decisions: Decisions, length: int, heads: int, device=None) -> Compaction | None:
    """The decisions a hook returned, applied in order, as one :class:`Compaction` (None: none)."""
    out: Compaction | None = None
    n = length
    for d in as_list(decisions):
        if getattr(d, "layer", None) is not None:
            raise KVTrimError("kvtrim's vLLM storage applies a decision to the layer that made it only")
        keep = as_keep(d, n, 1, heads, device)
        idx = keep.idx
        if out is None:
            out = Compaction(idx)
        else:
            g = idx
            out.idx = torch.gather(out.idx, 2, g)
            if out.keys is not None and out.values is not None:
                ex = g.unsqueeze(-1)
                out.keys = torch.gather(out.keys, 2, ex.expand(*g.shape, out.keys.shape[-1]))
                out.values = torch.gather(out.values, 2, ex.expand(*g.shape, out.values.shape[-1]))
            out.states = {k: torch.gather(t, 2, g) for k, t in out.states.items()}
        if isinstance(d, Merge):
            out.keys, out.values = d.keys, d.values
        out.states.update(keep.states)
        n = idx.shape[-1]
    return out


def read_tokens(cache: torch.Tensor, blocks: torch.Tensor, n: int, layout: torch.Tensor | None) -> torch.Tensor:
    """The first ``n`` tokens held in ``blocks`` (physical ids, in order) of one half of vLLM's cache
    (``[num_blocks, H, bs, D]``), token-major: ``[H, n, D]``."""
    h, d = cache.shape[1], cache.shape[3]
    data = token_major(cache[blocks], layout)  # [nb, H, bs, D] (a copy)
    return data.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]


class PagedLayer:
    """One request's tokens in one attention layer of one worker, as a policy's hooks see them."""

    def __init__(self, layer_idx: int, heads: int, block_size: int, device=None):
        self.layer_idx = layer_idx
        self.heads = heads
        self.block_size = block_size
        self.positions = torch.empty(1, heads, 0, dtype=torch.long, device=device)
        self.token_state: dict[str, torch.Tensor] = {}
        self.state: dict = {}
        self.seen = 0
        self.length = 0
        self.n_new = 0
        self.phase = "prefill"
        self.attention_scores = None
        self.decode_probs: torch.Tensor | None = None
        self.pending: Compaction | None = None
        # set by the backend while a hook runs: reads the stored keys or values, [1, H, S, D]
        self.reader: Callable[[str], torch.Tensor] | None = None
        # set by the backend under tensor parallelism: gathers a tensor from every rank of the group
        # (stacked along a new first dim, in rank order), for scores shared by all heads (head_mean)
        self.gather_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.view = PagedView(self)

    def append(self, ctx: int, q: int) -> None:
        """Account ``q`` new tokens after ``ctx`` cached ones (vLLM has written their keys and values)."""
        if ctx != self.seen:
            raise KVTrimError(f"kvtrim: layer {self.layer_idx} is at {self.seen} tokens, a step continued at {ctx}")
        new = torch.arange(ctx, ctx + q, device=self.positions.device).view(1, 1, q).expand(1, self.heads, q)
        self.positions = torch.cat([self.positions, new], dim=2)
        self.token_state = {k: torch.cat([t, t.new_zeros(1, self.heads, q)], dim=2) for k, t in self.token_state.items()}
        self.phase = phase_of(ctx, q)
        self.n_new = q
        self.seen = ctx + q
        self.length += q

    def decide(self, policy, query: torch.Tensor, key: torch.Tensor, scaling: float, kept: int) -> None:
        """Run the policy's hook after this step's attention and hold its decisions until the next
        step; ``kept``: the tokens the plan says stay (``Ledger.end_step``), which they must."""
        self.pending = compose(policy.after_attention(self.view, query, key, scaling), self.length, self.heads,
                               self.positions.device)
        got = self.length if self.pending is None else self.pending.kept
        if got != kept:
            raise KVTrimError(
                f"kvtrim: {policy.name} kept {got} of {self.length} tokens in layer {self.layer_idx}, its eviction_target "
                f"plans {kept}: the policy's hooks and its integer rule disagree"
            )

    def compact(self, key_cache: torch.Tensor, value_cache: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                layouts: tuple[torch.Tensor | None, torch.Tensor | None], fmt: CacheFormat = PLAIN) -> None:
        """Carry out the pending decision: the kept tokens move, in order, into the blocks ``after``
        (physical ids; ``before``: the blocks that held the ``length`` stored tokens). A moved token
        keeps its stored elements as they are (bytes of an fp8 cache included); merged tokens are
        written in ``fmt``."""
        c = self.pending
        if c is None:
            raise KVTrimError(f"kvtrim: layer {self.layer_idx} frees blocks without a decision")
        bs = key_cache.shape[2]
        idx = c.idx[0]  # [H, K]
        k = idx.shape[-1]
        if after.numel() != -(-k // bs) or before.numel() != -(-self.length // bs):
            raise KVTrimError(f"kvtrim: layer {self.layer_idx}: {k} kept tokens do not fit the {after.numel()} blocks kept")
        # a block is rewritten where any of its new slots comes from another place (or was merged)
        j = torch.arange(k, device=idx.device)
        moved = (before[idx // bs] != after[j // bs]) | (idx % bs != j % bs)  # [H, K]
        if c.keys is not None:
            moved[:] = True
        per_block = torch.zeros(after.numel(), dtype=torch.long, device=idx.device)
        changed = per_block.index_add_(0, j // bs, moved.any(dim=0).long()).nonzero().flatten()
        if changed.numel():
            merged_k, merged_v = (None, None) if c.keys is None or c.values is None else (c.keys[0], c.values[0])
            if merged_k is not None and merged_v is not None and fmt.quantized:
                if fmt.encode is None:
                    raise KVTrimError(f"kvtrim: layer {self.layer_idx}: merged tokens cannot be written to an fp8 cache "
                                      "without vLLM's cache-write op")
                merged_k, merged_v = fmt.encode(merged_k.to(fmt.dtype), merged_v.to(fmt.dtype))
            for cache, layout, merged in ((key_cache, layouts[0], merged_k), (value_cache, layouts[1], merged_v)):
                d = cache.shape[-1]
                if merged is None:
                    src = read_tokens(cache, before, self.length, layout)  # [H, S, D]
                    new = torch.gather(src, 1, idx.unsqueeze(-1).expand(*idx.shape, d))
                else:
                    new = merged
                if new.dtype != cache.dtype and not (cache.is_floating_point() and new.is_floating_point()):
                    raise KVTrimError(f"kvtrim: layer {self.layer_idx}: {new.dtype} tokens cannot be written to a "
                                      f"{cache.dtype} cache")
                full = new.new_zeros(self.heads, after.numel() * bs, d)
                full[:, :k] = new.to(full.dtype)
                blocks = full.view(self.heads, after.numel(), bs, d).permute(1, 0, 2, 3)[changed]
                cache[after[changed]] = stored(blocks.contiguous(), layout).to(cache.dtype)
        self.positions = torch.gather(self.positions, 2, c.idx)
        self.token_state = {n: torch.gather(t, 2, c.idx) for n, t in self.token_state.items()}
        for name, t in c.states.items():
            self.token_state[name] = t.to(self.token_state[name].dtype if name in self.token_state else t.dtype).clone()
        self.length = k
        self.pending = None

    def read(self, which: str) -> torch.Tensor:
        if self.reader is None:
            raise KVTrimError(f"kvtrim: the {which} of layer {self.layer_idx} are read only while its hook runs")
        return self.reader(which)


class PagedView(ViewOf):
    """The read-only :class:`~kvtrim.decisions.LayerView` of a :class:`PagedLayer`."""

    __slots__ = ()

    position_policy = "true"  # vLLM rotates every key at its true position and every new query at its own
    rotary: Rotary | None = None
    spans: SpanSet | None = None
    n_layers = 0  # each layer decides for itself here (see other())

    rotations = property(lambda self: self._layer.positions)
    keys = property(lambda self: self._layer.read("keys"))
    values = property(lambda self: self._layer.read("values"))

    def new_token_state(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        layer = self._layer
        if name not in layer.token_state:
            layer.token_state[name] = torch.zeros(1, layer.heads, layer.length, dtype=dtype, device=layer.positions.device)
        return layer.token_state[name]

    def state_view(self, name: str) -> torch.Tensor:
        return self._layer.token_state[name]

    def has_token_state(self, name: str) -> bool:
        return name in self._layer.token_state

    def round_budget(self, budget: int) -> int:
        return paged_kept(budget, self._layer.length, self._layer.block_size)

    def other(self, layer_idx: int):
        return None  # each layer decides for itself here (methods that decide for all are refused)

    def head_mean(self, x: torch.Tensor) -> torch.Tensor:
        local = x.mean(dim=(1, 2))  # this rank's heads
        gather = self._layer.gather_ranks
        if gather is None:
            return local
        # every rank holds as many heads: the mean of the ranks' means is the mean over all heads,
        # summed in rank order on each rank, so every rank gets the same bits (the same anchors)
        return gather(local).mean(dim=0)
