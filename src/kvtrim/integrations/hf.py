"""Hugging Face transformers integration: the only module that touches transformers' registries.

``attach(model)`` registers kvtrim's attention function (and its mask function) under the name
``"kvtrim"`` and switches the model to it; leaving the context restores the model's previous
attention implementation and unregisters the names when no model uses them any more. Nothing
happens at import.

kvtrim's attention function wraps the model's own implementation (SDPA by default): it rotates
the query when the cache re-assigned positions, computes the attention output with the base
implementation, then calls ``KVTrimCache.after_attention`` so the policy can score (from q and
k, only the rows it needs) and evict. Layers not bound to a kvtrim cache pass straight through.
The cache publishes what the next attention call is bound to (``kvtrim.cache.AttentionBinding``)
and the function hands that binding its attention for one cache layer (``binding.attend``): a
binding decides how often to call it (once for one cache; once per row for the batched rows of
``kvtrim.integrations.batched``), so this module needs to know nothing about batching.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvtrim import validate
from kvtrim.attention.fused import causal_attention_scores, fused_backend
from kvtrim.cache import ACTIVE, KVTrimCache
from kvtrim.decisions import LOGIT_BIAS
from kvtrim.errors import KVTrimError
from kvtrim.registry import DEFAULT_METHOD
from kvtrim.scores import PromptScores, decode_attention

logger = logging.getLogger(__name__)

ATTN_NAME = "kvtrim"
_lock = threading.Lock()
_users = 0


@dataclass(frozen=True)
class Attachment:
    """One model attached to kvtrim (:func:`attach`): its config (the one object its attention
    modules share), the base attention kvtrim wraps ("sdpa" or "eager"), the optional sparse prefill
    ``fn(module, q, k, v, mask, scaling, **kw)`` and the ``fused_scores`` choice."""

    config: Any
    base: str
    prefill: Callable[..., Any] | None
    fused: str


# The models attached now, found by the identity of their config (held while attached, so a config
# that is gone can never be mistaken for a new one); a model is attached once at a time.
_ATTACHED: list[Attachment] = []


def attachment(config) -> Attachment | None:
    """The :class:`Attachment` of the model whose config is ``config``, or None."""
    return next((a for a in _ATTACHED if a.config is config), None)
#: ``attach(fused_scores=...)``: when a prefill's attention also computes the policy's scores
FUSED_SCORES = ("auto", "always", "never")


def _base_fn(name: str, module=None):
    """The attention function kvtrim wraps for ``module``: SDPA, or the model's own eager function
    (its modeling module's ``eager_attention_forward``: Gemma2's soft-capping, for one, lives there)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) if module is not None else None
        if own is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as own
        return functools.partial(_eager, own)
    return ALL_ATTENTION_FUNCTIONS[name]


def _eager(fn, module, query, key, value, attention_mask, **kwargs):
    """Run an eager attention function on the boolean (or absent) mask that kvtrim's SDPA-style mask
    function produces: eager code adds the mask to the scores, so it needs an additive float mask."""
    n, m = query.shape[-2], key.shape[-2]
    if attention_mask is None and n > 1:
        attention_mask = causal_mask(n, m, query.device)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min)
    return fn(module, query, key, value, attention_mask, **kwargs)


