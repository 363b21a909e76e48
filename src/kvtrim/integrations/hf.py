"""Hugging Face transformers integration: the only module that touches transformers' registries.

``attach(model)`` registers kvtrim's attention function (and its mask function) under the name
``"kvtrim"`` and switches the model to it; leaving the context restores the model's previous
attention implementation and unregisters the names when no model uses them any more. Nothing
happens at import.

kvtrim's attention function wraps the model's own implementation (SDPA by default): it rotates
the query when the cache re-assigned positions, computes the attention output with the base
implementation, then calls ``KVTrimCache.after_attention`` so the policy can score (from q and
k, only the rows it needs) and evict. Layers not bound to a kvtrim cache pass straight through.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvtrim.cache import ACTIVE, LOGIT_BIAS, KVTrimCache, RowBindings
from kvtrim.errors import KVTrimError
from kvtrim.rope import rotate

ATTN_NAME = "kvtrim"
_lock = threading.Lock()
_users = 0
# The base attention function each attached model wraps, keyed by id(config).
_BASE: dict[int, object] = {}
# Optional prefill attention override (sparse prefill), keyed by id(config): fn(module, q, k, v, mask, scaling, **kw)
_PREFILL: dict[int, Callable[..., Any]] = {}


def _base_fn(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def kvtrim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: base attention, then the cache's policy hook."""
    base = _BASE.get(id(module.config)) or _base_fn("sdpa")
    binding = ACTIVE.get()
    if isinstance(binding, RowBindings):  # several caches in one batch (kvtrim.eval.batched.MultiCache)
        ACTIVE.set(None)
        outs = []
        for b, (row, k, v) in enumerate(binding.rows):
            q = query[b:b + 1]
            n, m = q.shape[-2], k.shape[-2]
            mask = None if n == 1 else causal_mask(n, m, q.device)
            outs.append(_attend(base, module, row, q, k, v, mask, dropout, scaling, is_causal, kwargs)[0])
        return torch.cat(outs), None
    return _attend(base, module, binding, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)


def _attend(base, module, binding, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    layer_idx = getattr(module, "layer_idx", None)
    if binding is None or binding.layer.layer_idx != layer_idx:
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    ACTIVE.set(None)
    layer = binding.layer
    if layer.q_delta is not None:
        query = rotate(query, layer.q_delta.unsqueeze(1), binding.cache.inv_freq)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefill = _PREFILL.get(id(module.config))
    res = None
    if prefill is not None and layer.phase == "prefill" and query.shape[-2] > 1:
        res = prefill(module, query, key, value, attention_mask, scale, **kwargs)  # None: run dense
    if res is None:
        bias = layer.token_state.get(LOGIT_BIAS)
        if bias is not None:
            attention_mask = with_logit_bias(attention_mask, bias[:, :, : key.shape[-2]], query)
        res = base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    out, weights = res
    binding.cache.after_attention(layer, query, key, scale)
    return out, weights


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
def attach(model, prefill_attention=None) -> Iterator[None]:
    """Install kvtrim's attention on ``model`` for the duration of the context.

    Args:
        model: a transformers causal LM (or vision-language model).
        prefill_attention: optional sparse prefill function (used by MInference).

    Example::

        with kvtrim.attach(model):
            cache = kvtrim.KVTrimCache(model, "snapkv", keep=0.2)
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    """
    global _users
    cfg = _model_config(model)
    original = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if original == ATTN_NAME:
        raise KVTrimError("this model is already attached to kvtrim; attach each model once")
    # flash/flex kernels need other mask formats; kvtrim wraps SDPA (or eager) only.
    base = original if original in ("sdpa", "eager") else "sdpa"
    with _lock:
        if _users == 0:
            _register()
        _users += 1
    _BASE[id(cfg)] = _base_fn(base)
    if prefill_attention is not None:
        _PREFILL[id(cfg)] = prefill_attention
    try:
        model.set_attn_implementation(ATTN_NAME)
        from kvtrim.pruning import install as install_hooks

        with install_hooks(model):  # dormant unless a policy prunes hidden states (fastv, hae)
            yield
    finally:
        try:
            model.set_attn_implementation(original)
        finally:
            _BASE.pop(id(cfg), None)
            _PREFILL.pop(id(cfg), None)
            ACTIVE.set(None)
            with _lock:
                _users -= 1
                if _users == 0:
                    _unregister()


@contextlib.contextmanager
def compress(model, method: str = "snapkv", prefill=None, **policy_kwargs) -> Iterator[KVTrimCache]:
    """One line for transformers users: attach kvtrim and get a compressing cache.

    Example::

        with kvtrim.compress(model, "snapkv", keep=0.2) as cache:
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

    ``prefill`` adds MInference sparse prefill: a mode name (``"minference"`` uses the pattern
    config shipped for the model; ``"a_shape"``, ``"vertical_slash"``, ``"block_sparse"`` one
    pattern for every head) or a :class:`kvtrim.attention.prefill.SparsePrefill`. Its ``stats()``
    is then available as ``cache.prefill_stats()``.

    The cache serves one sequence; make another with ``kvtrim.KVTrimCache(model, ...)`` inside
    the same context for the next one.
    """
    cache = KVTrimCache(model, method, **policy_kwargs)
    if isinstance(prefill, str):
        from kvtrim.attention.prefill import make_prefill

        prefill = make_prefill(model, prefill)
    if prefill is not None:
        cache.prefill_stats = prefill.stats
    with attach(model, prefill_attention=prefill):
        yield cache


@functools.lru_cache(maxsize=1)
def cache_kwarg() -> str:
    """The keyword ``generate``/``forward`` take the cache under: ``cache`` from transformers 5.20, else ``past_key_values``."""
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.20") else "past_key_values"
