"""kvtrim's attention backend for vLLM's CPU build: ``CPU_ATTN`` plus sparse prefill and compaction.

vLLM resolves ``CPU_ATTN`` to :class:`KVTrimCPUBackend` once the plugin is registered. Without
``additional_config["kvtrim"]`` it returns vLLM's own implementation and builder classes, so
nothing changes. Configured with a method, the worker builds the method's policy with
``kvtrim.registry.create_policy`` (the same class as on transformers) and one step runs like this:

1. :class:`KVTrimBuilder` (once per step) advances each request's ``Ledger``
   (``kvtrim.integrations.vllm.plan``) exactly as the scheduler does: the blocks planned after the
   request's last forward leave, the blocks its new tokens need join, and the block table and
   sequence length handed to vLLM's kernel list only the blocks the request holds. It also marks the
   rows that prefill sparse (a whole prompt of at least ``min_length`` tokens in this step).
2. :meth:`KVTrimImpl.do_kv_cache_update` (per layer) first moves each request's kept tokens into the
   blocks it keeps (``PagedLayer.compact``: the decision its policy made after the last forward), then
   lets vLLM write the new keys and values. The scheduler may already have handed the freed blocks
   to another request in this step; that request writes them only in this same call, after the
   compaction has read them.
3. :meth:`KVTrimImpl.forward` (per layer) runs vLLM's kernel for the dense rows and kvtrim's sparse
   kernel for the sparse rows, then each request's policy hook with its layer's view
   (``kvtrim.integrations.vllm.storage``): the step's queries, the request's stored keys read from its
   blocks, and, where the policy scores a decode step from its attention (``wants_decode_probs``),
   the step's attention probabilities, computed here because vLLM's kernel does not return them.

Tensor parallel: each rank holds ``Hq / tp`` query heads and ``Hkv / tp`` KV heads. The pattern
config is sliced to the rank's heads; a policy selects per local KV head, and the number of tokens
kept depends only on the counters, so every rank frees the same blocks. A policy that averages its
scores over all heads (``per_head=False``) averages over the rank's own heads.
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
from kvtrim.integrations.vllm.storage import FP8_KINDS, CacheFormat, PagedLayer, read_tokens
from kvtrim.scores import window_probs

if TYPE_CHECKING:
    from kvtrim.integrations.prefill import SparsePrefill
    from kvtrim.policies.base import Policy

log = logging.getLogger("vllm.kvtrim")  # under vLLM's logger, so its handlers print it


# --------------------------------------------------------------------------- per-process state
@dataclass
class RequestState:
    """What a worker keeps about one running request (keyed by its first physical block, which it
    holds until it ends: prefix caching is off, and compaction never frees it)."""

    ledger: plan.Ledger
    layers: dict[int, PagedLayer] = field(default_factory=dict)


@dataclass
class Settings:
    cfg: PluginConfig
    prefill: SparsePrefill | None  # sliced to this rank's heads
    policy: Policy | None  # the method's policy, built by create_policy


class _Process:
    """This process's plugin state: the settings (read once from vLLM's config) and the running
    requests' state. One per worker process, which serves one engine."""

    def __init__(self) -> None:
        self.checked = False
        self.settings: Settings | None = None
        self.requests: dict[int, RequestState] = {}
        self.logged: set[str] = set()


PROCESS = _Process()


def _once(msg: str) -> None:
    if msg not in PROCESS.logged:
        PROCESS.logged.add(msg)
        log.info("kvtrim: %s", msg)


def settings() -> Settings | None:
    """This process's plugin settings from the current vLLM config (checked once; None: not configured)."""
    if PROCESS.checked:
        return PROCESS.settings
    vc = get_current_vllm_config()
    try:
        cfg = parse(vc.additional_config)
        if cfg is not None:
            PROCESS.settings = _build(cfg, vc)
    except KVTrimError as e:
        log.error("kvtrim: %s", e)
        raise
    PROCESS.checked = True
    return PROCESS.settings


