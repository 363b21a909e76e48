"""Batch > 1: many kvtrim caches decoded in lock step as the rows of one batch.

A ``KVTrimCache`` serves one sequence: token-level eviction keeps a different token set per
sequence, which transformers' padding masks cannot express. This module runs several of them
together anyway: one forward pass carries one row per cache, the linear layers read their weights
once for all rows, and only attention runs per row, each row against its own cache (which keeps
its own policy, positions and evictions, exactly as at batch 1). At batch 1 a small model's decode
step is bound by reading the weights, so B rows cost little more than one. Results equal batch-1
decoding up to the floating-point rounding of the batched matmuls.

Layouts: a forward of ``B`` rows feeds ``input_ids [B, n]`` (every row the same number ``n`` of
new tokens) with explicit ``position_ids [B, n]`` (each row's own next positions,
``kvtrim.decoding.explicit_positions``). Inside each attention layer the rows' keys and values
have each row's own stored length, ``[1, kv_heads, stored_b + n, head_dim]``; the attention output
is concatenated back to ``[B, heads, n, head_dim]``. Logits come back per row: ``[vocab]`` for the
last position, or ``[n, vocab]`` for every fed position.

Three levels, all inside ``kvtrim.attach(model)``:

* :class:`MultiCache` -- the transformers cache whose batch rows are batch-1 ``KVTrimCache``
  objects; pass it to the model's forward yourself;
* :func:`step_rows` -- feed one list of ids per cache in one forward, get each row's logits;
* :func:`drive` -- run many decoding *programs* of :mod:`kvtrim.decoding` (generators that
  ``yield Step(cache, ids)``; ``decode``, ``prefill``, ``teacher_forced_nll`` or your own),
  batching every round's steps that feed the same number of tokens. A program may also
  ``yield Wait(key)`` to receive another program's result once it has finished.

Example::

    from kvtrim import decoding
    from kvtrim.integrations.batched import drive

    with kvtrim.attach(model):
        caches = {k: kvtrim.KVTrimCache(model, "snapkv", keep=k) for k in (0.1, 0.25, 0.5)}
        firsts = {k: decoding.run(model, decoding.prefill(c, prompt_ids)) for k, c in caches.items()}
        out = drive(model, {k: decoding.decode(c, firsts[k], 32) for k, c in caches.items()})
        # out[k] == (token ids, forward steps) for each budget, decoded together

Methods that change the forward pass itself (``Policy.rewrites_forward``: hidden-state pruning)
cannot share a forward with other rows and are refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvtrim.cache import ACTIVE, KVTrimCache, LayerBinding
from kvtrim.decoding import Program, Step, Wait, explicit_positions, forward
from kvtrim.errors import KVTrimError
from kvtrim.policies.base import Policy

__all__ = ["MultiCache", "drive", "step_rows"]


@dataclass
class RowBindings:
    """The attention binding of several batch-1 caches run as the rows of one batch: per row, the
    row's layer binding (None for a layer its cache does not compress) and the row's keys and
    values ``[1, kv_heads, stored_b + n, head_dim]``."""

    rows: list[tuple[LayerBinding | None, torch.Tensor, torch.Tensor]]

    def attend(self, attend_one, query, key, value, attention_mask) -> tuple:
        """Attend row by row, each row with its own keys, values and a bottom-right causal mask
        (transformers' batch mask describes the first row only); returns ``(output, None)``."""
        from kvtrim.integrations.hf import causal_mask

        ACTIVE.set(None)
        outs = []
        for b, (row, k, v) in enumerate(self.rows):
            q = query[b:b + 1]
            n, m = q.shape[-2], k.shape[-2]
            mask = None if n == 1 else causal_mask(n, m, q.device)
            outs.append(attend_one(row, q, k, v, mask)[0])
        return torch.cat(outs), None


class MultiCache(Cache):
    """A transformers cache whose batch rows are separate batch-1 ``KVTrimCache`` objects.

    transformers' mask and position helpers see the first row's layers (kvtrim's attention
    function ignores that mask and builds each row's own); ``update`` hands each row's new keys
    and values to its cache and publishes every row's binding for the attention function. Pass
    explicit ``position_ids [B, n]`` with each forward (:func:`step_rows` does).
    """

    def __init__(self, caches: list[KVTrimCache]):
        if not caches:
            raise KVTrimError("MultiCache needs at least one cache")
        for c in caches:
            policy = c.policy
            if isinstance(policy, Policy) and policy.rewrites_forward:
                raise KVTrimError(
                    f"method {policy.name!r} changes the forward pass (hidden-state pruning), so its cache "
                    "cannot share a batch with others; run it at batch 1"
                )
        super().__init__(layers=list(caches[0].layers))
        self.caches = caches

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.caches):
            raise KVTrimError(f"MultiCache holds {len(self.caches)} caches but the batch has {key_states.shape[0]} rows")
        extra = kwargs.get("kwargs") or {}
        pos = extra.get("position_ids") if isinstance(extra, dict) else None
        rows = []
        for b, cache in enumerate(self.caches):
            kw = dict(extra) if isinstance(extra, dict) else {}
            if pos is not None:
                kw["position_ids"] = pos[b:b + 1]
            k, v = cache.update(key_states[b:b + 1], value_states[b:b + 1], layer_idx, kwargs=kw)
            binding = ACTIVE.get()
            rows.append((binding if isinstance(binding, LayerBinding) else None, k, v))
            ACTIVE.set(None)
        ACTIVE.set(RowBindings(rows))
        return key_states, value_states