def kvtrim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: base attention, then the cache's policy hook, for every
    cache layer the published binding names."""
    att = attachment(module.config)
    name = att.base if att is not None else "sdpa"
    base = _base_fn(name, module) if name == "eager" else _base_fn(name)
    binding = ACTIVE.get()

    def attend_one(one, q, k, v, mask):
        return _attend(base, att, module, one, q, k, v, mask, dropout, scaling, is_causal, kwargs)

    if binding is None:
        return attend_one(None, query, key, value, attention_mask)
    return binding.attend(attend_one, query, key, value, attention_mask)


def _attend(base, att: Attachment | None, module, binding, query, key, value, attention_mask, dropout, scaling,
            is_causal, kwargs):
    layer_idx = getattr(module, "layer_idx", None)
    if key.dtype != query.dtype and query.dtype == torch.float32:
        # a float32 forward of a bfloat16-stored model (kvtrim.mixed_precision): the cache handed back
        # its stored keys and values, rounded to bfloat16; the attention runs in float32 on them
        key, value = key.float(), value.float()
    if binding is None or binding.layer.layer_idx != layer_idx:
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    ACTIVE.set(None)
    layer = binding.layer
    if (delta := layer.q_delta) is not None:
        rotary = binding.cache.rotary
        if isinstance(delta, int) or delta.numel() == 1:
            query = rotary.rotate_by(query, int(delta))
        else:
            query = rotary.rotate(query, delta.unsqueeze(1))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefill = att.prefill if att is not None else None
    base_name = att.base if att is not None else "sdpa"
    if layer.head_lengths is not None:
        return _attend_heads(binding, layer, query, attention_mask, dropout, scale, base_name, kwargs)
    fused = att.fused if att is not None else "never"
    res = None
    if prefill is not None and layer.phase == "prefill" and query.shape[-2] > 1:
        res = prefill(module, query, key, value, attention_mask, scale, **kwargs)  # None: run dense
    bias = layer.token_state.get(LOGIT_BIAS)
    # a call kvtrim's own decode attention computes as SDPA would (no mask, soft-capping or eager attention)
    sdpa_call = (attention_mask is None and not dropout and base_name == "sdpa"
                 and not any(kwargs.get(a) is not None for a in ("sliding_window", "softcap", "s_aux")))
    if layer.phase == "decode" and layer.n_new == 1:
        # a storage that handed the model only part of its tokens (a low-bit layer: the residual,
        # LowBitLayer.attention_inputs) computes the step itself over its stored form, with the
        # probabilities for the policy's hook; a call it does not compute (a mask, soft-capping,
        # eager attention) gets every key and value (attention_kv; for the plain storage, as handed)
        got = None
        if res is None and sdpa_call:
            got = layer.stored_attention(query, scale, None if bias is None else bias[:, :, : layer.length])
        if got is not None:
            res = (got[0], None)
            layer.decode_probs = got[1]
        else:
            key, value = layer.attention_kv(key, value)
    if res is None and attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = layer_mask(attention_mask, query.shape[-2], key.shape[-2])
    if (res is None and sdpa_call and bias is None and query.shape[-2] == 1 and layer.phase == "decode"
            and ((wants := binding.cache.policy.wants_decode_probs(layer.view))
                 or (query.device.type == "cpu" and (query.dtype != torch.float32 or CPU_DECODE_FP32)
                     and key.shape[-2] >= CPU_DECODE_MIN_KEYS
                     and cpu_decode_attention()))):
        # One decode query over every stored key. When the policy scores this step from its
        # attention, the probabilities are computed here and handed over instead of running SDPA
        # and recomputing q @ K in the policy. On CPU, bfloat16 and float16 steps over at least
        # CPU_DECODE_MIN_KEYS stored keys go this way too: two grouped float32 products
        # (kvtrim.scores.decode_attention) cost a fraction of PyTorch's CPU SDPA for one query row
        # with grouped KV heads. Float32 steps keep SDPA (unless CPU_DECODE_FP32), as fast or faster
        # there; shorter caches and GPUs keep SDPA's kernels (measurements: docs/dtypes.md, "Decode
        # attention on CPU").
        out, probs = decode_attention(query, key, value, scale)
        res = (out, None)
        if wants:
            layer.decode_probs = probs
    if res is None and bias is None and layer.phase != "decode" and fused != "never":
        res = _fused_prefill(base_name, fused, binding, layer, query, key, value, attention_mask, dropout, scale, kwargs)
    if res is None:
        if bias is not None:
            attention_mask = with_logit_bias(attention_mask, bias[:, :, : key.shape[-2]], query)
        res = base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    _decide(binding, layer, query, key, scale)
    return res


def _attend_heads(binding, layer, query, attention_mask, dropout, scale, base_name, kwargs):
    """A forward over a layer whose KV heads store different numbers of tokens (per-head budgets,
    ``kvtrim.ragged_storage``): the storage's per-head attention, then the policy's hook (which reads
    the heads from its view: no rectangular key is handed over). Only what SDPA computes with a causal
    mask is supported; anything else is refused with one line."""
    n = query.shape[-2]
    if dropout or base_name != "sdpa" or any(kwargs.get(a) is not None for a in ("sliding_window", "softcap", "s_aux")):
        raise KVTrimError("per-head budgets (heads='adaptive') compute attention head by head with SDPA: eager "
                          "attention, dropout, soft-capping, sliding windows and attention sinks are not supported")
    if attention_mask is not None and not (attention_mask.dtype == torch.bool
                                           and _bottom_right_causal(attention_mask, n, attention_mask.shape[-1])):
        raise KVTrimError("per-head budgets (heads='adaptive') take a causal mask only: a padding mask cannot be "
                          "carried over to heads of other lengths")
    out = layer.attend(query, scale)
    _decide(binding, layer, query, None, scale)
    return out, None


def _decide(binding, layer, query, key, scale) -> None:
    """After a layer's attention: the policy decides and the storage applies
    (``KVTrimCache.after_attention``); the scores handed to the hook are dropped either way."""
    try:
        binding.cache.after_attention(layer, query, key, scale)
    finally:
        layer.decode_probs = None
        layer.attention_scores = None


#: whether float32 CPU decode steps take kvtrim's decode attention too (not by default: measured
#: slower than SDPA below 32k keys on SmolLM2, faster on Qwen2.5-Coder-0.5B-Instruct; bench_decode_attention.py)
CPU_DECODE_FP32 = False
#: the fewest stored keys at which it does (below, SDPA is faster: results/decode_attention/epyc_short.json)
CPU_DECODE_MIN_KEYS = 256


def cpu_decode_attention() -> bool:
    """Whether a CPU decode step of a method that reads no decode probabilities runs kvtrim's grouped
    decode attention (``KVTRIM_DECODE_ATTENTION``: ``auto``, the default, or ``sdpa`` for the model's
    SDPA; methods that score the step from its probabilities take them from kvtrim's decode attention
    either way, as before)."""
    value = os.environ.get("KVTRIM_DECODE_ATTENTION", "auto").strip().lower() or "auto"
    if value not in ("auto", "sdpa"):
        raise KVTrimError(f"KVTRIM_DECODE_ATTENTION={value!r}: use 'auto' (kvtrim's decode attention on CPU) or 'sdpa'")
    return value == "auto"


def _fused_prefill(base_name, fused, binding, layer, query, key, value, attention_mask, dropout, scale, kwargs):
    """The prefill attention computed together with the scores the policy asked for
    (``Policy.wants_prefill_scores``; ``kvtrim.attention.fused``), which are left in
    ``layer.attention_scores`` for its hook; None (run the model's attention) when the policy asks
    for nothing or the call is not a plain causal one that the fused kernel computes exactly."""
    n, m = query.shape[-2], key.shape[-2]
    if (n <= 1 or dropout or base_name != "sdpa"
            or any(kwargs.get(a) is not None for a in ("sliding_window", "softcap", "s_aux"))):
        return None  # sliding windows, soft-capping, sinks: the model's own attention
    want = binding.cache.policy.wants_prefill_scores(layer.view)
    if want is None or not (want.column_sums or want.column_max or (want.window > 0 and fused == "always")):
        return None  # "auto": last-window rows alone are cheaper recomputed (window x T) than fused
    if not (attention_mask is None and n == m) and not _bottom_right_causal(attention_mask, n, m):
        return None  # padding, or a mask the kernel does not compute: the model's own attention
    if (backend := fused_backend(query)) is None:
        return None
    res = causal_attention_scores(query, key, value, scale, column_sums=want.column_sums, window=want.window,
                                  column_max=want.column_max, backend=backend)
    n_kv = key.shape[1]

    def grouped(x):
        return x.unflatten(1, (n_kv, -1)) if x is not None else None

    layer.attention_scores = PromptScores(grouped(res.col_sums), grouped(res.window_probs), grouped(res.col_max))
    return res.out, None


# the last mask checked by _bottom_right_causal and its verdict: a forward hands the same mask
# tensor to every layer, so it is compared once per forward, not once per layer
_CHECKED: list = [None, False]


def _bottom_right_causal(mask: torch.Tensor | None, n: int, m: int) -> bool:
    """True when ``mask`` (boolean, ``[B, 1 | Hq, n, m]``) lets every row's query ``i`` see exactly the
    keys ``<= m - n + i``: what a later chunk of a prompt (or a later turn) gets from transformers
    over a cache without padding, and what the fused kernel computes."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (n, m):
        return False
    ref, verdict = _CHECKED
    if ref is not None and ref() is mask:
        return verdict
    verdict = bool(torch.equal(mask, causal_mask(n, m, mask.device).expand(mask.shape)))
    _CHECKED[:] = [weakref.ref(mask), verdict]
    return verdict


def layer_mask(mask: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The mask of a layer that stores another number of tokens than the first one (per-layer budgets,
    ``kvtrim.policies.layer_budgets``): transformers builds one mask per forward from the first full
    layer's sizes (``get_mask_sizes``), ``[B, 1 | Hq, n, m']`` for ``m'`` keys. A cache holds one
    sequence, so that mask is bottom-right causal, and this layer's is the same for its ``m`` keys;
    any other mask (padding) cannot be carried over and is refused."""
    if mask.dtype == torch.bool and _bottom_right_causal(mask, n, mask.shape[-1]):
        return causal_mask(n, m, mask.device).expand(*mask.shape[:2], n, m)
    raise KVTrimError(
        f"this layer stores {m - n} tokens and the forward's attention mask was made for {mask.shape[-1] - n}; a mask "
        "that is not causal (padding) cannot be carried over to a layer of another length: use per-layer budgets "
        "without a padding mask (layers='uniform' otherwise)")


def causal_mask(n: int, m: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[1, 1, n, m]`` (True = may attend) for ``n`` queries that are
    the last ``n`` of ``m`` keys."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)[None, None]


def with_logit_bias(mask, bias: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Additive float mask ``[B, Hq, q, S]``: ``mask`` (None = bottom-right causal, bool or float)
    plus the per-key logit ``bias [B, Hkv, S]``, each KV head's bias shared by its query heads."""
    n, s = query.shape[-2], bias.shape[-1]
    dtype = query.dtype
    if mask is None:
        mask = causal_mask(n, s, query.device)
    if mask.dtype == torch.bool:
        mask = mask[..., :s]
        add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        add = mask[..., :s].to(dtype)
    b = bias.to(dtype).repeat_interleave(query.shape[1] // bias.shape[1], dim=1).unsqueeze(2)  # [B, Hq, 1, S]
    return add + b


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvtrim_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    assert ATTN_NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def _unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(ATTN_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_NAME, None)


def _model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None or not isinstance(model, torch.nn.Module):
        raise KVTrimError(f"expected a transformers model, got {type(model).__name__}")
    return cfg


@contextlib.contextmanager
def attach(model, prefill_attention=None, fused_scores: str = "auto") -> Iterator[None]:
    """Install kvtrim's attention on ``model`` for the duration of the context.

    Args:
        model: a transformers causal LM (or vision-language model).
        prefill_attention: optional sparse prefill function (used by MInference).
        fused_scores: whether the prefill attention also computes the scores the cache's policy
            reads from it (``Policy.wants_prefill_scores``; ``kvtrim.attention.fused``: kvtrim's
            native kernel on CPU, Triton on CUDA), instead of the model's SDPA followed by a
            second ``q @ K`` pass in the policy. The output is the same within SDPA's rounding,
            the scores within float32 rounding. ``"auto"`` (default): when the policy asks for
            per-key column sums over all queries (H2O, Elastic Cache), whose recomputation costs
            about as much as the attention; a request for the last-window rows only (SnapKV,
            Inf-MLLM, Elastic Cache's ``query`` importance) keeps SDPA, because recomputing
            ``window x T`` scores costs less than the fused kernel's margin over SDPA (measured in
            ``benchmarks/bench_fused_scoring.py``). ``"always"``: every request. ``"never"``: SDPA
            plus recomputation, kvtrim's behaviour before fused scoring.

    Example::

        with kvtrim.attach(model):
            cache = kvtrim.KVTrimCache(model, "snapkv", keep=0.2)
            out = model.generate(**inputs, **cache.kwargs(), max_new_tokens=64)
    """
    global _users
    cfg = _model_config(model)
    validate.choice(fused_scores, "attach: fused_scores", FUSED_SCORES)
    original = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if original == ATTN_NAME:
        raise KVTrimError("this model is already attached to kvtrim; attach each model once")
    # flash/flex kernels need other mask formats; kvtrim wraps SDPA (or eager) only, and says so.
    base = original if original in ("sdpa", "eager") else "sdpa"
    if base != original:
        logger.warning("kvtrim computes attention with SDPA while attached (the model asked for %r, whose mask "
                       "format kvtrim's cache does not produce); results are the same within rounding", original)
    with _lock:
        if _users == 0:
            _register()
        _users += 1
    att = Attachment(cfg, base, prefill_attention, fused_scores)
    _ATTACHED.append(att)
    try:
        model.set_attn_implementation(ATTN_NAME)
        from kvtrim.integrations.pruning import install as install_hooks

        with install_hooks(model):  # dormant unless a policy prunes hidden states (fastv, hae)
            yield
    finally:
        try:
            model.set_attn_implementation(original)
        finally:
            _ATTACHED.remove(att)
            ACTIVE.set(None)
            with _lock:
                _users -= 1
                if _users == 0:
                    _unregister()


@contextlib.contextmanager
def compress(model, method: str = DEFAULT_METHOD, prefill=None, **policy_kwargs) -> Iterator[KVTrimCache]:
    """One line for transformers users: attach kvtrim and get a compressing cache.

    Example::

        with kvtrim.compress(model, "snapkv", keep=0.2) as cache:
            out = model.generate(**inputs, **cache.kwargs(), max_new_tokens=64)

    ``prefill`` adds MInference sparse prefill: a mode name (``"minference"`` uses the pattern
    config shipped for the model; ``"a_shape"``, ``"vertical_slash"``, ``"block_sparse"`` one
    pattern for every head) or a :class:`kvtrim.integrations.prefill.SparsePrefill`. Its ``stats()``
    is then available as ``cache.prefill_stats()``.

    The cache serves one sequence; make another with ``kvtrim.KVTrimCache(model, ...)`` inside
    the same context for the next one.
    """
    cache = KVTrimCache(model, method, **policy_kwargs)
    if cache.policy.needs_reconstruction:
        raise KVTrimError(f"method {cache.policy.name!r} scores the prompt by a second forward that reconstructs it, "
                          "which model.generate does not run; use kvtrim.generate_ids (kvtrim generate)")
    if isinstance(prefill, str):
        from kvtrim.integrations.prefill import make_prefill

        prefill = make_prefill(model, prefill)
    if prefill is not None:
        cache.prefill_stats = prefill.stats
    with attach(model, prefill_attention=prefill):
        yield cache
