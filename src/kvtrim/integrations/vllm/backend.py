"""kvtrim's attention backend for vLLM's CPU build: ``CPU_ATTN`` plus sparse prefill and compaction.

vLLM resolves ``CPU_ATTN`` to :class:`KVTrimCPUBackend` once the plugin is registered. Without
``additional_config["kvtrim"]`` it returns vLLM's own implementation and builder classes, so
nothing changes. Configured, one step of a worker runs like this:

1. :class:`KVTrimBuilder` (once per step) reads each request's row of the batch: cached tokens
   ``ctx = seq_len - q_len``, whether vLLM counts it as prefilling, its first physical block
   (the key of the worker's per-request state; prefix caching is off, so no other running
   request shares it). It decides, per row: sparse prefill (a whole prompt of at least
   ``min_length`` tokens in this step), SnapKV scoring (every prefill chunk), compaction (the
   first decode step), and the evicted block range (:func:`plan.evicted_range`), which it cuts
   out of the block table and the sequence length handed to vLLM's kernel.
2. :meth:`KVTrimImpl.do_kv_cache_update` (per layer) first compacts the rows due this step, then
   lets vLLM write the new keys and values. The scheduler may already have handed the freed
   blocks to another request in this step; that request writes them only in this same call,
   after the compaction has read them.
3. :meth:`KVTrimImpl.forward` (per layer) runs vLLM's kernel for the dense rows, kvtrim's sparse
   kernel for the sparse rows, and records the SnapKV scores of prefill rows (the last
   ``window`` queries against every key of the request, per local KV head).

Tensor parallel: each rank holds ``Hq / tp`` query heads and ``Hkv / tp`` KV heads. The pattern
config is sliced to the rank's heads; SnapKV selects per local KV head, and the number of blocks
kept depends only on the prompt length, so every rank frees the same blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from kvtrim.errors import KVTrimError
from kvtrim.integrations.vllm import plan
from kvtrim.integrations.vllm.config import PluginConfig, check_engine, parse

if TYPE_CHECKING:
    from kvtrim.integrations.prefill import SparsePrefill
    from kvtrim.policies.snapkv import SnapKV

log = logging.getLogger("vllm.kvtrim")  # under vLLM's logger, so its handlers print it


# --------------------------------------------------------------------------- per-process state
@dataclass
class RequestState:
    """What a worker remembers about one running request (keyed by its first physical block)."""

    prompt_len: int | None = None  # cached tokens at the first decode step
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv_local, S] SnapKV scores


@dataclass
class Settings:
    cfg: PluginConfig
    prefill: SparsePrefill | None  # sliced to this rank's heads
    snapkv: SnapKV | None  # its score() is kvtrim's token-level method's


_SETTINGS: Settings | None = None
_CHECKED = False
STATE: dict[int, RequestState] = {}
_LOGGED: set[str] = set()


def _once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.info("kvtrim: %s", msg)


def settings() -> Settings | None:
    """This process's plugin settings from the current vLLM config (checked once; None: not configured)."""
    global _SETTINGS, _CHECKED
    if _CHECKED:
        return _SETTINGS
    vc = get_current_vllm_config()
    try:
        cfg = parse(vc.additional_config)
        if cfg is not None:
            _SETTINGS = _build(cfg, vc)
    except KVTrimError as e:
        log.error("kvtrim: %s", e)
        raise
    _CHECKED = True
    return _SETTINGS


def _build(cfg: PluginConfig, vc) -> Settings:
    import vllm
    from vllm.platforms import current_platform

    check_engine(
        cfg, vllm_version=vllm.__version__, prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        speculative=vc.speculative_config is not None, scheduler_cls=_qualname(vc.scheduler_config.scheduler_cls),
        platform="cpu" if current_platform.is_cpu() else str(current_platform.device_type),
    )
    prefill = None
    if cfg.prefill is not None:
        prefill = _prefill_hook(cfg.prefill, cfg, vc)
    snap = None
    if cfg.method == "snapkv":
        from kvtrim.policies.snapkv import SnapKV

        snap = SnapKV(window=cfg.window, kernel=cfg.kernel, pooling=cfg.pooling, keep=cfg.keep)
    _once(f"configured: prefill={cfg.prefill} method={cfg.method} keep={cfg.keep}")
    return Settings(cfg, prefill, snap)


def _qualname(cls) -> str | None:
    if cls is None or isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"