@torch.inference_mode()
def step_rows(model, caches: list[KVTrimCache], feeds: list[list[int]], all_logits: bool = False) -> list[torch.Tensor]:
    """Feed ``feeds[b]`` through ``caches[b]`` for every row in one forward pass (inside ``attach``).

    All feeds must have the same length ``n``. Returns per row float32 logits: ``[vocab]`` of the
    last position, or with ``all_logits`` ``[n, vocab]`` of every fed position.
    """
    from kvtrim.cache import cache_keyword

    n = len(feeds[0]) if feeds else 0
    if n == 0 or len(feeds) != len(caches) or any(len(f) != n for f in feeds):
        raise KVTrimError("step_rows needs one non-empty feed per cache, all of one length")
    device = next(model.parameters()).device
    ids = torch.tensor(feeds, device=device)
    pos = torch.stack([explicit_positions(c, n) for c in caches]).to(device)
    cache = caches[0] if len(caches) == 1 else MultiCache(caches)
    kw = {cache_keyword(): cache, "use_cache": True, "logits_to_keep": 0 if all_logits else 1, "position_ids": pos}
    logits = model(input_ids=ids, **kw).logits.float()
    return [logits[b] if all_logits else logits[b, -1] for b in range(len(caches))]


@dataclass
class _Pending:
    gen: Program
    request: "Step | Wait | None" = None
    done: bool = False
    result: object = None


def drive(model, programs: Mapping[Any, Program], *, batch: bool = True, max_rows: int = 64,
          on_done: Callable[[Hashable, object], None] | None = None) -> dict:
    """Run decoding ``programs`` to completion, batching their steps; returns ``{key: result}``.

    Each round, the steps that feed the same number of tokens (and ask for the same logits) run
    as the rows of one forward, at most ``max_rows`` at a time; a step with ``extra`` model inputs
    runs alone. A :class:`~kvtrim.decoding.Clock` on a step is charged its share (step time /
    rows). With ``batch=False`` every step runs alone, in program order: the batch-1 reference.
    ``on_done(key, result)`` is called as each program finishes (results can be written as they come).
    """
    state = {k: _Pending(g) for k, g in programs.items()}
    results: dict = {}

    def advance(key, value) -> None:
        p = state[key]
        try:
            p.request = p.gen.send(value)
        except StopIteration as stop:
            p.done, p.request = True, None
            results[key] = stop.value
            if on_done is not None:
                on_done(key, stop.value)

    for key in list(state):
        advance(key, None)
        if not batch:  # run each program through before starting the next
            while not state[key].done and _serve(model, state, results, advance, [key], max_rows=1):
                pass
    while any(not p.done for p in state.values()):
        live = [k for k, p in state.items() if not p.done]
        if not _serve(model, state, results, advance, live, max_rows=max_rows if batch else 1):
            missing = [r.key for r in (state[k].request for k in live) if isinstance(r, Wait)]
            raise KVTrimError(f"programs wait for results that never come: {sorted(map(str, missing))}")
    return results


def _serve(model, state, results, advance, keys, max_rows: int) -> bool:
    """Answer what can be answered among ``keys``; False when nothing could (a dead wait)."""
    progressed = False
    for key in keys:
        req = state[key].request
        if isinstance(req, Wait) and req.key in results:
            advance(key, results[req.key])
            progressed = True
    groups: dict[tuple, list] = {}
    for key in keys:
        req = state[key].request
        if isinstance(req, Step):
            group = ("alone", key) if req.extra else (len(req.ids), req.all_logits)
            groups.setdefault(group, []).append(key)
        elif req is not None and not isinstance(req, Wait):
            raise KVTrimError(f"a program can ask for Step or Wait, got {type(req).__name__}")
    for members in groups.values():
        for i in range(0, len(members), max_rows):
            chunk = members[i:i + max_rows]
            reqs = [state[k].request for k in chunk]
            t0 = time.perf_counter()
            if reqs[0].extra:
                with torch.inference_mode():
                    out = [forward(model, reqs[0].cache, reqs[0].ids, all_logits=reqs[0].all_logits, extra=reqs[0].extra)]
            else:
                out = step_rows(model, [r.cache for r in reqs], [r.ids for r in reqs], reqs[0].all_logits)
            dt = time.perf_counter() - t0
            for k, r, logits in zip(chunk, reqs, out):
                if r.clock is not None:
                    r.clock.charge(dt, len(chunk))
                advance(k, logits)
            progressed = True
    return progressed
