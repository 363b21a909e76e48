"""A cache's contents as named tensors plus JSON-able metadata, and back (what a session file holds).

``state_dict(cache)`` names every compressed layer's stored tensors ``layers.<i>.<name>``;
``state_meta(cache)`` lists per layer the counters, the phase, the names of the per-token policy
states and the policy's per-layer state (``None`` for a sliding-window layer, whose tokens are not
saved); ``load_state_dict(cache, tensors, meta)`` checks both against the model and rebuilds the
layers. Per layer: ``keys`` ``[B, H, stored, D]``, ``values`` ``[B, H, stored, Dv]``, ``positions``
(int64 ``[B, H, stored]``), ``rotations`` (only under the ``reassigned``/``compressed`` position
policies) and ``state.<name>`` per per-token state, each contiguous (no spare capacity).
``KVTrimCache.state_dict`` and friends call these; the file format around them is the session's.
"""

from __future__ import annotations

import torch

from kvtrim import validate
from kvtrim.decisions import PHASES
from kvtrim.errors import KVTrimError
from kvtrim.storage import CompressedLayer

META_KEYS = ("initialized", "seen", "length", "phase", "n_new", "token_state", "state")


def layer_state_dict(layer: CompressedLayer) -> dict[str, torch.Tensor]:
    """The stored part of one layer's tensors (empty before its first update)."""
    k, v = layer.keys, layer.values
    if k is None or v is None:
        return {}
    out = {"keys": k.contiguous(), "values": v.contiguous(), "positions": layer.positions.contiguous()}
    if layer.rotated:
        out["rotations"] = layer.rotations.contiguous()
    for name in sorted(layer.token_state):
        out[f"state.{name}"] = layer.state_view(name).contiguous()
    return out


def layer_state_meta(layer: CompressedLayer) -> dict:
    """What :func:`layer_state_dict` does not hold (the policy's ``state`` as is; a caller that writes
    it as JSON checks it)."""
    return {"initialized": layer.is_initialized, "seen": layer.seen, "length": layer.length, "phase": layer.phase,
            "n_new": layer.n_new, "token_state": sorted(layer.token_state), "state": layer.state}


def load_layer_state(layer: CompressedLayer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Replace one layer's contents with a :func:`layer_state_dict` / :func:`layer_state_meta` pair.

    Raises ``KVTrimError`` (and leaves the layer reset) for missing or unexpected entries, shapes that
    disagree with each other, with ``meta["length"]`` or with the cache's KV heads, or counters that
    do not fit (``length <= seen``, every stream index ``< seen``).
    """
    where = f"layer {layer.layer_idx}"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise KVTrimError(f"{where}: saved layer state lacks {', '.join(missing)}")
    layer.reset()
    try:
        _load(layer, tensors, meta, where)
    except BaseException:
        layer.reset()
        raise


def _load(layer: CompressedLayer, tensors: dict[str, torch.Tensor], meta: dict, where: str) -> None:
    seen = validate.integer(meta["seen"], f"{where}: seen", minimum=0)
    n = validate.integer(meta["length"], f"{where}: length", minimum=0, maximum=seen)
    n_new = validate.integer(meta["n_new"], f"{where}: n_new", minimum=0)
    phase = validate.choice(meta["phase"], f"{where}: phase", PHASES)
    if not isinstance(meta["state"], dict):
        raise KVTrimError(f"{where}: the policy state must be a dict, got {type(meta['state']).__name__}")
    names = list(meta["token_state"])
    rotated = layer.rotated
    expected = {"keys", "values", "positions", *(("rotations",) if rotated else ()), *(f"state.{x}" for x in names)}
    if not meta["initialized"]:
        expected = set()
        if n or names:
            raise KVTrimError(f"{where}: an uninitialised layer cannot store {n} tokens or token states {names}")
    if set(tensors) != expected:
        lacking, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise KVTrimError(
            f"{where}: saved tensors do not match the layer (position policy {layer.cache.position_policy!r}, "
            f"token states {names}): missing {lacking}, unexpected {extra}"
        )
    if not meta["initialized"]:
        layer.seen, layer.phase, layer.n_new, layer.state = seen, phase, n_new, dict(meta["state"])
        return
    k, v = tensors["keys"], tensors["values"]
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise KVTrimError(f"{where}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be [batch, kv_heads, stored, dim]")
    b, h = k.shape[:2]
    if k.shape[2] != n:
        raise KVTrimError(f"{where}: {k.shape[2]} stored keys but length {n}")
    if h != layer.cache.num_kv_heads:
        raise KVTrimError(f"{where}: {h} KV heads saved, the model has {layer.cache.num_kv_heads}")
    dev = k.device
    index = {name: tensors[name].to(dev) for name in ("positions", "rotations") if name in tensors}
    states = {x: tensors[f"state.{x}"].to(dev) for x in names}
    for name, t in [*index.items(), *((f"state.{x}", t) for x, t in states.items())]:
        if tuple(t.shape) != (b, h, n):
            raise KVTrimError(f"{where}: {name} has shape {tuple(t.shape)}, expected {(b, h, n)}")
    for name, t in index.items():
        if t.dtype != torch.long:
            raise KVTrimError(f"{where}: {name} must be int64, got {t.dtype}")
    pos = index["positions"]
    if n and (int(pos.min()) < 0 or int(pos.max()) >= seen):
        raise KVTrimError(f"{where}: stream indices must lie in [0, {seen}) (tokens seen)")
    layer.restore(k, v, pos, index.get("rotations") if rotated else None, states, seen=seen, phase=phase,
                  n_new=n_new, state=dict(meta["state"]))


def state_dict(cache) -> dict[str, torch.Tensor]:
    """Every compressed layer's :func:`layer_state_dict`, keys prefixed ``layers.<i>.``.

    Raises ``KVTrimError`` when a sliding-window layer (transformers' own) holds tokens: those are
    not saved.
    """
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            out.update({f"layers.{i}.{k}": t for k, t in layer_state_dict(layer).items()})
        elif getattr(layer, "keys", None) is not None:
            raise KVTrimError("saving a cache whose model has sliding-window layers is not supported")
    return out


def state_meta(cache) -> list[dict | None]:
    """Per layer, :func:`layer_state_meta` (``None`` for a sliding-window layer)."""
    return [layer_state_meta(layer) if isinstance(layer, CompressedLayer) else None for layer in cache.layers]


def load_state_dict(cache, tensors: dict[str, torch.Tensor], meta: list[dict | None]) -> None:
    """Restore a :func:`state_dict` / :func:`state_meta` pair into a fresh cache of the same model."""
    if len(meta) != len(cache.layers):
        raise KVTrimError(f"saved state has {len(meta)} layers, the model has {len(cache.layers)}")
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        head, _, rest = key.partition(".")
        idx, _, name = rest.partition(".")
        if head != "layers" or not idx.isdigit() or not name or int(idx) >= len(cache.layers):
            raise KVTrimError(f"unexpected tensor {key!r} in the saved cache (expected layers.<i>.<name>)")
        per_layer.setdefault(int(idx), {})[name] = t
    for i, (layer, m) in enumerate(zip(cache.layers, meta)):
        if (m is None) == isinstance(layer, CompressedLayer):
            raise KVTrimError(f"layer {i}: the saved state and the model disagree on whether this layer is compressed "
                              "(sliding-window layers are not)")
        if isinstance(layer, CompressedLayer) and m is not None:
            load_layer_state(layer, per_layer.get(i, {}), m)
        elif i in per_layer:
            raise KVTrimError(f"layer {i}: tensors saved for a sliding-window layer")