def _prefill_hook(mode: str, cfg: PluginConfig, vc) -> SparsePrefill:
    """kvtrim's SparsePrefill for this model, its pattern config checked, then sliced to this rank's heads."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from kvtrim.integrations.prefill import PatternConfig, make_prefill

    shim = SimpleNamespace(config=vc.model_config.hf_config)
    hook = make_prefill(shim, mode, pattern_config=cfg.pattern_config, sizes=cfg.sizes or None,
                        min_length=cfg.min_length)
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    if hook.config is not None and tp > 1:
        full = hook.config
        n_h = full.model["num_attention_heads"] // tp
        model = dict(full.model, num_attention_heads=n_h,
                     num_key_value_heads=max(1, full.model.get("num_key_value_heads", n_h * tp) // tp))
        hook.config = PatternConfig(model=model, layers=[row[rank * n_h:(rank + 1) * n_h] for row in full.layers],
                                    search=full.search)
    return hook


# --------------------------------------------------------------------------------- the backend
class KVTrimCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with kvtrim's additions (vLLM's own classes when the plugin is not configured)."""

    @staticmethod
    def get_impl_cls():
        return KVTrimImpl if settings() is not None else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return KVTrimBuilder if settings() is not None else CPUAttentionMetadataBuilder


@dataclass
class RowPlan:
    """One request of the step, as the builder saw it (token rows ``start:stop`` of the batch)."""

    row: int
    start: int
    stop: int
    ctx: int
    key: int  # first physical block
    blocks: torch.Tensor  # the request's block ids in logical order, before eviction
    sparse: bool = False
    score: bool = False
    compact: tuple[int, int] | None = None  # (kept blocks, full prompt blocks) to compact now


@dataclass
class KVTrimMetadata(CPUAttentionMetadata):
    kvtrim_rows: list[RowPlan] = field(default_factory=list)


class KVTrimBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        s = settings()
        assert s is not None
        cm = common_attn_metadata
        qsl = cm.query_start_loc_cpu.tolist() if cm.query_start_loc_cpu is not None else cm.query_start_loc.tolist()
        seq = cm.seq_lens.cpu()
        prefilling = cm.is_prefilling.cpu().tolist() if cm.is_prefilling is not None else None
        table = cm.block_table_tensor
        new_table: torch.Tensor | None = None
        new_seq: torch.Tensor | None = None
        rows: list[RowPlan] = []
        bs = self.block_size
        for r in range(cm.num_reqs):
            q_len, s_len = qsl[r + 1] - qsl[r], int(seq[r])
            ctx = s_len - q_len
            n_blocks = -(-s_len // bs)
            rp = RowPlan(r, qsl[r], qsl[r + 1], ctx, int(table[r, 0]), table[r, :n_blocks])
            rows.append(rp)
            if s.cfg.method is None:
                if s.prefill is not None and ctx == 0 and q_len >= s.cfg.min_length:
                    rp.sparse = True
                continue
            if ctx == 0:
                STATE[rp.key] = RequestState()
            st = STATE.get(rp.key)
            if st is None:  # a request that started before the plugin saw it (cannot happen) stays dense
                continue
            decoding = q_len == 1 and not (prefilling[r] if prefilling is not None else False)
            if not decoding:
                rp.sparse = s.prefill is not None and ctx == 0 and q_len >= s.cfg.min_length
                rp.score = s.snapkv is not None
                continue
            if st.prompt_len is None:
                st.prompt_len = ctx
                if s.snapkv is not None:
                    first, stop = plan.evicted_range(s.cfg, ctx, ctx, bs)
                    if stop > first:
                        rp.compact = (first, stop)
            first, stop = plan.evicted_range(s.cfg, st.prompt_len, ctx, bs)
            if stop > first:
                if new_table is None or new_seq is None:
                    new_table, new_seq = table.clone(), cm.seq_lens.clone()
                new_table[r] = plan.compacted_row(table[r], first, stop)
                new_seq[r] -= (stop - first) * bs
                _once(f"{s.cfg.method}: attention reads the kept blocks only")
        if new_table is not None and new_seq is not None:
            cm = dataclasses.replace(cm, block_table_tensor=new_table, seq_lens=new_seq,
                                     max_seq_len=int(new_seq.max()))
        md = super().build(common_prefix_len, cm, fast_build)
        return KVTrimMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)}, kvtrim_rows=rows)


