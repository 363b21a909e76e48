"""Re-rotation of cached RoPE keys, for the ``reassigned`` and ``compressed`` position policies.

A key is cached after RoPE at some position. Attention depends only on the difference between a
query's and a key's rotation, so a storage that drops tokens may move the kept keys to new
positions (``reassigned``: in-cache positions ``o .. o + K - 1``, which lets a stream run past the
model's trained context) as long as every new query is rotated consistently. These functions
compute which keys must turn and by how much; the storage (``kvtrim.storage``) owns the buffers
they write. The rotation itself is :class:`kvtrim.rope.Rotary` (checked against the model's own
RoPE code).
"""

from __future__ import annotations

import torch

from kvtrim.rope import Rotary


def rotate_incoming(rotary: Rotary | None, key_states: torch.Tensor, start: int, stream: torch.Tensor | int,
                    applied: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    """Rotate a forward's new keys ``[B, H, q, D]`` to the slots ``start .. start + q - 1``.

    ``stream``: the new tokens' stream indices (an int for one decode token); ``applied``: the
    position ids the model rotated them at (None: their stream indices). Returns the keys and the
    rotation their queries need (``q_delta``): None when none is needed, an int for a decode step
    (one shift for the key and the query, angles memoised), else ``[1, q]`` per position.
    """
    q = key_states.shape[-2]
    if q == 1:
        d = start - (int(stream) if applied is None else int(applied.reshape(-1)[-1]))
        if not d:
            return key_states, None
        assert rotary is not None  # a storage that re-rotates keys has found the model's rotary embedding
        return rotary.rotate_by(key_states, d), d
    assert isinstance(stream, torch.Tensor)
    dev = key_states.device
    applied = stream.unsqueeze(0) if applied is None else applied.reshape(-1, q)[-1:].to(dev)
    delta = torch.arange(start, start + q, device=dev).unsqueeze(0) - applied
    if not bool((delta != 0).any()):
        return key_states, None
    assert rotary is not None
    return rotary.rotate(key_states, delta.unsqueeze(1)), delta


def reassign_kept(rotary: Rotary | None, keys: torch.Tensor, rot: torch.Tensor, decoding: bool) -> int:
    """Re-rotate the ``K`` kept keys ``keys [B, H, K, D]`` (rotated at ``rot [B, H, K]``) to in-cache
    positions ``o .. o + K - 1``, in place (``keys`` and ``rot`` are views of the storage's buffers);
    returns the offset ``o``.

    After a prompt or turn ``o = 0``. While decoding, ``o`` keeps the oldest kept key's rotation,
    or the newest's where that re-rotates at most a quarter as many keys: a decode step that evicts
    a few tokens then re-rotates only the keys on one side of them (StreamingLLM: the sinks;
    Elastic Cache: the tail after its fixed point), not every kept key. Each new query is rotated by
    ``o`` as well (:func:`rotate_incoming`).
    """
    offset, first, stop, delta = reassign_plan(rot, decoding)
    if stop > first:
        assert rotary is not None  # a storage that re-rotates keys has found the model's rotary embedding
        part = slice(first, stop)
        keys[:, :, part] = rotary.rotate(keys[:, :, part], delta[:, :, part])
        rot.copy_(torch.arange(rot.shape[2], device=rot.device) + offset)
    return offset


def reassign_plan(rot: torch.Tensor, decoding: bool) -> tuple[int, int, int, torch.Tensor]:
    """What :func:`reassign_kept` does to ``K`` kept keys rotated at ``rot [B, H, K]``, without doing
    it: ``(offset, first, stop, delta)``, the keys of slots ``first:stop`` turning by ``delta [B, H, K]``
    (none when ``stop <= first``) so that slot ``i`` is rotated at ``offset + i``."""
    k = rot.shape[2]
    slots = torch.arange(k, device=rot.device)

    def span(offset: int) -> tuple[int, int, torch.Tensor]:
        """The slots whose rotation changes for this offset, as a range, and the deltas."""
        delta = (slots + offset) - rot
        per_slot = (delta != 0).reshape(-1, k).any(dim=0).to(torch.int8)
        if not bool(per_slot.any()):
            return 0, 0, delta
        return int(per_slot.argmax()), k - int(per_slot.flip(0).argmax()), delta

    offset = 0 if not decoding or not k else int(rot[0, 0, 0])
    first, stop, delta = span(offset)
    if decoding and stop > first:
        newest = int(rot[0, 0, k - 1]) - (k - 1)
        alt = span(newest)
        if 4 * (alt[1] - alt[0]) <= stop - first:
            offset, (first, stop, delta) = newest, alt
    return offset, first, stop, delta
