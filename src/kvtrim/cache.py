"""The compressing KV cache for transformers 5.x.

``KVTrimCache`` is a transformers ``Cache`` whose full-attention layers are ``CompressedLayer``
objects (``kvtrim.storage``): each physically holds only the kept tokens (the memory is freed, not
masked), per KV head. The cache owns the policy: after each layer's attention it hands the policy
the layer's read-only view and applies the decisions the policy returns (``kvtrim.decisions``).

Seen vs stored (docs/methods-spec.md): a layer counts the tokens it has *seen* (the stream index of the
next token) and the tokens it *stores*. ``get_seq_length()`` returns *seen* and
``get_mask_sizes(q)`` returns ``(stored + q, seen - stored)``, which is what transformers' mask
and position code needs for a cache that drops tokens. Each stored token carries its stream
index (``positions``); under the ``reassigned`` and ``compressed`` position policies it also
carries the position its key is rotated at (``rotations``).

Sliding-window layers of hybrid models (``config.layer_types``) keep transformers' own
``DynamicSlidingWindowLayer``: they are bounded already, and policies do not touch them.

Eviction decisions need attention scores, which only the attention function sees. The cache
hands each layer to kvtrim's registered attention function through a context variable set in
``update()``; that function calls ``KVTrimCache.after_attention`` (see ``integrations/hf.py``).
Saving and loading the contents is ``kvtrim.persistence``.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvtrim import persistence, validate
from kvtrim.decisions import Keep, as_list
from kvtrim.errors import KVTrimError
from kvtrim.lowbit_storage import LowBitLayer
from kvtrim.mixed_precision import storage_dtype
from kvtrim.ragged_storage import RaggedLayer
from kvtrim.registry import NO_COMPRESSION, create_policy, spans_error
from kvtrim.rope import Rotary, find_rotary
from kvtrim.storage import CompressedLayer

if TYPE_CHECKING:
    from kvtrim.policies.base import Policy
    from kvtrim.spans import SpanSet


class AttentionBinding(Protocol):
    """What ``ACTIVE`` holds for the attention call that runs next.

    ``attend(attend_one, query, key, value, attention_mask)`` returns the attention output and
    weights; ``attend_one(binding, query, key, value, attention_mask)`` is kvtrim's attention for
    one batch-1 cache layer (``binding`` a :class:`LayerBinding`, or None for a layer that is not
    compressed). A single cache attends once; a binding of several caches run as the rows of one
    batch (``kvtrim.integrations.batched``) calls it once per row.
    """

    def attend(self, attend_one: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None) -> tuple: ...


@dataclass
class LayerBinding:
    """One cache's layer whose attention runs next."""

    cache: "KVTrimCache"
    layer: "CompressedLayer"

    def attend(self, attend_one, query, key, value, attention_mask) -> tuple:
        return attend_one(self, query, key, value, attention_mask)


# Set by KVTrimCache.update() for the layer whose attention runs next; consumed (and cleared) by
# kvtrim's attention function. A context variable keeps concurrent generations apart.
ACTIVE: contextvars.ContextVar[AttentionBinding | None] = contextvars.ContextVar("kvtrim_active_layer", default=None)


def _layer_nbytes(layer) -> int:
    if isinstance(layer, CompressedLayer):
        return layer.nbytes()
    if getattr(layer, "keys", None) is None:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


def _position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The position ids of the forward calling ``update``: transformers hands the attention's keyword
    arguments on as ``kwargs=`` (``position_ids``); older code a ``cache_kwargs`` dict
    (``cache_position``)."""
    for extra in (kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *(a for a in args if isinstance(a, dict))):
        if isinstance(extra, dict):
            for key in ("position_ids", "cache_position"):
                if isinstance(extra.get(key), torch.Tensor):
                    return extra[key]
    return None


def _decoder_config(model):
    """The decoder config of ``model`` (a transformers model or its config), refusing anything that is
    not a decoder-only causal LM with one ``KVTrimError`` line: a module without a transformers config,
    an encoder-decoder, an encoder such as BERT (a masked LM, by transformers' architecture tables)."""
    config = getattr(model, "config", model)
    get = getattr(config, "get_text_config", None)
    what = type(model).__name__
    if not callable(get):
        raise KVTrimError(f"KVTrimCache needs a transformers causal language model (or its config), got {what}")
    text_cfg = get(decoder=True)
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
               if not isinstance(getattr(text_cfg, k, None), int)]
    if missing:
        raise KVTrimError(f"KVTrimCache needs a decoder-only causal language model; {what}'s config has no "
                          f"{', '.join(missing)}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False) or (
            getattr(text_cfg, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(text_cfg, "is_decoder", False)):
        raise KVTrimError(f"KVTrimCache needs a decoder-only causal language model; {what} (model_type "
                          f"{getattr(text_cfg, 'model_type', None)!r}) is not one")
    return text_cfg


#: the bit widths ``kv_bits`` takes (16: the model's dtype)
KV_BITS = validate.KV_BITS


def check_kv_bits(kv_bits) -> int:
    """``kv_bits`` as an int in :data:`KV_BITS`, or ``KVTrimError`` saying what is allowed."""
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, int) or kv_bits not in KV_BITS:
        raise KVTrimError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}; got {kv_bits!r}")
    return kv_bits