def _layer_index(layer) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer.layer_name)


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, Hkv, bs, 2D]`` as key and value views ``[blocks, Hkv, bs, D]``."""
    nb, hkv, bs, _ = kv_cache.shape
    k, v = kv_cache.view(nb, hkv, bs * 2, -1).chunk(2, dim=2)
    return k, v


@functools.cache
def _layouts(isa: str, bs: int, d: int, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU kernel puts each (token, channel) of a block's keys and values.

    Learnt once per process by writing probe tokens with vLLM's own cache-write op into a scratch
    block: one probe holds each token's index in all its channels, the other each channel's
    index. Returns, for keys and values, the stored position of token-major element
    ``t * d + j`` (:func:`plan.token_major`). The ``vec`` kernel stores keys channel-major and values
    token-major; the op, not this module, decides, so other layouts are read the same way.
    """
    from vllm import _custom_ops as ops

    out = []
    codes = []
    for probe in (torch.arange(bs).view(bs, 1, 1).expand(bs, 1, d), torch.arange(d).view(1, 1, d).expand(bs, 1, d)):
        kv = torch.full((1, 1, bs, 2 * d), -1.0, dtype=dtype)
        kc, vc = _split(kv)
        x = probe.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x.clone(), kc, vc, torch.arange(bs, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
        codes.append((kc.reshape(-1).long(), vc.reshape(-1).long()))
    for which in (0, 1):
        t, j = codes[0][which], codes[1][which]
        if bool((t < 0).any() or (j < 0).any()):
            raise KVTrimError(f"kvtrim: unknown KV cache layout of vLLM's CPU kernel (isa {isa}); compaction cannot run")
        layout = torch.full((bs * d,), -1, dtype=torch.long)
        layout[t * d + j] = torch.arange(bs * d)
        if bool((layout < 0).any()):
            raise KVTrimError(f"kvtrim: unknown KV cache layout of vLLM's CPU kernel (isa {isa}); compaction cannot run")
        out.append(layout)
    return out[0], out[1]


def _layouts_of(impl, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _layouts(layer.isa, kv_cache.shape[2], kv_cache.shape[3] // 2, kv_cache.dtype, impl.kv_cache_dtype)


class KVTrimImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        s = settings()
        md = _metadata(layer)
        if s is not None and s.snapkv is not None and md is not None:
            li = _layer_index(layer)
            for rp in md.kvtrim_rows:
                if rp.compact is not None:
                    self._compact(s, li, rp, kv_cache, _layouts_of(self, layer, kv_cache))
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _compact(self, s: Settings, li: int, rp: RowPlan, kv_cache: torch.Tensor,
                 layouts: tuple[torch.Tensor, torch.Tensor]) -> None:
        st = STATE[rp.key]
        scores = st.scores.pop(li, None)
        first, stop = rp.compact  # type: ignore[misc]
        kc, vc = _split(kv_cache)
        bs = kc.shape[2]
        prompt_len = st.prompt_len or 0
        full = stop * bs
        if scores is None or scores.shape[-1] < full:
            raise KVTrimError(f"kvtrim: no SnapKV scores for layer {li} of a request at its first decode step")
        keep = plan.select_tokens(scores[:, :full], first * bs, s.cfg.sinks, prompt_len - s.cfg.window)
        plan.compact(kc, vc, rp.blocks[:stop], keep, layouts)
        _once(f"snapkv compaction in use: {first} of {stop} full prompt blocks kept")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        s = settings()
        md = attn_metadata
        if s is None or md is None or not isinstance(md, KVTrimMetadata):
            return super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        li = _layer_index(layer)
        done: set[int] = set()
        for rp in md.kvtrim_rows:
            if rp.sparse and self._sparse(s, li, rp, query, key, value, output):
                done.add(rp.row)
        if len(done) < len(md.kvtrim_rows):
            if done:
                # vLLM's kernel runs over the whole batch; keep the sparse rows' results
                saved = {rp.row: output[rp.start:rp.stop].clone() for rp in md.kvtrim_rows if rp.row in done}
                _once("a batch mixed sparse-prefill and other requests: its sparse rows are also computed densely")
            super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
            if done:
                for rp in md.kvtrim_rows:
                    if rp.row in done:
                        output[rp.start:rp.stop] = saved[rp.row]
        if s.snapkv is not None:
            for rp in md.kvtrim_rows:
                if rp.score:
                    self._score(s, li, rp, query, key, kv_cache, layer)
        return output

    def _sparse(self, s: Settings, li: int, rp: RowPlan, query, key, value, output) -> bool:
        t = rp.stop - rp.start
        q = query[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        k = key[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)
        v = value[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)
        assert s.prefill is not None
        res = s.prefill(SimpleNamespace(layer_idx=li), q, k, v, None, self.scale)
        if res is None:
            return False
        out = res[0][0]  # [T, Hq, D]
        output[rp.start:rp.stop] = out.reshape(t, *output.shape[1:]).to(output.dtype)
        _once(f"sparse prefill ({s.cfg.prefill}) in use")
        return True

    def _score(self, s: Settings, li: int, rp: RowPlan, query, key, kv_cache, layer) -> None:
        q = query[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if rp.ctx == 0:
            k = key[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        else:  # a later chunk: every key of the request, from the paged cache
            kc, _ = _split(kv_cache)
            n = rp.ctx + (rp.stop - rp.start)
            kb = plan.token_major(kc[rp.blocks], _layouts_of(self, layer, kv_cache)[0])
            k = kb.permute(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[-1])[:, :n].unsqueeze(0)
        assert s.snapkv is not None
        STATE[rp.key].scores[li] = s.snapkv.score(None, q, k, self.scale)[0].float()


def _metadata(layer) -> KVTrimMetadata | None:
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        md = md[0]
    if isinstance(md, dict):
        md = md.get(layer.layer_name)
    return md if isinstance(md, KVTrimMetadata) else None
