"""A cache's contents as named tensors plus JSON-able metadata, and back (what a session file holds).

``state_dict(cache)`` names every compressed layer's stored tensors ``layers.<i>.<name>``;
``state_meta(cache)`` lists per layer the counters, the phase, the names of the per-token policy
states and the policy's per-layer state (``None`` for a sliding-window layer, whose tokens are not
saved); ``load_state_dict(cache, tensors, meta)`` checks both against the model and rebuilds the
layers. Per layer: ``keys`` ``[B, H, stored, D]``, ``values`` ``[B, H, stored, Dv]``, ``positions``
(int64 ``[B, H, stored]``), ``rotations`` (only under the ``reassigned``/``compressed`` position
policies) and ``state.<name>`` per per-token state, each contiguous (no spare capacity).

A low-bit layer (``kvtrim.lowbit_storage.LowBitLayer``) is saved in its quantized form: ``keys`` and
``values`` hold its residual (the newest tokens, in the model's dtype), ``lowbit.<field>`` the
quantized slots before them (``kvtrim.attention.lowbit.LowBitKV``'s fields, and
``lowbit.packed_rotations`` where keys are re-rotated), and the layer's metadata says ``kv_bits``
(absent: 16). A layer loads only into a cache of the same ``kv_bits``.
``KVTrimCache.state_dict`` and friends call these; the file format around them is the session's.
"""

from __future__ import annotations

import torch

from kvtrim import validate
from kvtrim.attention.lowbit import SCALE_DTYPE, LowBitKV
from kvtrim.decisions import PHASES
from kvtrim.errors import KVTrimError
from kvtrim.lowbit_storage import LowBitLayer
from kvtrim.storage import CompressedLayer

META_KEYS = ("initialized", "seen", "length", "phase", "n_new", "token_state", "state")


def layer_state_dict(layer: CompressedLayer) -> dict[str, torch.Tensor]:
    """The stored part of one layer's tensors (empty before its first update). A layer whose KV heads
    store different numbers of tokens (per-head budgets, ``kvtrim.ragged_storage``) is refused."""
    if layer.head_lengths is not None:
        raise KVTrimError(f"layer {layer.layer_idx} keeps a different number of tokens per KV head (per-head budgets, "
                          "heads='adaptive'); saving such a cache is not supported: use heads='uniform' for sessions")
    lowbit: dict[str, torch.Tensor] = {}
    if isinstance(layer, LowBitLayer):
        if layer.lowbit is None:
            return {}
        k, v = layer.residual
        lowbit = {f"lowbit.{name}": t for name, t in layer.lowbit_state().items()}
    else:
        got_k, got_v = layer.keys, layer.values
        if got_k is None or got_v is None:
            return {}
        k, v = got_k, got_v
    out = {"keys": k.contiguous(), "values": v.contiguous(), "positions": layer.positions.contiguous(), **lowbit}
    if layer.rotated:
        out["rotations"] = layer.rotations.contiguous()
    for name in sorted(layer.token_state):
        out[f"state.{name}"] = layer.state_view(name).contiguous()
    return out


def layer_state_meta(layer: CompressedLayer) -> dict:
    """What :func:`layer_state_dict` does not hold (the policy's ``state`` as is; a caller that writes
    it as JSON checks it)."""
    meta = {"initialized": layer.is_initialized, "seen": layer.seen, "length": layer.length, "phase": layer.phase,
            "n_new": layer.n_new, "token_state": sorted(layer.token_state), "state": layer.state}
    if isinstance(layer, LowBitLayer):
        meta["kv_bits"] = layer.bits
    return meta


def layer_bits(layer: CompressedLayer) -> int:
    """The ``kv_bits`` a layer stores its keys and values in."""
    return layer.bits if isinstance(layer, LowBitLayer) else 16


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
    saved_bits, bits = meta.get("kv_bits", 16), layer_bits(layer)
    if saved_bits != bits:
        raise KVTrimError(f"{where}: saved with kv_bits={saved_bits!r}, this cache stores kv_bits={bits}: load it "
                          f"with kv_bits={saved_bits!r}")
    packed = () if bits == 16 else (*(f"lowbit.{x}" for x in LowBitKV.FIELDS), *(("lowbit.packed_rotations",) if rotated else ()))
    expected = {"keys", "values", "positions", *(("rotations",) if rotated else ()), *(f"state.{x}" for x in names),
                *packed}
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
    lowbit = _lowbit(layer, tensors, k, v, where) if isinstance(layer, LowBitLayer) else None
    n_packed = 0 if lowbit is None else lowbit[0].length
    if k.shape[2] + n_packed != n:
        raise KVTrimError(f"{where}: {k.shape[2] + n_packed} stored keys but length {n}")
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
    if isinstance(layer, LowBitLayer) and lowbit is not None:
        layer.restore_lowbit(*lowbit)


def _lowbit(layer: LowBitLayer, tensors: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            where: str) -> tuple[LowBitKV, torch.Tensor | None]:
    """The saved quantized slots of a low-bit layer, their shapes, dtypes and group ids checked
    against each other and the residual ``k``, ``v``."""
    t = {x: tensors[f"lowbit.{x}"].to(k.device) for x in LowBitKV.FIELDS}
    b, h, d, dv = k.shape[0], k.shape[1], k.shape[-1], v.shape[-1]
    per = 8 // layer.bits
    n = t["key_codes"].shape[2] if t["key_codes"].dim() == 4 else -1
    ng = t["key_scale"].shape[2] if t["key_scale"].dim() == 4 else -1
    want = {"key_codes": ((b, h, n, d // per), torch.uint8), "key_group": ((b, h, n), torch.int32),
            "key_scale": ((b, h, ng, d), SCALE_DTYPE), "key_zero": ((b, h, ng, d), SCALE_DTYPE),
            "value_codes": ((b, h, n, dv // per), torch.uint8), "value_scale": ((b, h, n), SCALE_DTYPE),
            "value_zero": ((b, h, n), SCALE_DTYPE)}
    for name, (shape, dtype) in want.items():
        if n < 0 or ng < 0 or tuple(t[name].shape) != shape or t[name].dtype != dtype:
            raise KVTrimError(f"{where}: lowbit.{name} is {t[name].dtype} {tuple(t[name].shape)}, expected {dtype} "
                              f"{shape} for {layer.bits}-bit codes")
    if n and (int(t["key_group"].min()) < 0 or int(t["key_group"].max()) >= ng):
        raise KVTrimError(f"{where}: lowbit.key_group names groups outside [0, {ng})")
    for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
        if not bool(torch.isfinite(t[name]).all()):
            raise KVTrimError(f"{where}: lowbit.{name} holds values that are not finite")
    rot = tensors.get("lowbit.packed_rotations")
    if rot is not None:
        if tuple(rot.shape) != (b, h, n) or rot.dtype != torch.long:
            raise KVTrimError(f"{where}: lowbit.packed_rotations must be int64 {(b, h, n)}")
        rot = rot.to(k.device)
    return LowBitKV(layer.bits, **t), rot


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