@functools.lru_cache(maxsize=1)
def cache_keyword() -> str:
    """The keyword ``generate``/``forward`` take a cache under: ``cache`` from transformers 5.20, else ``past_key_values``."""
    from importlib.metadata import version

    from packaging.version import Version

    return "cache" if Version(version("transformers")) >= Version("5.20") else "past_key_values"


class KVTrimCache(Cache):
    """A transformers cache that compresses itself according to a kvtrim policy.

    Args:
        model: the model (or its config) the cache is for; the model is needed for position
            re-assignment (its rotary frequencies).
        policy: a ``Policy`` instance or a registered method name (see ``kvtrim methods``).
        kv_bits: bits per stored key and value element: 16 (default) keeps them in the model's dtype;
            8, 4 or 2 quantize them (KIVI's scheme: keys per channel, values per token, the newest
            tokens in the model's dtype until a group of 32 fills; ``kvtrim.lowbit_storage``), which
            divides the resident bytes by about 2, 3.5 or 5.5 (16-bit model) at a small error in
            every attention read (docs/quantization.md). Every method runs on either storage.
        block_size: round every eviction as a paged storage with blocks of this many tokens does
            (``kvtrim.decisions.paged_kept``: whole blocks freed, the first and last kept). With
            vLLM's block size the cache keeps what kvtrim's vLLM plugin keeps, for comparing the
            two engines; None (default): evict to the exact budget.
        **policy_kwargs: passed to the policy when ``policy`` is a name (``keep``, ``max_tokens``,
            ``position`` and method parameters).

    Use it inside ``kvtrim.attach(model)`` (or ``kvtrim.compress``), which installs the attention
    function that scores and evicts; the cache refuses to run without it.
    """

    def kwargs(self) -> dict:
        """The cache as the keyword ``generate`` and ``forward`` take it: ``{"cache": self}`` from
        transformers 5.20 (which deprecates ``past_key_values``), ``{"past_key_values": self}`` before.

        Example: ``model.generate(ids, **cache.kwargs(), max_new_tokens=32)`` warns on no supported version.
        """
        return {cache_keyword(): self}

    # narrower than Cache.layers' element type: __init__ builds only these two kinds of layer
    layers: list[CompressedLayer | DynamicSlidingWindowLayer]  # type: ignore[assignment]
    prefill_stats: Callable[[], dict]  # set by kvtrim.compress(prefill=...): the sparse prefill's counters

    def __init__(self, model, policy: "Policy | str" = NO_COMPRESSION, *, spans=None, block_size: int | None = None,
                 kv_bits: int = 16, **policy_kwargs):
        if isinstance(policy, str):
            policy = create_policy(policy, **policy_kwargs)
        elif policy_kwargs:
            raise KVTrimError("pass method parameters either in the Policy object or as keywords with a name, not both")
        self.block_size = None if block_size is None else validate.integer(block_size, "block_size", minimum=1)
        self.kv_bits = check_kv_bits(kv_bits)
        text_cfg = _decoder_config(model)
        if not policy.uniform_heads and (self.kv_bits != 16 or self.block_size is not None):
            what = f"kv_bits={self.kv_bits}" if self.kv_bits != 16 else f"block_size={self.block_size}"
            raise KVTrimError(f"{policy.name}: per-head budgets (heads of different lengths) keep one buffer per KV head "
                              f"of the model's dtype, and {what} is not supported with them; use kv_bits=16 and no "
                              f"block_size, or {policy.uniform_heads_setting}")
        self.policy = policy
        self.position_policy = policy.position_policy
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.num_heads = int(text_cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // self.num_heads)
        self.max_context = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
        # a model that computes long forwards in float32 over bfloat16 weights (kvtrim.mixed_precision)
        # hands float32 keys and values then: they are stored rounded to its weights' dtype, as a decode
        # step's are. None (every other model): stored as handed.
        self.kv_dtype: torch.dtype | None = storage_dtype(model)
        # the rotary embedding (verified against the model's own RoPE code): needed by the
        # reassigned/compressed policies; under "true" kept when available for policies that
        # re-rotate keys themselves (Elastic Cache's aligned merge)
        self.rotary: Rotary | None = find_rotary(model) if isinstance(model, torch.nn.Module) else None
        if self.position_policy != "true":
            if not isinstance(model, torch.nn.Module):
                raise KVTrimError(f"position policy {self.position_policy!r} needs the model (its rotary embedding), not a config")
            if self.rotary is None:
                has_rope = any(n.endswith("rotary_emb") for n, _ in model.named_modules())
                why = ("this model's RoPE cannot be re-rotated exactly (multimodal or dynamic scaling, or a rotary "
                       "layout kvtrim does not know)") if has_rope else "kvtrim finds no rotary embedding (a rotary_emb module) in this model to re-rotate"
                raise KVTrimError(
                    f"position policy {self.position_policy!r} re-rotates cached RoPE keys, and {why}. "
                    "Use position='true'."
                )
        layer_types = getattr(text_cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        layers: list = []
        for i, lt in enumerate(layer_types):
            if lt == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=int(text_cfg.sliding_window)))
            elif lt == "full_attention" and not policy.uniform_heads:
                layers.append(RaggedLayer(self, i))  # heads of different lengths (kvtrim.ragged_storage)
            elif lt == "full_attention":
                layers.append(CompressedLayer(self, i) if self.kv_bits == 16 else LowBitLayer(self, i, self.kv_bits))
            else:
                raise KVTrimError(f"layer type {lt!r} (layer {i}) is not supported; kvtrim supports full and sliding attention layers")
        super().__init__(layers=layers)
        self._first_compressed = next((i for i, layer in enumerate(layers) if isinstance(layer, CompressedLayer)), -1)
        self._last_layer: CompressedLayer | None = None
        # Modality spans of the prompt (kvtrim.spans.SpanSet): given here, set with set_spans(), or
        # found from the prompt's token ids for vision-language models when the prefill runs.
        self.spans: SpanSet | None = None
        self._raw_spans = spans
        self._given_spans = spans  # what reset() starts from again

    @property
    def inv_freq(self) -> torch.Tensor | None:
        """The rotary inverse frequencies (None when the model's RoPE cannot be re-rotated)."""
        return None if self.rotary is None else self.rotary.inv_freq

    def set_spans(self, spans, n_tokens: int | None = None) -> None:
        """Tag prompt positions with modalities (a ``SpanSet`` or ``(start, end, modality)`` items)."""
        from kvtrim.spans import SpanSet, as_span_set

        if isinstance(spans, SpanSet) and n_tokens is None:
            self.spans, self._raw_spans = spans, None
        elif n_tokens is None:
            self._raw_spans = spans  # validated against the prompt length at prefill
        else:
            self.spans, self._raw_spans = as_span_set(spans, n_tokens), None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        last = self._last_layer
        if last is not None and last.awaiting_attention:
            raise KVTrimError(
                "KVTrimCache was used without kvtrim's attention function, so it cannot score or evict. "
                "Wrap the call in `with kvtrim.attach(model):` (or use kvtrim.compress)."
            )
        layer = self.layers[layer_idx]
        if self.kv_dtype is not None and key_states.dtype != self.kv_dtype:
            key_states, value_states = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
        if layer_idx == self._first_compressed and isinstance(layer, CompressedLayer) and layer.seen:
            self._check_whole(layer)
            if key_states.shape[-2] > 1:  # a prompt or a turn (a decode step is not checked: no device sync per token)
                self._check_continues(layer, _position_ids(args, kwargs))
        if self._raw_spans is not None and isinstance(layer, CompressedLayer) and not layer.is_initialized:
            n = layer.incoming_tokens(key_states.shape[-2])
            self.set_spans(self._raw_spans, n)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if isinstance(layer, CompressedLayer):
            self._last_layer = layer
            ACTIVE.set(LayerBinding(self, layer))
        return out

    def _check_continues(self, layer: CompressedLayer, positions: torch.Tensor | None) -> None:
        """Refuse a prompt or turn that does not continue the sequence this cache holds (before any
        layer changes): one whose positions start at 0 (a new prompt through a used cache: ``generate`` called
        again, a second ``model(...)``), or, for a model whose RoPE kvtrim knows, at a position that is
        neither the tokens seen nor the stored slots (what a ``generate`` call with another prompt
        slices out of a used cache). A forward that names no positions is not checked."""
        if positions is None or positions.numel() == 0:
            return
        first = int(positions.reshape(-1, positions.shape[-1])[0, 0])
        expected = (layer.seen, layer.length, layer.length + layer.rot_offset)
        if first == 0 or (self.rotary is not None and positions.dim() == 2 and first not in expected):
            raise KVTrimError(
                f"this KVTrimCache holds a sequence of {layer.seen} tokens, and a forward whose positions start at "
                f"{first} does not continue it (a new prompt through a used cache would see the old one): make a "
                "new cache for a new sequence (kvtrim.KVTrimCache(model, ...)), or call cache.reset() first; to "
                "continue the sequence, pass all of it (the prompt, the reply and the new turn) to generate")

    def _check_whole(self, first: CompressedLayer) -> None:
        """Refuse a forward on a cache that an earlier forward left half updated (it failed midway,
        after some layers took its tokens: a refusal raised inside the forward, an interruption)."""
        counts = [layer.seen for layer in self.layers if isinstance(layer, CompressedLayer)]
        if any(n != first.seen for n in counts):
            raise KVTrimError(
                f"this KVTrimCache was left incomplete by a forward that failed midway (its layers have seen "
                f"{min(counts)} to {max(counts)} tokens); it cannot go on: make a new cache (or session), or call "
                "cache.reset()")

    def reset(self) -> None:
        """Forget the sequence the cache holds: every layer empty (and the policy's state in it), the
        modality spans as given at construction. The cache then serves a new sequence from position 0."""
        super().reset()
        self._last_layer = None
        self.spans, self._raw_spans = None, self._given_spans
        ACTIVE.set(None)

    def after_attention(self, layer: CompressedLayer, query: torch.Tensor, key: torch.Tensor | None,
                        scaling: float) -> None:
        """Called by kvtrim's attention function once the layer's attention output is computed: the
        policy decides from the layer's view, the layers apply. ``key``: every stored key, or None for a
        layer whose heads store different numbers (the policy reads them from ``view.head(h)``)."""
        layer.awaiting_attention = False
        # the spans are known by now (given, or found for a VLM when the forward started): a span method
        # on a prompt without its targets would run as full, so it is refused
        if self.policy.needs_spans and layer.phase == "prefill" and (problem := spans_error(self.policy, self.spans)):
            raise KVTrimError(problem)
        for decision in as_list(self.policy.after_attention(layer.view, query, key, scaling)):
            target = layer
            if isinstance(decision, Keep) and decision.layer is not None:
                other = self.layers[decision.layer]
                if not isinstance(other, CompressedLayer):
                    raise KVTrimError(f"layer {decision.layer} is not a compressed layer")
                target = other
            target.apply(decision)
        layer.settle()

    # --- persistence (kvtrim.persistence) -------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every compressed layer's stored tensors, named ``layers.<i>.<name>`` (``kvtrim.persistence``)."""
        return persistence.state_dict(self)

    def state_meta(self) -> list[dict | None]:
        """Per layer, the counters and policy state that :meth:`state_dict` does not hold."""
        return persistence.state_meta(self)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: list[dict | None]) -> None:
        """Restore a :meth:`state_dict` / :meth:`state_meta` pair into this (fresh) cache of the same model."""
        persistence.load_state_dict(self, tensors, meta)
        self._last_layer = None

    # --- reporting -----------------------------------------------------------------------------
    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def seen_tokens(self) -> int:
        return self.get_seq_length()

    def stored_tokens(self) -> list[int]:
        """Stored tokens per layer and KV head (for sliding layers, what the window holds; for a layer
        whose heads store different numbers, their mean rounded up)."""
        return [
            layer.stored_per_head() if isinstance(layer, CompressedLayer)
            else (0 if layer.keys is None else layer.keys.shape[-2])
            for layer in self.layers
        ]

    def kv_bytes(self) -> int:
        """Resident bytes of all key/value buffers (allocated capacity, not just the used part)."""
        return sum(_layer_nbytes(layer) for layer in self.layers)

    def kv_bytes_stored(self) -> int:
        """Bytes of the stored keys and values only (without spare capacity)."""
        per_tok = 2 * self.num_kv_heads * self.head_dim
        total = 0
        for layer, n in zip(self.layers, self.stored_tokens()):
            if isinstance(layer, CompressedLayer):
                total += layer.stored_nbytes()
                continue
            el = layer.keys.element_size() if layer.keys is not None else 0
            total += n * per_tok * el
        return total

    def index_bytes(self) -> int:
        """Bytes of kvtrim's bookkeeping tensors (positions, rotations, policy state)."""
        return sum(layer.index_nbytes() for layer in self.compressed_layers)

    def kv_bytes_full(self) -> int:
        """What transformers' uncompressed ``DynamicCache`` would hold for the same tokens."""
        seen = self.get_seq_length()
        per_tok = 2 * self.num_kv_heads * self.head_dim
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                if not layer.is_initialized:
                    continue
                el = layer.element_size()
            elif layer.keys is None:
                continue
            else:
                el = layer.keys.element_size()
            n = min(seen, layer.sliding_window - 1) if isinstance(layer, DynamicSlidingWindowLayer) else seen
            total += n * per_tok * el
        return total
