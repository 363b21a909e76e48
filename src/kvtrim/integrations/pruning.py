"""Hidden-state pruning: later decoder layers never compute the tokens a policy dropped.

FastV and HAE's DAP decide, inside one layer's attention during the prefill, which prompt tokens
the rest of the model needs. Dropping them from the KV cache alone saves memory; dropping them
from the *hidden states* also saves the prefill compute of every later layer. This module does the
latter through PyTorch hooks that ``kvtrim.attach(model)`` installs and removes (nothing happens
on import, and every hook is removed when the ``attach`` block ends):

* a forward pre-hook on the top-level model records the forward's KV cache (and, for a
  vision-language model, finds the prompt's modality spans from its ``input_ids`` when the cache
  has none yet, see ``kvtrim.spans``); a forward hook clears that record;
* a forward pre-hook on each decoder layer, a no-op unless the cache's policy declares
  ``rewrites_forward`` (``kvtrim.policies.base.Policy``) and, asked with
  ``policy.take_hidden_state_keep(cache)``, hands over a decision made in an earlier layer of this
  forward (:func:`prune_after` applies it): the hook then keeps only the chosen tokens of the
  hidden states and slices the per-token arguments the layer loop passes to every layer
  (``attention_mask``, ``position_embeddings`` (cos, sin), ``position_ids``) the same way.

The policy never calls into this module: it states its decision, the integration applies it.

Positions stay true: the kept tokens keep the rotary angles of their original positions (the
``position_embeddings`` are sliced, not recomputed), the cache records their true stream indices,
and the cache's *seen* count still advances by the whole prompt, so the first generated token gets
position = prompt length. Models with sliding-window layers are refused (their transformers cache
layers count tokens themselves).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtrim.errors import KVTrimError

if TYPE_CHECKING:
    from kvtrim.cache import KVTrimCache


@dataclass
class _Forward:
    cache: KVTrimCache  # the cache of this forward
    n_new: int
    keep: torch.Tensor | None = None  # indices into this forward's tokens, ascending
    start_layer: int = 0
    layers_hooked: bool = True
    rewrites: bool = False  # the cache's policy may ask for hidden-state pruning
    pruned_layers: list[int] = field(default_factory=list)


NO_HOOKS = ("hidden-state pruning needs kvtrim's model hooks: run the model inside `with kvtrim.attach(model):` "
            "(or use mode='kv' to slice the KV cache instead)")

_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("kvtrim_forward", default=None)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The language model's decoder layers (``model.model.layers`` for a causal LM, the language
    model's layers for a vision-language model)."""
    cfg = model.config.get_text_config(decoder=True)
    n = int(cfg.num_hidden_layers)
    candidates = []
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        with contextlib.suppress(Exception):
            candidates.append(getattr(getter(), "layers", None))
    inner = getattr(model, "model", None)
    candidates += [getattr(inner, "layers", None), getattr(getattr(inner, "language_model", None), "layers", None)]
    for c in candidates:
        if isinstance(c, torch.nn.ModuleList) and len(c) == n:
            return c
    raise KVTrimError(f"cannot find the decoder layers of {type(model).__name__}; hidden-state pruning supports transformers causal LMs and VLMs")