def _build(cfg: PluginConfig, vc) -> Settings:
    import vllm
    from vllm.platforms import current_platform

    check_engine(
        cfg, vllm_version=vllm.__version__, prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        speculative=vc.speculative_config is not None, scheduler_cls=_qualname(vc.scheduler_config.scheduler_cls),
        kv_cache_dtype=str(vc.cache_config.cache_dtype),
        platform="cpu" if current_platform.is_cpu() else str(current_platform.device_type),
    )
    prefill = None
    if cfg.prefill is not None:
        prefill = _prefill_hook(cfg.prefill, cfg, vc)
    policy = cfg.policy() if cfg.method is not None else None
    budget = "" if policy is None else f" keep={policy.keep}" if policy.keep is not None else f" max_tokens={policy.max_tokens}"
    _once(f"configured: prefill={cfg.prefill} method={cfg.method}{budget}")
    return Settings(cfg, prefill, policy)


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
    if hook.configs and tp > 1:

        def sliced(full: PatternConfig) -> PatternConfig:
            n_h = full.model["num_attention_heads"] // tp
            model = dict(full.model, num_attention_heads=n_h,
                         num_key_value_heads=max(1, full.model.get("num_key_value_heads", n_h * tp) // tp))
            return PatternConfig(model=model, layers=[row[rank * n_h:(rank + 1) * n_h] for row in full.layers],
                                 search=full.search)

        hook.configs = [sliced(c) for c in hook.configs]
        hook.config = hook.configs[0]
    return hook


def _rank_gather():
    """Under tensor parallelism, a function that gathers a tensor from every rank of the group,
    stacked in rank order along a new first dim (``PagedLayer.gather_ranks``); None with one rank."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return None
    group = get_tp_group()
    return lambda t: group.all_gather(t.unsqueeze(0).contiguous(), dim=0)


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
    sparse: bool = False
    live: torch.Tensor | None = None  # physical blocks held during the step, in order (compression on)
    kept: int = 0  # tokens the policy keeps after this step's forward (the plan)
    before: torch.Tensor | None = None  # blocks holding the stored tokens before this step's compaction
    after: torch.Tensor | None = None  # the blocks they move into (None: no compaction this step)


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
        table = cm.block_table_tensor
        new_table: torch.Tensor | None = None
        new_seq: torch.Tensor | None = None
        rows: list[RowPlan] = []
        bs = self.block_size
        for r in range(cm.num_reqs):
            q_len, s_len = qsl[r + 1] - qsl[r], int(seq[r])
            ctx = s_len - q_len
            rp = RowPlan(r, qsl[r], qsl[r + 1], ctx, int(table[r, 0]))
            rows.append(rp)
            rp.sparse = s.prefill is not None and ctx == 0 and q_len >= s.cfg.min_length
            if s.policy is None:
                continue
            if ctx == 0:
                PROCESS.requests[rp.key] = RequestState(plan.Ledger(bs))
            st = PROCESS.requests.get(rp.key)
            if st is None:  # a request that started before the plugin saw it (cannot happen) stays dense
                continue
            freed, before = st.ledger.begin_step(ctx, q_len)
            row = table[r]
            if freed:
                gone = set(freed)
                rp.before = row[before]
                rp.after = row[[i for i in before if i not in gone]]
            rp.kept = st.ledger.end_step(s.policy, ctx, q_len)
            rp.live = row[st.ledger.live]
            if st.ledger.stored != s_len:  # blocks were freed: the kernel reads the held ones only
                if new_table is None or new_seq is None:
                    new_table, new_seq = table.clone(), cm.seq_lens.clone()
                new_table[r] = 0
                new_table[r, : rp.live.numel()] = rp.live
                new_seq[r] = st.ledger.stored
                _once(f"{s.policy.name}: attention reads the kept blocks only")
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
    block (``dtype``: the model's dtype, which the op takes; the block is in the cache's own dtype,
    bytes for the fp8 kinds). Each probe writes 1 or 2 (exact in every format, fp8 included) by one
    bit of each element's token index, or of its channel index; read back, the bits give every
    stored element's token and channel. Returns, for keys and values, the stored position of
    token-major element ``t * d + j`` (:func:`plan.token_major`). The ``vec`` kernel stores keys
    channel-major and values token-major, in its float and fp8 caches alike; the op, not this
    module, decides, so other layouts are read the same way.
    """
    from vllm import _custom_ops as ops

    fmt = CacheFormat(FP8_KINDS.get(kv_cache_dtype), dtype=dtype)
    cache_dtype = torch.uint8 if fmt.quantized else dtype
    codes = {which: [torch.zeros(bs * d, dtype=torch.long) for _ in range(2)] for which in ("keys", "values")}
    for axis, n in ((0, bs), (1, d)):
        index = torch.arange(n).view((n, 1, 1) if axis == 0 else (1, 1, n))
        for bit in range(max(1, (n - 1).bit_length())):
            probe = (1 + ((index >> bit) & 1)).expand(bs, 1, d).to(dtype).contiguous()
            kv = torch.zeros(1, 1, bs, 2 * d, dtype=cache_dtype)
            kc, vc = _split(kv)
            ops.cpu_attn_reshape_and_cache(probe, probe.clone(), kc, vc, torch.arange(bs, dtype=torch.int64), isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
            for which, cache in (("keys", kc), ("values", vc)):
                got = fmt.decode(cache.reshape(-1), which).float()
                if not bool(((got == 1) | (got == 2)).all()):
                    raise KVTrimError(f"kvtrim: unknown KV cache layout of vLLM's CPU kernel (isa {isa}, kv_cache_dtype "
                                      f"{kv_cache_dtype}); compaction cannot run")
                codes[which][axis] += (got == 2).long() << bit
    out = []
    for which in ("keys", "values"):
        t, j = codes[which]
        layout = torch.full((bs * d,), -1, dtype=torch.long)
        layout[t * d + j] = torch.arange(bs * d)
        if bool((layout < 0).any()):
            raise KVTrimError(f"kvtrim: unknown KV cache layout of vLLM's CPU kernel (isa {isa}, kv_cache_dtype "
                              f"{kv_cache_dtype}); compaction cannot run")
        out.append(layout)
    return out[0], out[1]


def _layouts_of(impl, layer, kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _layouts(layer.isa, kv_cache.shape[2], kv_cache.shape[3] // 2, dtype, impl.kv_cache_dtype)


def _format_of(impl, layer, kv_cache: torch.Tensor, dtype: torch.dtype) -> CacheFormat:
    """How ``layer``'s keys and values are held (``dtype``: the model's): plain, or fp8 bytes with the
    layer's own scales, merged tokens then written by vLLM's cache-write op."""
    fp8 = FP8_KINDS.get(impl.kv_cache_dtype)
    if fp8 is None:
        if not kv_cache.is_floating_point():
            raise KVTrimError(f"kvtrim: a {kv_cache.dtype} KV cache with kv_cache_dtype {impl.kv_cache_dtype!r}; "
                              "the plugin reads float and fp8 caches only")
        return CacheFormat(dtype=dtype)
    k_scale, v_scale = float(layer._k_scale_float), float(layer._v_scale_float)
    layouts = _layouts_of(impl, layer, kv_cache, dtype)
    encode = functools.partial(_encode, layer.isa, kv_cache.shape[2], impl.kv_cache_dtype, k_scale, v_scale, layouts)
    return CacheFormat(fp8, k_scale, v_scale, dtype, encode)


def _encode(isa: str, bs: int, kv_cache_dtype: str, k_scale: float, v_scale: float,
            layouts: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor):
    """Token-major keys and values ``[H, K, D]`` as the bytes vLLM's cache-write op makes of them: written
    into scratch blocks with the layer's scales, read back token-major (the kernel's rounding, not torch's)."""
    from vllm import _custom_ops as ops

    h, k, d = keys.shape
    nb = -(-k // bs)
    kc, vc = _split(torch.zeros(nb, h, bs, 2 * d, dtype=torch.uint8))
    ops.cpu_attn_reshape_and_cache(keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous(), kc, vc,
                                   torch.arange(k, dtype=torch.int64), isa, k_scale=k_scale, v_scale=v_scale,
                                   kv_cache_dtype=kv_cache_dtype)
    blocks = torch.arange(nb)
    return read_tokens(kc, blocks, k, layouts[0]), read_tokens(vc, blocks, k, layouts[1])


class KVTrimImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        s = settings()
        md = _metadata(layer)
        if s is not None and s.policy is not None and md is not None:
            li = _layer_index(layer)
            for rp in md.kvtrim_rows:
                if rp.after is not None and rp.before is not None:
                    st = PROCESS.requests[rp.key]
                    kc, vc = _split(kv_cache)
                    st.layers[li].compact(kc, vc, rp.before, rp.after, _layouts_of(self, layer, kv_cache, key.dtype),
                                          _format_of(self, layer, kv_cache, key.dtype))
                    _once(f"{s.policy.name} compaction in use")
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

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
        if s.policy is not None:
            for rp in md.kvtrim_rows:
                if rp.live is not None:
                    self._decide(s.policy, li, rp, query, key, kv_cache, layer)
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

    def _decide(self, policy: Policy, li: int, rp: RowPlan, query, key, kv_cache, layer) -> None:
        """Run the policy's hook for one request after this layer's attention (see the module docstring)."""
        st = PROCESS.requests[rp.key]
        kc, vc = _split(kv_cache)
        n_heads = kc.shape[1]
        if li not in st.layers:
            if rp.ctx:
                raise KVTrimError(f"kvtrim: layer {li} of a running request has no state")
            st.layers[li] = PagedLayer(li, n_heads, kc.shape[2], device=kc.device)
            st.layers[li].gather_ranks = _rank_gather()
        pl = st.layers[li]
        q_len = rp.stop - rp.start
        pl.append(rp.ctx, q_len)
        live = rp.live
        assert live is not None
        layouts = _layouts_of(self, layer, kv_cache, query.dtype)
        fmt = _format_of(self, layer, kv_cache, query.dtype)
        read: dict[str, torch.Tensor] = {}

        def reader(which: str) -> torch.Tensor:
            if which not in read:
                cache, lay = (kc, layouts[0]) if which == "keys" else (vc, layouts[1])
                read[which] = fmt.decode(read_tokens(cache, live, pl.length, lay), which).unsqueeze(0)
            return read[which]

        q = query[rp.start:rp.stop].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        wants = pl.phase == "decode" and policy.wants_decode_probs(pl.view)
        if pl.phase != "decode" or wants or rp.kept < pl.length:
            # a first forward's keys are the step's own, unless the cache quantizes them: then the hook
            # scores the keys vLLM's kernel attended to, read back from the cache
            fresh = rp.ctx == 0 and not fmt.quantized
            k = key[rp.start:rp.stop].transpose(0, 1).unsqueeze(0) if fresh else reader("keys")
        else:
            # the hook neither evicts nor scores this step: it gets no keys (a tensor that fails
            # loudly if read), which spares reading every stored key from the blocks
            k = torch.empty(1, n_heads, pl.length, kc.shape[-1], device="meta")
        pl.reader = reader
        try:
            if wants:
                pl.decode_probs = window_probs(q, k, self.scale, 1)
            pl.decide(policy, q, k, self.scale, rp.kept)
        finally:
            pl.reader = None
            pl.decode_probs = None


def _metadata(layer) -> KVTrimMetadata | None:
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        md = md[0]
    if isinstance(md, dict):
        md = md.get(layer.layer_name)
    return md if isinstance(md, KVTrimMetadata) else None