def _cache_of(args, kwargs):
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _input_ids_of(args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        ids = args[0]
    return ids


def _slice_seq(x, keep: torch.Tensor, full: int, dim: int):
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[dim] == full:
        return x.index_select(dim, keep.to(x.device))
    return x


@contextlib.contextmanager
def install(model) -> Iterator[None]:
    """Install the (dormant) hooks on ``model``; removed when the block ends. Used by ``kvtrim.attach``."""
    from kvtrim.cache import KVTrimCache

    handles = []
    tokens: list = []
    try:
        layers = list(decoder_layers(model))
    except KVTrimError:
        layers = []  # unknown layout: the model runs normally, hidden-state pruning is refused

    def model_pre(mod, args, kwargs):
        cache = _cache_of(args, kwargs)
        if not isinstance(cache, KVTrimCache):
            return None
        ids = _input_ids_of(args, kwargs)
        first = cache.get_seq_length() == 0
        if first and cache.spans is None and cache._raw_spans is None and ids is not None:
            from kvtrim.spans import find_spans, is_multimodal

            if is_multimodal(model):
                cache.set_spans(find_spans(model, ids))
        n = ids.shape[-1] if ids is not None else (kwargs.get("inputs_embeds").shape[1] if kwargs.get("inputs_embeds") is not None else 0)
        rewrites = bool(cache.policy.rewrites_forward)
        tokens.append(_FORWARD.set(_Forward(cache=cache, n_new=int(n), layers_hooked=bool(layers), rewrites=rewrites)))
        return None

    def model_post(mod, args, kwargs, output):
        st = _FORWARD.get()
        if tokens:
            _FORWARD.reset(tokens.pop())
        if st is not None and st.rewrites:
            # a decision no layer hook took: the model's layers could not be hooked (unknown layout)
            # -- or it was made in the last layer, where there is nothing left to prune
            pending = st.cache.policy.take_hidden_state_keep(st.cache)
            if pending is not None and not st.layers_hooked:
                raise KVTrimError(NO_HOOKS)
        return None

    def layer_pre(idx):
        def hook(mod, args, kwargs):
            st = _FORWARD.get()
            if st is not None and st.rewrites and st.keep is None:
                pending = st.cache.policy.take_hidden_state_keep(st.cache)
                if pending is not None:
                    prune_after(st.cache, *pending)
            if st is None or st.keep is None or idx < st.start_layer:
                return None
            full, keep = st.n_new, st.keep
            if args:
                args = (_slice_seq(args[0], keep, full, 1), *args[1:])
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = _slice_seq(kwargs["hidden_states"], keep, full, 1)
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == full:
                k = keep.to(mask.device)
                mask = mask.index_select(-1, k)
                kwargs["attention_mask"] = mask.index_select(-2, k) if mask.shape[-2] == full else mask
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, tuple):
                kwargs["position_embeddings"] = tuple(_slice_seq(t, keep, full, -2) for t in pe)
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = _slice_seq(kwargs["position_ids"], keep, full, -1)
            st.pruned_layers.append(idx)
            return args, kwargs

        return hook

    try:
        handles.append(model.register_forward_pre_hook(model_pre, with_kwargs=True))
        handles.append(model.register_forward_hook(model_post, with_kwargs=True))
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(layer_pre(i), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        while tokens:
            _FORWARD.reset(tokens.pop())


def current_forward() -> _Forward | None:
    return _FORWARD.get()


def prune_after(cache, layer_idx: int, keep: torch.Tensor) -> None:
    """During a prefill, once layer ``layer_idx`` has run: layers ``> layer_idx`` compute only the
    prompt tokens ``keep`` (ascending indices into this forward's tokens).

    The cache layers after ``layer_idx`` record the kept tokens' true stream indices. Raises
    ``KVTrimError`` when the hooks are not installed (run inside ``kvtrim.attach(model)``) or the
    model has sliding-window layers.
    """
    from kvtrim.storage import CompressedLayer

    st = _FORWARD.get()
    if st is None or st.cache is not cache or not st.layers_hooked:
        raise KVTrimError(NO_HOOKS)
    if not all(isinstance(layer, CompressedLayer) for layer in cache.layers):
        raise KVTrimError("hidden-state pruning does not support models with sliding-window layers; use mode='kv'")
    if st.keep is not None:
        raise KVTrimError("hidden states were already pruned in this forward pass")
    keep = keep.flatten().to(torch.long)
    if keep.numel() == st.n_new:
        return  # nothing dropped
    if keep.numel() == 0 or int(keep[-1]) != st.n_new - 1:
        raise KVTrimError("hidden-state pruning must keep the last token of the prompt (its logits are the next token's)")
    st.keep, st.start_layer = keep, layer_idx + 1
    layers = cache.compressed_layers  # all of cache.layers (checked above)
    base = layers[layer_idx].seen - st.n_new
    for layer in layers[layer_idx + 1 :]:
        layer.expect_positions(base + keep, st.n_new)
